"""Pipeline schedules: the same loss and gradients as no pipeline, and the promised HLO/memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from substrax.hlo import collectives, dot_flops, while_bodies
from substrax.mesh import DeviceMeshManager, PipelineParallelStrategy
from substrax.pipeline import Pipeline, Schedule, microbatch_index

D = 16


def layer_fn(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def loss_fn(y, t):
    return jnp.mean((y - t) ** 2)


def _params(layers, seed=0):
    keys = jax.random.split(jax.random.key(seed), 2)
    w = jax.random.normal(keys[0], (layers, D, D)) / 4
    return {"w": w, "b": jax.random.normal(keys[1], (layers, D)) * 0.1}


def _batch(rows, seed=1):
    x = jax.random.normal(jax.random.key(seed), (rows, D))
    return x, jnp.sin(x)


@pytest.fixture(scope="module")
def mesh():
    return DeviceMeshManager.create_device_mesh({"pipe": 4, "data": 2})


def _pipeline(mesh, schedule, micro, repeats=1, **kwargs):
    stages = dict(mesh.shape)["pipe"]
    strategy = PipelineParallelStrategy("pipe", mesh.axis_names.index("pipe"), stages)
    return Pipeline(layer_fn, loss_fn, mesh, strategy, num_microbatches=micro,
                    schedule=schedule, repeats=repeats, batch_axes=("data",), **kwargs)  # fmt: skip


def _check(pipe, params, rows):
    x, t = _batch(rows)
    padded, mask = pipe.stack(params)
    loss, grads = jax.jit(pipe.loss_and_grads)(padded, mask, x, t)
    ref_loss, ref_grads = jax.value_and_grad(pipe.reference_loss)(params, x, t)
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    layers = jax.tree.leaves(params)[0].shape[0]
    unstacked = jax.tree.leaves(pipe.unstack(grads, layers))
    for got, want in zip(unstacked, jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    return grads, mask


ALL = ["gpipe", "1f1b", "circular", "interleaved", "zb-h1"]
SPLIT = ["1f1b", "interleaved", "zb-h1"]


def _repeats(schedule):
    return 2 if schedule in ("circular", "interleaved") else 1


@pytest.mark.parametrize("schedule", ALL)
@pytest.mark.parametrize("factor", [1, 2, 4])
def test_schedules_match_no_pipeline(mesh, schedule, factor):
    pipe = _pipeline(mesh, schedule, micro=4 * factor, repeats=_repeats(schedule))
    _check(pipe, _params(8), rows=2 * 4 * factor * 2)


@pytest.mark.parametrize(("schedule", "remat"), [("gpipe", True), ("1f1b", "full"),
                                                 ("zb-h1", "selective")])  # fmt: skip
def test_remat_matches_too(mesh, schedule, remat):
    _check(_pipeline(mesh, schedule, micro=4, remat=remat), _params(8), rows=16)


def test_three_axis_mesh_with_an_auto_model_axis():
    """The model axis stays Auto inside a stage: XLA shards the layers' products over it,
    inside the split schedules' per-stage branches too."""
    mesh = DeviceMeshManager.create_device_mesh({"pipe": 2, "data": 2, "model": 2})
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        _check(_pipeline(mesh, schedule, micro=4), _params(6), rows=16)


def test_uneven_layers_pad_with_exactly_zero_gradients(mesh):
    pipe = _pipeline(mesh, "1f1b", micro=4)
    assert pipe.layer_counts(10) == [[3], [3], [2], [2]]
    # a circular ring splits the stack into stages x repeats chunks by the same rule:
    # chunk r * stages + s is stage s's round r (10 layers in 8 chunks: 2, 2, then 1s)
    circular = _pipeline(mesh, "circular", micro=4, repeats=2)
    assert circular.layer_counts(10) == [[2, 1], [2, 1], [1, 1], [1, 1]]
    with pytest.raises(ValueError, match=r"Cannot split 7 layers into 8 chunks"):
        circular.layer_counts(7)
    grads, mask = _check(pipe, _params(10), rows=16)
    padding = ~np.asarray(mask)
    for leaf in jax.tree.leaves(grads):
        assert np.all(np.asarray(leaf)[padding] == 0.0)
    assert padding.sum() == 2


