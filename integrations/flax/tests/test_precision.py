"""Mixed precision: bf16 on the wire and in compute, f32 master weights, losses close to f32.

The names (``"f32"``, ``"mixed"``, ``"bf16"``) mean the same to the step and the planner.

XLA's CPU compiler widens bf16 collectives to f32, so the traffic the program asks for is read
off the lowered StableHLO (accelerators run those collectives in bf16).
"""

import re

import gpt
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax_test_models import StackedTransformer, tokens
from test_pipeline_step import block, embed, head

import substrax_flax as sf
from substrax.hlo import collectives, traffic_by_kind
from substrax.layout import Layout
from substrax.mesh import DeviceMeshManager, MeshRules
from substrax.planner import Workload
from substrax.planner._estimate import PRECISION_BYTES
from substrax.spmd import PRECISIONS, MixedPrecision, as_precision

CONFIG = gpt.Config(vocab=256, d_model=64, heads=4, mlp=256, layers=2, seq=16)
BATCHES = [gpt.batch_at(i, 16, CONFIG.seq, 0) for i in range(3)]


def _run(precision, layout="fsdp", shape=None, **options):
    mesh = DeviceMeshManager.create_device_mesh(shape or {"data": 8})
    model = sf.create_sharded_model(
        lambda: gpt.GPT(CONFIG, nnx.Rngs(0)), mesh, layout=Layout.named(layout, mesh)
    )
    optimizer = sf.create_sharded_optimizer(model, gpt.optimizer(3e-3))
    step = sf.make_train_step(gpt.loss_fn, precision=precision, **options)
    lowered = step.lower(model, optimizer, BATCHES[0]).as_text()
    losses = [float(step(model, optimizer, b)["loss"]) for b in BATCHES]
    return lowered, losses, model, optimizer


@pytest.fixture(scope="module")
def full():
    return _run(None)


def _total(lowered):
    return sum(kind["bytes"] for kind in traffic_by_kind(lowered, 8).values())


def _dtypes(lowered, op):
    """The result dtypes of every ``op`` (its type ends its line, or its region's)."""
    found, pending = set(), False
    for line in lowered.splitlines():
        pending = pending or f'"stablehlo.{op}"' in line
        if pending and ") -> " in line:
            found.update(re.findall(r"tensor<[0-9x]*([a-z]+[0-9]*)>", line.rsplit(") -> ", 1)[1]))
            pending = False
    return found


def test_mixed_halves_the_traffic_and_keeps_f32_master_weights(full):
    lowered, losses, model, optimizer = _run("mixed")
    assert _total(lowered) <= 0.55 * _total(full[0])
    assert _dtypes(lowered, "all_gather") == {"bf16"}  # gathered in bf16
    assert {op.kind for op in collectives(lowered, 8)} >= {"all-gather", "reduce-scatter"}
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert {p.dtype for p in params} == {jnp.dtype(jnp.float32)}
    moments = [x for x in jax.tree.leaves(nnx.state(optimizer)) if x.ndim > 0]
    assert {m.dtype for m in moments} == {jnp.dtype(jnp.float32)}
    # the f32 master weights took the updates: the bf16 run's model differs from the f32 one's
    # by rounding only, and the losses stay within bf16's relative precision of f32's
    np.testing.assert_allclose(losses, full[1], rtol=2e-2)
    assert losses != full[1]
    ref = jax.tree.leaves(nnx.state(full[2], nnx.Param))
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(params, ref, strict=True)) < 1e-2


