"""Models written for Explicit axes stay Explicit; models written for Auto axes keep the twin.

On a ``jax.make_mesh`` mesh (Explicit axes), each trains as on one device: a Qwen3-style
decoder (specs in metadata, ``out_sharding=`` in its code, a KV cache made with
``jnp.zeros(..., out_sharding=...)``), a Gemma-style decoder (specs in its arrays' types,
``reshard``), and the example decoder written for Auto axes.
"""

import explicit_models as em
import gpt
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

import substrax_flax as sf
from substrax import ShardingWarning

CONFIG = em.Config()
BATCHES = [em.tokens(i, CONFIG) for i in range(3)]


def _flax_one_device(cls):
    """Plain Flax on one device (a mesh of the same names, of size 1), as the model's authors
    run it."""
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        model = cls(CONFIG, nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, batch):
            loss, grads = nnx.value_and_grad(em.loss_fn)(model, batch)
            optimizer.update(model, grads)
            return loss

        return [float(step(model, optimizer, b)) for b in BATCHES]


def _mesh_line(plan) -> tuple[str, str]:
    """The plan's ``mesh`` decision: its value and its reason."""
    decision = next(d for d in plan.decisions if d.name == "mesh")
    return decision.value, decision.reason


@pytest.mark.parametrize(
    ("cls", "evidence"),
    [(em.CachedDecoder, "the loss traces on the Explicit mesh and not on its Auto twin"),
     (em.SpecDecoder, "the model's variables carry their specs in their types")],
    ids=["qwen3-style", "gemma-style"],
)  # fmt: skip
def test_a_model_written_for_explicit_axes_trains_on_them_as_on_one_device(cls, evidence):
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"))
    model = sf.create_sharded_model(lambda: cls(CONFIG, nnx.Rngs(0)), mesh)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2))
    step = sf.make_train_step(em.loss_fn, batch_axes=("fsdp",))
    with pytest.warns(ShardingWarning, match=r"names the batch axes \('fsdp',\)"):
        plan = step.plan_for(model, optimizer, BATCHES[0])
    value, reason = _mesh_line(plan)
    assert value == "Explicit axes" and evidence in reason
    assert set(plan.mesh.axis_types) == {AxisType.Explicit}
    losses = [float(step(model, optimizer, b)["loss"]) for b in BATCHES]
    np.testing.assert_allclose(losses, _flax_one_device(cls), rtol=1e-5)
    kernel = model.blocks[0].up.kernel if cls is em.CachedDecoder else model.blocks[0].w_up
    assert kernel[...].sharding.spec == em.WEIGHTS["up"]  # still laid out as the model says


def test_a_model_written_for_auto_axes_keeps_the_twin_and_the_manual_step():
    config = gpt.Config(vocab=128, d_model=32, heads=4, mlp=64, layers=1, seq=16)
    batch = gpt.batch_at(0, 16, config.seq)
    mesh = jax.make_mesh((8,), ("data",))
    model = sf.create_sharded_model(lambda: gpt.GPT(config, nnx.Rngs(0)), mesh, layout="fsdp")
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2))
    step = sf.make_train_step(gpt.loss_fn)
    plan = step.plan_for(model, optimizer, batch)
    assert _mesh_line(plan)[0] == "Auto twin of the Explicit mesh" and plan.path == "manual"
    losses = [float(step(model, optimizer, batch)["loss"]) for _ in range(2)]
    one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    ref_model = sf.create_sharded_model(lambda: gpt.GPT(config, nnx.Rngs(0)), one, layout="fsdp")
    ref_opt = sf.create_sharded_optimizer(ref_model, optax.adamw(1e-2))
    ref_step = sf.make_train_step(gpt.loss_fn)
    want = [float(ref_step(ref_model, ref_opt, batch)["loss"]) for _ in range(2)]
    np.testing.assert_allclose(losses, want, rtol=1e-5)