@pytest.mark.parametrize(("schedule", "repeats"), [("1f1b", 1), ("circular", 2)])
def test_a_stack_stored_padded_is_placed_by_a_reshape_and_round_trips(mesh, schedule, repeats):
    pipe = _pipeline(mesh, schedule, micro=8, repeats=repeats)
    params = _params(10)
    slots = pipe.num_slots(10)
    assert slots == (12 if repeats == 1 else 16)  # widest stage (chunk) x stages (x rounds)
    stored = pipe.unstack(pipe.stack(params)[0], 10, keep_padding=True)
    assert {leaf.shape[0] for leaf in jax.tree.leaves(stored)} == {slots}
    padded, mask = pipe.stack(stored, 10)
    want, want_mask = pipe.stack(params)
    np.testing.assert_array_equal(mask, want_mask)
    for got, ref in zip(jax.tree.leaves(padded), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(got, ref)
        assert got.sharding.spec[0] == "pipe"
    back = pipe.unstack(padded, 10)
    for got, ref in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(got, ref)
    with pytest.raises(ValueError, match="A stack of 11 layers is neither the 10 layers"):
        pipe.stack(_params(11), 10)


@pytest.mark.parametrize("schedule", ALL)
def test_hlo_reduces_gradients_after_the_loop_and_permutes_inside(mesh, schedule):
    pipe = _pipeline(mesh, schedule, micro=4, repeats=_repeats(schedule))
    padded, mask = pipe.stack(_params(8))
    x, t = _batch(16)
    text = jax.jit(pipe.loss_and_grads).lower(padded, mask, x, t).compile().as_text()
    bodies, ops = while_bodies(text), collectives(text)
    in_loops = [op.kind for op in ops if op.computation in bodies]
    assert "all-reduce" not in in_loops and "reduce-scatter" not in in_loops
    # one activation permute forward and one cotangent permute back
    assert in_loops.count("collective-permute") == 2
    assert any(op.kind == "all-reduce" and op.computation not in bodies for op in ops)


@pytest.mark.parametrize(
    ("schedule", "repeats"), [("gpipe", 1), ("1f1b", 1), ("circular", 2), ("interleaved", 2)]
)
def test_gradients_reduce_scatter_along_their_grad_dims(mesh, schedule, repeats):
    pipe = _pipeline(mesh, schedule, micro=4, repeats=repeats)
    params = _params(8)
    padded, mask = pipe.stack(params)
    x, t = _batch(16)
    dims = {"w": 1, "b": None}  # ZeRO's slices: w's columns over the 2 data devices; b whole

    def run(padded, mask, x, t):
        loss, (grads, _, dx) = pipe.value_and_grad(padded, mask, x, t, grad_dims=dims)
        return loss, grads, dx

    loss, grads, dx = jax.jit(run)(padded, mask, x, t)
    assert grads["w"].sharding.spec == P("pipe", None, None, None, "data")
    assert grads["b"].sharding.spec == P("pipe")
    ref_loss, (ref_grads, ref_dx) = jax.value_and_grad(pipe.reference_loss, argnums=(0, 1))(
        params, x, t
    )
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    np.testing.assert_allclose(dx, ref_dx, atol=1e-6)
    for got, want in zip(jax.tree.leaves(pipe.unstack(grads, 8)), jax.tree.leaves(ref_grads),
                         strict=True):  # fmt: skip
        np.testing.assert_allclose(got, want, atol=1e-5)
    text = jax.jit(run).lower(padded, mask, x, t).compile().as_text()
    bodies = while_bodies(text)
    after = [op for op in collectives(text) if op.computation not in bodies]
    w_bytes = 2 * D * D * 4  # this stage's two layers of w
    assert sum(op.result_bytes for op in after if op.kind == "reduce-scatter") == w_bytes / 2
    assert sum(op.result_bytes for op in after if op.kind == "all-reduce") < w_bytes / 2
    odd, _ = pipe.stack({"w": params["w"], "b": jnp.zeros((8, 3))})
    with pytest.raises(ValueError, match=r"dimension 0 of a layer of shape \(3,\) does not div"):
        pipe.value_and_grad(odd, mask, x, t, grad_dims={"w": None, "b": 0})
    fsdp = _pipeline(mesh, schedule, micro=4, repeats=repeats, fsdp_axis="data")
    with pytest.raises(ValueError, match="grad_dims reduce-scatter over the batch axes; not with"):
        fsdp.value_and_grad(padded, mask, x, t, grad_dims=dims)


def _temp_bytes(pipe, micro, rows_per_microbatch=4, width=64):
    """Temp bytes of a compiled step; wide enough that activations, not the loop's
    per-tick tables (a few bytes per tick), are what grows with the microbatches."""
    params = {"w": jax.random.normal(jax.random.key(0), (8, width, width)) / width,
              "b": jnp.zeros((8, width))}  # fmt: skip
    padded, mask = pipe.stack(params)
    x = jax.random.normal(jax.random.key(1), (micro * rows_per_microbatch, width))
    xs, ts = pipe.microbatch(x), pipe.microbatch(jnp.sin(x))
    lowered = jax.jit(pipe.loss_and_grads, static_argnames="microbatched").lower(
        padded, mask, xs, ts, microbatched=True
    )
    return lowered.compile().memory_analysis().temp_size_in_bytes


def test_split_schedules_hold_memory_flat_in_microbatches_and_gpipe_does_not(mesh):
    temps = {
        (schedule, m): _temp_bytes(
            _pipeline(mesh, schedule, micro=m, repeats=_repeats(schedule)), m
        )
        for schedule in ("gpipe", *SPLIT)
        for m in (4, 32)
    }
    for schedule in SPLIT:
        assert temps[(schedule, 32)] <= 1.1 * temps[(schedule, 4)], temps
    assert temps[("gpipe", 32)] > 2 * temps[("gpipe", 4)], temps
    # ZB-H1 holds one microbatch more than 1F1B (and its deferred weights' cotangents)
    assert temps[("zb-h1", 32)] <= 1.2 * temps[("1f1b", 32)], temps
    # interleaved: chunks of half the layers, at most v x 1F1B's
    assert temps[("interleaved", 32)] <= 2 * temps[("1f1b", 32)], temps
    remat = _temp_bytes(_pipeline(mesh, "gpipe", micro=32, remat=True), 32)
    assert remat < temps[("gpipe", 32)]
    full = _temp_bytes(_pipeline(mesh, "1f1b", micro=32, remat="full"), 32)
    assert full < temps[("1f1b", 32)]


@pytest.mark.parametrize("schedule", ALL)
def test_schedule_is_valid(mesh, schedule):
    micro, repeats = 8, _repeats(schedule)
    pipe = _pipeline(mesh, schedule, micro=micro, repeats=repeats)
    table = pipe.schedule_table()
    ops = [(s.stage, s.op, s.microbatch, s.repeat) for s in table]
    assert len(ops) == len(set(ops))  # each op exactly once
    kinds = ("forward", "backward", "weight") if schedule in SPLIT else ("forward",)
    assert len(ops) == 4 * micro * repeats * len(kinds)
    assert len({(s.tick, s.stage) for s in table}) == len(table)  # one op per stage and tick
    when = {(s.stage, s.op, s.microbatch, s.repeat): s.tick for s in table}
    for i in range(micro):
        for r in range(repeats):
            for stage in range(4):
                before = (stage - 1, r) if stage else (3, r - 1)  # the virtual stage before
                if before[1] >= 0:  # a stage works on what the stage before it sent
                    assert (
                        when[(stage, "forward", i, r)] > when[(before[0], "forward", i, before[1])]
                    )
                    if schedule in SPLIT:  # and sends its gradient back once computed
                        back = when[(before[0], "backward", i, before[1])]
                        assert back > when[(stage, "backward", i, r)]
                if schedule in SPLIT:
                    f, b, w = (when[(stage, op, i, r)] for op in kinds)
                    assert f < b < w
    textbook = 3 / (repeats * micro + 3)
    if schedule in ("gpipe", "circular"):
        assert pipe.idle_fraction() == pytest.approx(textbook)
    else:
        ops_per_stage = 3 * micro * repeats
        assert pipe.idle_fraction() == pytest.approx(1 - ops_per_stage / pipe.num_ticks)
        assert pipe.idle_fraction() <= textbook


def test_the_split_schedules_reach_their_bubbles():
    """Issue 28's figures at 4 stages, M = 8: 1F1B at or under its textbook (S-1)/(M+S-1),
    interleaved v = 2 under (S-1)/(vM+S-1), ZB-H1 about a third of 1F1B's."""
    idle = {name: Schedule(name, 4, 8, repeats).idle_fraction()
            for name, repeats in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))}  # fmt: skip
    assert idle["1f1b"] <= 3 / 11 and idle["interleaved"] <= 3 / 19 and idle["zb-h1"] <= 0.12
    assert idle["zb-h1"] == pytest.approx(3 / 27)  # (S-1)/(3M+S-1)
    held = {name: Schedule(name, 4, 8, r).held() for name, r in (("1f1b", 1), ("zb-h1", 1))}
    assert held == {"1f1b": 4, "zb-h1": 5}