def test_reductions_in_f32_with_bf16_gathers():
    policy = MixedPrecision(compute_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    lowered, _, _, _ = _run(policy, layout="hsdp", shape={"data": 2, "fsdp": 4})
    assert _dtypes(lowered, "all_gather") == {"bf16"}
    assert _dtypes(lowered, "reduce_scatter") == {"f32"}


def test_accumulation_in_bf16_sums_in_the_stored_dtype(full):
    _, losses, model, _ = _run("mixed", microbatches=2)
    np.testing.assert_allclose(losses, full[1], rtol=2e-2)
    assert {p.dtype for p in jax.tree.leaves(nnx.state(model, nnx.Param))} == {
        jnp.dtype(jnp.float32)
    }


def test_xla_partitioned_step_computes_in_bf16(full):
    lowered, losses, _, _ = _run("mixed", data_parallel="xla")
    assert re.search(r"stablehlo\.dot_general .*tensor<[0-9x]*bf16>", lowered)
    np.testing.assert_allclose(losses, full[1], rtol=2e-2)


def test_pipeline_stages_compute_in_bf16():
    mesh = DeviceMeshManager.create_device_mesh({"pipe": 4, "data": 2})
    rules = MeshRules(data="data").extend(
        layers="pipe", vocab=None, kv=None, mlp=None, heads=None, embed=None
    )
    runs = {}
    for precision in ("f32", "mixed"):
        model = sf.create_sharded_model(lambda: StackedTransformer(nnx.Rngs(0), layers=4), mesh,
                                        rules)  # fmt: skip
        optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), mesh, rules)
        step = sf.make_train_step(sf.Stages(embed, block, head, stack="blocks"), mesh, rules,
                                  microbatches=4, precision=precision)  # fmt: skip
        lowered = step.lower(model, optimizer, tokens(seed=0)).as_text()
        runs[precision] = [float(step(model, optimizer, tokens(seed=i))["loss"]) for i in range(2)]
    assert _dtypes(lowered, "collective_permute") == {"bf16"}  # activations between stages
    np.testing.assert_allclose(runs["mixed"], runs["f32"], rtol=2e-2)


def test_bad_policies_are_named():
    with pytest.raises(ValueError, match="compute_dtype must be a floating-point dtype, got int32"):
        MixedPrecision(compute_dtype=jnp.int32)
    with pytest.raises(ValueError, match="gather_dtype must be a dtype, got 'half-ish'"):
        MixedPrecision(gather_dtype="half-ish")
    with pytest.raises(ValueError, match=r"one of \('f32', 'mixed', 'bf16'\), got 'fp8'"):
        sf.make_train_step(gpt.loss_fn, precision="fp8")
    # the planner's names are the step's: "fp32" is neither's
    with pytest.raises(ValueError, match=r"precision 'fp32'; choose one of f32, mixed, bf16"):
        Workload(batch_tokens=1024, seq=16, precision="fp32")


def test_precision_names_mean_the_same_to_the_step_and_the_planner():
    assert tuple(PRECISION_BYTES) == PRECISIONS
    for name, (stored, wire) in PRECISION_BYTES.items():
        policy = as_precision(name)
        assert (policy.param_dtype or jnp.dtype(jnp.float32)).itemsize == stored, name
        assert (policy.gather or jnp.dtype(jnp.float32)).itemsize == wire, name


def test_bf16_stores_bf16_parameters_and_says_so_for_f32_ones():
    with pytest.raises(TypeError, match=r"stores parameters in bfloat16.*precision='mixed'"):
        _run("bf16")
    policy = MixedPrecision(param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
    with pytest.raises(TypeError, match=r"stores parameters in bfloat16, but \S+ is float32"):
        _run(policy)


def test_parameters_stored_in_bfloat16_on_a_tensor_axis_take_the_path_cpu_compiles():
    """A model stored in bfloat16 computes in bfloat16 under the "f32" policy (it casts nothing):
    XLA's CPU compiler aborts the process on a bf16 all-reduce outside a manual region, so the
    step takes XLA's partitioning and says why, instead of aborting."""
    from flax_test_models import Transformer, token_loss

    from substrax import ShardingWarning

    def stored_in_bf16():
        model = Transformer(nnx.Rngs(0))
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
        return model

    layout = Layout.named("fsdp+tp", {"data": 2, "model": 4})
    model = sf.create_sharded_model(stored_in_bf16, layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.adam(1e-3))
    step = sf.make_train_step(token_loss)
    with pytest.warns(ShardingWarning, match="aborts on bfloat16 all-reduces over the axes"):
        metrics = step(model, optimizer, tokens())
    assert metrics["path"] == "xla" and np.isfinite(float(metrics["loss"]))
