"""The non-finite guard: a NaN batch never reaches the weights, the optimizer or batch stats."""

import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import substrax_flax as sf
from substrax.hlo import collectives, conditional_branches
from substrax.mesh import DeviceMeshManager, MeshRules
from substrax_flax._nonfinite import all_finite

RULES = MeshRules(data="data", embed="data")


class Normed(nnx.Module):
    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", None))
        self.dense = nnx.Linear(8, 4, kernel_init=init, rngs=rngs)
        self.norm = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.dense(x))


def _loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _batch(seed, poison=False):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    if poison:
        x[3, 5] = np.nan
    return {"x": x, "y": rng.normal(size=(16, 4)).astype(np.float32)}


def _setup(**kwargs):
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    model = sf.create_sharded_model(lambda: Normed(nnx.Rngs(0)), mesh, RULES)
    optimizer = sf.create_sharded_optimizer(model, optax.adam(1e-2))
    return model, optimizer, sf.make_train_step(_loss, **kwargs)


def _leaves(model, optimizer):
    return [np.asarray(x) for x in jax.tree.leaves((nnx.state(model), nnx.state(optimizer)))]


def test_a_nan_batch_is_skipped_with_a_warning_naming_the_step():
    model, optimizer, step = _setup()
    assert bool(step(model, optimizer, _batch(0))["finite"])
    before = _leaves(model, optimizer)
    with pytest.warns(sf.NonFiniteWarning, match=r"Step 2 .* non-finite loss \(nan\).*skipped"):
        metrics = step(model, optimizer, _batch(1, poison=True))
        step(model, optimizer, _batch(2))  # the warning comes at the latest with the next call
    assert not bool(metrics["finite"]) and np.isnan(float(metrics["loss"]))
    # The poisoned step changed nothing (params, adam state, batch stats): the run equals one
    # that never saw that batch.
    clean_model, clean_optimizer, clean_step = _setup()
    clean_step(clean_model, clean_optimizer, _batch(0))
    assert all(
        np.array_equal(a, b)
        for a, b in zip(before, _leaves(clean_model, clean_optimizer), strict=True)
    )
    clean_step(clean_model, clean_optimizer, _batch(2))
    expected = _leaves(clean_model, clean_optimizer)
    for got, want in zip(_leaves(model, optimizer), expected, strict=True):
        np.testing.assert_array_equal(got, want)
    assert int(optimizer.step[...]) == 2