@pytest.mark.parametrize("schedule", ALL)
def test_no_hidden_work_in_the_bubble(mesh, schedule):
    """Compiled matrix FLOPs per device <= 1.05 x useful / (1 - idle), the useful FLOPs being
    one device's gradient of the same batch over the 8 devices; and a split schedule's idle
    tick computes nothing (its cheapest branch has no product)."""
    pipe = _pipeline(mesh, schedule, micro=8, repeats=_repeats(schedule))
    params = _params(8)
    x, t = _batch(32)
    padded, mask = pipe.stack(params)
    text = jax.jit(pipe.loss_and_grads).lower(padded, mask, x, t).compile().as_text()
    reference = jax.jit(jax.grad(pipe.reference_loss)).lower(params, x, t).compile().as_text()
    useful = dot_flops(reference) / 8
    assert dot_flops(text) <= 1.05 * useful / (1 - pipe.idle_fraction())
    if schedule in SPLIT:
        assert dot_flops(text, branch=min) < 0.05 * useful


def test_bad_input(mesh):
    strategy = PipelineParallelStrategy("pipe", 0, 4)
    with pytest.raises(ValueError, match="at least as many microbatches as stages: got 2"):
        Pipeline(layer_fn, loss_fn, mesh, strategy, num_microbatches=2, schedule="circular",
                 repeats=2)  # fmt: skip
    with pytest.raises(ValueError, match="has 2 stages but mesh axis 'pipe' has size 4"):
        Pipeline(layer_fn, loss_fn, mesh, PipelineParallelStrategy("pipe", 0, 2),
                 num_microbatches=4)  # fmt: skip
    with pytest.raises(ValueError, match="Unknown schedule 'zb'"):
        Pipeline(layer_fn, loss_fn, mesh, strategy, num_microbatches=4, schedule="zb")
    pipe = _pipeline(mesh, "gpipe", micro=4)
    with pytest.raises(ValueError, match="Cannot assign 3 layers to 4 pipeline stages"):
        pipe.stack(_params(3))
    padded, mask = pipe.stack(_params(8))
    x, t = _batch(12)
    with pytest.raises(ValueError, match="12 rows does not split into 4 microbatches of 2"):
        pipe.loss_and_grads(padded, mask, x, t)
    widen = {"w": jnp.ones((8, D, 2 * D)), "b": jnp.ones((8, 2 * D))}
    padded, mask = pipe.stack(widen)
    x, t = _batch(16)
    with pytest.raises(ValueError, match=r"layer_fn must keep its input's shape"):
        pipe.loss_and_grads(padded, mask, x, t)


