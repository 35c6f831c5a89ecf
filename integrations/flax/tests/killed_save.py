"""A writer killed during its second, asynchronous save (``checkpoint_worker.py``), and the
model to restore what it saved into: shared by the local and the bucket checkpoint tests."""

import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import Callable

import jax
import optax
from flax import nnx

import substrax_flax as sf
from substrax.mesh import DeviceMeshManager, MeshRules

WORKER = pathlib.Path(__file__).with_name("checkpoint_worker.py")
RULES = MeshRules(embed="data")


def kill_during_second_save(
    directory, first, *options: str, in_flight: Callable[[subprocess.Popen], None]
) -> int:
    """Runs the worker on ``directory`` and ``kill -9``s it once ``in_flight`` returns.

    Args:
      directory: The checkpoint directory (a path or a ``gs://`` URL).
      first: Where the worker writes step 1's first rows (``.npy``).
      *options: The worker's ROWS and LEASE.
      in_flight: Returns once the second save is writing (it may read the worker's stdout).

    Returns:
      The killed worker's pid.
    """
    process = subprocess.Popen(
        [sys.executable, str(WORKER), str(directory), str(first), *options],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        assert process.stdout.readline().strip() == "saved 1"
        in_flight(process)
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait(30)
        process.stdout.close()
    assert process.returncode == -signal.SIGKILL
    return process.pid


def restore_target(rows: int = 4096):
    """The worker's model (zeros, ``rows`` x 8192 over 8 devices) and its optimizer."""

    class Big(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jax.numpy.zeros((rows, 8192)), out_sharding=("embed", None))

    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    model = sf.create_sharded_model(lambda: Big(nnx.Rngs(1)), mesh, RULES)
    return model, sf.create_sharded_optimizer(model, optax.sgd(0.1), mesh, RULES)