def test_raise_mode_stops_at_the_step_and_changes_nothing():
    model, optimizer, step = _setup(on_nonfinite="raise")
    step(model, optimizer, _batch(0))
    before = _leaves(model, optimizer)
    with pytest.raises(FloatingPointError, match=r"Step 2 .* non-finite loss"):
        step(model, optimizer, _batch(1, poison=True))
    for got, want in zip(_leaves(model, optimizer), before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_apply_mode_applies_the_update_and_says_so():
    model, optimizer, step = _setup(on_nonfinite="apply")
    step(model, optimizer, _batch(0))
    # step 3 starts from NaN weights: its own warning comes now or later, as its flag is ready
    with pytest.warns(sf.NonFiniteWarning) as record:
        step(model, optimizer, _batch(1, poison=True))
        step(model, optimizer, _batch(2))
    assert any(re.match(r"Step 2 .* it was applied", str(w.message)) for w in record)
    assert np.isnan(np.asarray(model.dense.kernel[...])).all()


def test_an_unknown_policy_is_a_clear_error():
    with pytest.raises(
        ValueError, match=r"on_nonfinite must be one of \('skip', 'raise', 'apply'\), got"
    ):
        sf.make_train_step(_loss, on_nonfinite="ignore")


class Square(nnx.Module):
    def __init__(self, dtype):
        self.w = nnx.Param(jnp.ones((16, 4), dtype), out_sharding=("embed", None))

    def __call__(self, x):
        return x.astype(self.w.dtype) @ self.w[...]


def _scaled_loss(scale):  # float32 gradients of `scale` on every weight, a finite loss
    return lambda model, x: (model(x).astype(jnp.float32) * scale).sum() / x.shape[0]


#: Updates that overflow by themselves, with a finite loss and finite gradients.
OVERFLOWS = {
    # adam's second moment squares 2e4: past float16's 65504
    "float16 adam": (jnp.float16, optax.adam(1e-3), 2e4),
    # 1e20 squared: past float32's 3.4e38 (the loss, 6.4e21, is finite)
    "float32 adam": (jnp.float32, optax.adam(1e-3), 1e20),
    "bfloat16 adam": (jnp.bfloat16, optax.adam(1e-3), 1e20),
    # a step of 1e38 x a gradient of 8: bfloat16 weights past 3.4e38
    "bfloat16 weights": (jnp.bfloat16, optax.sgd(1e38), 8.0),
}


@pytest.mark.parametrize("case", OVERFLOWS)
def test_an_update_that_overflows_by_itself_is_skipped_in_every_dtype(case):
    dtype, tx, scale = OVERFLOWS[case]
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    model = sf.create_sharded_model(lambda: Square(dtype), mesh, RULES)
    optimizer = sf.create_sharded_optimizer(model, tx)
    step = sf.make_train_step(_scaled_loss(scale))
    x = np.ones((8, 16), np.float32)
    plan = step.plan_for(model, optimizer, x)
    assert plan.check_state and "loss, gradients and the updated state" in str(plan)
    before = _leaves(model, optimizer)
    with pytest.warns(sf.NonFiniteWarning, match=r"non-finite gradient or updated state \(the "
                      r"loss was finite; the update overflowed"):  # fmt: skip
        metrics = step(model, optimizer, x)
        step._guard.flush()
    assert np.isfinite(float(metrics["loss"])) and not bool(metrics["finite"])
    for got, want in zip(_leaves(model, optimizer), before, strict=True):
        np.testing.assert_array_equal(got, want)  # nothing committed, everything finite
    # "apply" turns the guard off (the plan says so): the overflow reaches the state
    applying = sf.make_train_step(_scaled_loss(scale), on_nonfinite="apply")
    assert "on_nonfinite='apply'" in str(applying.plan_for(model, optimizer, x))
    applying(model, optimizer, x)
    assert not all(np.isfinite(leaf.astype(np.float32)).all()
                   for leaf in _leaves(model, optimizer))  # fmt: skip


def test_the_last_call_of_a_run_is_reported_at_exit(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "last.py"
    here = str(pathlib.Path(__file__).parent)
    script.write_text(
        "import jax\njax.config.update('jax_num_cpu_devices', 8)\n"
        f"import sys\nsys.path.insert(0, {here!r})\n"
        "import test_nonfinite as t\n"
        "model, optimizer, step = t._setup()\n"
        "step(model, optimizer, t._batch(0))\n"
        "step(model, optimizer, t._batch(1, poison=True))\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "NonFiniteWarning: Step 2 (call 2 of this train step) has a non-finite loss" in (
        out.stderr
    )


#: Eight arrays in three shapes, as a model's parameters and their moments come.
_SHAPES = [(16, 4), (4,), (16, 4), (8, 8), (4,), (16, 4), (8, 8), (4,)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", range(len(_SHAPES)))
def test_the_check_finds_one_bad_value_in_any_array_of_a_shared_shape(bad, where):
    arrays = [jnp.ones(shape) for shape in _SHAPES]
    assert bool(jax.jit(all_finite)(arrays))
    arrays[where] = arrays[where].at[(0,) * arrays[where].ndim].set(bad)
    assert not bool(jax.jit(all_finite)(arrays))


def test_the_compiled_check_reduces_each_distinct_shape_once():
    """A kernel per distinct shape, not per array: launches, not bytes, cost on small arrays."""
    arrays = [jnp.ones(shape) for shape in _SHAPES]
    text = jax.jit(all_finite).lower(arrays).compile().as_text()
    reductions = re.findall(r"= pred\[\] reduce\(", text)  # fused or not, one per shape group
    fusions = re.findall(r"^\s*%\S+ = pred\[\] fusion\(", text, re.MULTILINE)
    assert len(reductions) + len(fusions) <= len(set(_SHAPES)) + 1, text


def test_arrays_of_one_shape_sharded_differently_on_explicit_axes_are_checked_apart():
    """``&`` on them would be a sharding error under Explicit axes (as in the guide's models)."""
    mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Explicit,))
    bad = np.ones((32, 16), np.float32)
    bad[3, 5] = np.nan
    rows = jax.device_put(np.ones((32, 16), np.float32), jax.NamedSharding(mesh, jax.P("model")))
    for cols in (np.ones((32, 16), np.float32), bad):
        cols = jax.device_put(cols, jax.NamedSharding(mesh, jax.P(None, "model")))
        with jax.set_mesh(mesh):
            assert bool(jax.jit(all_finite)([rows, cols])) == bool(np.isfinite(cols).all())


def test_computed_again_an_update_takes_its_scalars_from_the_first_time():
    from substrax_flax._recompute import twice

    def update(x):
        norm = jnp.sqrt(jnp.sum(x * x))  # a global norm: a scalar
        return x / norm, norm

    def guarded(x):
        first, again = twice(update, x)
        return jax.lax.cond(jnp.isfinite(first[0]).all(), again, update, x), first

    x = jnp.arange(1.0, 9.0)
    (commit, norm), first = jax.jit(guarded)(x)
    np.testing.assert_allclose(commit, x / np.linalg.norm(x), rtol=1e-6)
    assert float(norm) == float(first[1])
    branches = jax.make_jaxpr(guarded)(x).eqns[-1].params["branches"]
    reductions = [[e for e in b.jaxpr.eqns if e.primitive.name == "reduce_sum"] for b in branches]
    assert [len(r) for r in reductions] == [1, 0]  # branch 1 (taken): the norm arrives computed


def test_the_guard_all_reduces_a_global_norm_once_and_commits_what_apply_commits():
    """The check computes the update (clip_by_global_norm's norm among it) and the commit
    takes the norm from it: no collective in the conditional's branches (before, the taken
    branch all-reduced the norm again); the state it commits is the unguarded step's."""
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    states, programs = [], []
    for policy in ("skip", "apply"):
        model = sf.create_sharded_model(lambda: Normed(nnx.Rngs(0)), mesh, RULES)
        optimizer = sf.create_sharded_optimizer(model, tx)
        step = sf.make_train_step(_loss, on_nonfinite=policy)
        programs.append(step.lower(model, optimizer, _batch(0)).compile().as_text())
        for seed in range(3):
            step(model, optimizer, _batch(seed))
        states.append(_leaves(model, optimizer))
    branches = conditional_branches(programs[0])
    assert programs[0].count("branch_computations=") == 1  # the guard's one conditional
    reduced_in = {c.computation for c in collectives(programs[0]) if c.kind == "all-reduce"}
    assert len(branches) == 2 and reduced_in and not reduced_in & branches
    for got, want in zip(*states, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
