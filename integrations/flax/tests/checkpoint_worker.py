"""Saves checkpoint 1 of a large state, then starts checkpoint 2 (the test kills it mid-save).

Saves are asynchronous (the default): save 2 first waits for save 1 to be written, then
writes in the background, where the test kills it.

Usage: ``checkpoint_worker.py DIRECTORY FIRST.npy [ROWS [LEASE]]`` (a ``gs://`` directory
takes a smaller state, ROWS rows of 8192, and a short lock lease).
"""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np
import optax
from flax import nnx

import substrax_flax as sf
from substrax.mesh import DeviceMeshManager, MeshRules

ROWS = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
LEASE = float(sys.argv[4]) if len(sys.argv) > 4 else 30.0


class Big(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(
            jax.random.normal(rngs.params(), (ROWS, 8192)), out_sharding=("embed", None)
        )


mesh = DeviceMeshManager.create_device_mesh({"data": 8})
rules = MeshRules(embed="data")
model = sf.create_sharded_model(lambda: Big(nnx.Rngs(0)), mesh, rules)
optimizer = sf.create_sharded_optimizer(model, optax.sgd(0.1), mesh, rules)
checkpointer = sf.Checkpointer(sys.argv[1], keep=3, asynchronous=True, lease=LEASE)
checkpointer.save(model, optimizer, 1, {"step": 1})
np.save(sys.argv[2], np.asarray(model.w[...][:4]))
print("saved 1", flush=True)
model.w[...] = model.w[...] + 1.0
checkpointer.save(model, optimizer, 2, {"step": 2})
print("saved 2", flush=True)