def head_loss(y, t, head):
    return jnp.mean((y @ head["proj"] - t) ** 2)


@pytest.mark.parametrize("schedule", ALL)
def test_head_and_input_gradients_match_no_pipeline(mesh, schedule):
    strategy = PipelineParallelStrategy("pipe", 0, 4)
    repeats = _repeats(schedule)
    pipe = Pipeline(layer_fn, head_loss, mesh, strategy, num_microbatches=4,
                    schedule=schedule, repeats=repeats, batch_axes=("data",))  # fmt: skip
    params, head = _params(8), {"proj": jax.random.normal(jax.random.key(5), (D, D)) / 4}
    x, t = _batch(16)
    padded, mask = pipe.stack(params)
    loss, (grads, dhead, dx) = jax.jit(pipe.value_and_grad)(padded, mask, x, t, head)
    ref_loss, (ref_g, ref_dx, ref_dhead) = jax.value_and_grad(
        pipe.reference_loss, argnums=(0, 1, 3)
    )(params, x, t, head)
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    np.testing.assert_allclose(dhead["proj"], ref_dhead["proj"], atol=1e-5)
    np.testing.assert_allclose(dx, ref_dx, atol=1e-6)
    got = jax.tree.leaves(pipe.unstack(grads, 8))
    for a, b in zip(got, jax.tree.leaves(ref_g), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # the head's and the inputs' gradients are summed once, after the loop, not per tick
    text = jax.jit(pipe.value_and_grad).lower(padded, mask, x, t, head).compile().as_text()
    bodies = while_bodies(text)
    in_loops = [op.kind for op in collectives(text) if op.computation in bodies]
    assert "all-reduce" not in in_loops and "reduce-scatter" not in in_loops


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_layer_and_loss_functions_see_their_microbatch(mesh, schedule):
    """``microbatch_index()`` is the index of the microbatch being computed, in both passes."""

    def shifted(p, x):  # adds the microbatch's index: the loss says which index each saw
        index = microbatch_index()
        return x * p["w"][0, 0] + (0.0 if index is None else index)

    def loss(y, t):  # and 10 m for microbatch m (None: a shape check)
        index = microbatch_index()
        return jnp.mean(y) + (0.0 if index is None else 10.0 * index)

    pipe = Pipeline(shifted, loss, mesh, PipelineParallelStrategy("pipe", 0, 4),
                    num_microbatches=4, schedule=schedule, batch_axes=("data",),
                    repeats=_repeats(schedule))  # fmt: skip
    params = {"w": jnp.ones((8, D, D))}
    x, t = _batch(16)
    padded, mask = pipe.stack(params)
    value = jax.jit(pipe.loss_and_grads)(padded, mask, x, t)[0]
    # eight layers each add m to microbatch m, the loss 10 m: the mean over m = 0..3 adds
    # 8 x 1.5 + 10 x 1.5
    assert float(value) == pytest.approx(float(jnp.mean(x)) + 27.0, abs=1e-4)
    assert microbatch_index() is None  # outside a pipeline's calls


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_fsdp_inside_the_pipeline_gathers_before_and_scatters_after_the_loop(mesh, schedule):
    pipe = _pipeline(mesh, schedule, micro=4, fsdp_axis="data")
    params = _params(8)
    padded, _ = pipe.stack(params)
    assert padded["w"].sharding.spec == P("pipe", None, None, "data")
    grads, _ = _check(pipe, params, rows=16)
    assert grads["w"].sharding.spec == padded["w"].sharding.spec
    padded, mask = pipe.stack(params)
    x, t = _batch(16)
    text = jax.jit(pipe.loss_and_grads).lower(padded, mask, x, t).compile().as_text()
    bodies, ops = while_bodies(text), collectives(text)
    outside = [op.kind for op in ops if op.computation not in bodies]
    inside = [op.kind for op in ops if op.computation in bodies]
    assert outside.count("all-gather") == 2 and outside.count("reduce-scatter") == 2
    assert set(inside) == {"collective-permute"}


def test_fsdp_axis_must_be_a_data_axis(mesh):
    with pytest.raises(
        ValueError, match=r"fsdp_axis 'model' must be one of batch_axes \('data',\)"
    ):
        _pipeline(mesh, "gpipe", micro=4, fsdp_axis="model")


def _loss_and_aux(y, t):
    return jnp.mean((y - t) ** 2), {"y2": jnp.mean(y**2), "t": jnp.mean(t)}


@pytest.mark.parametrize(
    ("schedule", "grad_dims"), [("gpipe", None), ("gpipe", 0), ("1f1b", None), ("interleaved", 0)]
)
def test_aux_is_the_mean_over_every_microbatch(mesh, schedule, grad_dims):
    strategy = PipelineParallelStrategy("pipe", 0, 4)
    pipe = Pipeline(layer_fn, _loss_and_aux, mesh, strategy, num_microbatches=4,
                    schedule=schedule, batch_axes=("data",), has_aux=True,
                    repeats=_repeats(schedule))  # fmt: skip
    params = _params(8)
    x, t = _batch(16)
    padded, mask = pipe.stack(params)
    dims = None if grad_dims is None else {"w": grad_dims, "b": grad_dims}
    (loss, aux), _ = jax.jit(functools.partial(pipe.value_and_grad, grad_dims=dims))(
        padded, mask, x, t
    )
    ys = jax.lax.scan(lambda h, p: (layer_fn(p, h), None), x, params)[0]
    assert abs(float(loss) - float(jnp.mean((ys - t) ** 2))) < 1e-5
    np.testing.assert_allclose(float(aux["y2"]), float(jnp.mean(ys**2)), rtol=1e-5)
    np.testing.assert_allclose(float(aux["t"]), float(jnp.mean(t)), rtol=1e-5, atol=1e-7)


def _layer_with_frozen(pair, x):
    trained, frozen = pair
    return jnp.tanh(x @ (trained["w"] + frozen["w0"]) + frozen["b"])


@pytest.mark.parametrize(
    ("schedule", "fsdp"), [("gpipe", False), ("1f1b", False), ("gpipe", True), ("zb-h1", True)]
)
def test_frozen_layer_parameters_are_used_but_not_differentiated(mesh, schedule, fsdp):
    strategy = PipelineParallelStrategy("pipe", 0, 4)
    pipe = Pipeline(_layer_with_frozen, loss_fn, mesh, strategy, num_microbatches=4,
                    schedule=schedule, batch_axes=("data",),
                    fsdp_axis="data" if fsdp else None)  # fmt: skip
    params = _params(8)
    trained = {"w": params["w"]}
    frozen = {"w0": params["w"] * 0.5, "b": params["b"]}
    x, t = _batch(16)
    padded, mask = pipe.stack(trained)
    still, _ = pipe.stack(frozen)
    run = jax.jit(functools.partial(pipe.value_and_grad, frozen=still))
    loss, (grads, _, _) = run(padded, mask, x, t)

    def reference(w):
        layers = {"w": w + frozen["w0"], "b": frozen["b"]}
        ys = jax.lax.scan(lambda h, p: (layer_fn(p, h), None), x, layers)[0]
        return jnp.mean((ys - t) ** 2)

    want, dw = jax.value_and_grad(reference)(trained["w"])
    assert abs(float(loss) - float(want)) < 1e-5
    np.testing.assert_allclose(pipe.unstack(grads, 8)["w"], dw, atol=1e-5)
    # only the trained weights' gradients are reduced: the frozen ones' bytes move nowhere
    text = run.lower(padded, mask, x, t).compile().as_text()
    reduced = sum(op.result_bytes for op in collectives(text, 8)
                  if op.kind in ("all-reduce", "reduce-scatter"))  # fmt: skip

    def all_trained(p, x):
        return _layer_with_frozen(({"w": p["w"]}, {"w0": p["w0"], "b": p["b"]}), x)

    everything = jax.jit(
        Pipeline(
            all_trained,
            loss_fn,
            mesh,
            strategy,
            num_microbatches=4,
            schedule=schedule,
            batch_axes=("data",),
            fsdp_axis="data" if fsdp else None,
        ).value_and_grad
    )
    both, _ = pipe.stack({**trained, **frozen})
    text = everything.lower(both, mask, x, t).compile().as_text()
    reduced_all = sum(op.result_bytes for op in collectives(text, 8)
                      if op.kind in ("all-reduce", "reduce-scatter"))  # fmt: skip
    # w's gradients only: what the all-trained run reduces more is w0's and b's, one stage's
    # layers each (2 of 8), FSDP shards where the data axis shards them
    frozen_grads = sum(a.size * 4 // 4 // (2 if fsdp else 1) for a in jax.tree.leaves(frozen))
    assert reduced_all - reduced >= frozen_grads
