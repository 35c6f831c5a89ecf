"""Models written the way people write them, created and trained sharded like one device.

Each gallery model is created under a named layout (dp, fsdp, fsdp+tp), gets its optimizer,
trains three steps with the default step and matches a plain nnx/optax run on one device (the
losses within 1e-5 relative, batch statistics too); it is checkpointed, trained one more step
and restored (under fsdp also into a freshly created model), leaf by leaf and sharding by
sharding.
"""

import functools
import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax_test_models import train
from gallery import (
    FLAX_PAIRS,
    GALLERY,
    PUBLISHED,
    DropoutMLP,
    ShortNames,
    token_loss,
    tokens,
)
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import substrax_flax as sf
from substrax import ShardingWarning
from substrax.layout import Layout
from substrax.mesh import DeviceMeshManager

MESH = {"data": 2, "model": 4}
STEPS = 3


def _tx():
    return optax.adamw(1e-2)


def _one_device_mesh():
    return DeviceMeshManager.create_device_mesh({"data": 1, "model": 1}, jax.devices()[:1])


@functools.cache
def reference(name):
    """Losses and final state of a plain nnx/optax run on one device."""
    entry = GALLERY[name]
    with nnx.use_eager_sharding(False), jax.set_mesh(_one_device_mesh()):
        model = entry.factory()
        optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
        losses = train(model, optimizer, [entry.batch(i) for i in range(STEPS)], entry.loss)
    return losses, jax.tree.map(_host, nnx.state(model, nnx.Not(nnx.Param)))


def _host(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _train(name, layout):
    entry = GALLERY[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingWarning)  # tiny widths: some do not divide
        model = sf.create_sharded_model(entry.factory, layout=layout)
    optimizer = sf.create_sharded_optimizer(model, _tx())
    step = sf.make_train_step(entry.loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ShardingWarning)
        mode = step.data_parallel_for(model, optimizer, entry.batch(0))
    said = [w for w in caught if "names the batch axes" in str(w.message)]
    if entry.needs_mesh:  # a bare P("data") in model code: XLA's step, decided before tracing
        mesh = jax.tree.leaves(nnx.state(model))[0].sharding.mesh
        explicit = AxisType.Explicit in tuple(mesh.axis_types)
        sharded = any(any(row.spec) for row in sf.sharding_report(model).rows)
        # said once where it costs traffic (dp all-reduces either way); Explicit: XLA anyway
        assert mode == "xla" and len(said) == (1 if sharded and not explicit else 0)
    else:
        assert said == []
    losses = [float(step(model, optimizer, entry.batch(0))["loss"])]
    losses += [float(step(model, optimizer, entry.batch(i))["loss"]) for i in range(1, STEPS)]
    return model, optimizer, losses, step


def _snapshot(model, optimizer):
    return [
        (_host(a), a.sharding) for a in jax.tree.leaves((nnx.state(model), nnx.state(optimizer)))
    ]


def _assert_restored(model, optimizer, saved):
    for (got, sharding), (want, want_sharding) in zip(_snapshot(model, optimizer), saved,
                                                      strict=True):  # fmt: skip
        np.testing.assert_array_equal(got, want)
        assert sharding == want_sharding


# dp for the models whose step differs under it (batch norms reduced over the devices, dropout
# streams folded per device, a bare P("data") keeps XLA's partitioning); every model under
# fsdp; fsdp+tp for those whose kernels or code meet the tensor axis differently (suite time).
TENSOR = ("explicit-decoder", "flax-guide", "resnet", "tied", "vit")
CASES = (
    [(name, "dp") for name in ("resnet", "dropout", "flax-guide")]
    + [(name, "fsdp") for name in sorted(GALLERY)]
    + [(name, "fsdp+tp") for name in TENSOR]
)


@pytest.mark.parametrize(("name", "layout_name"), CASES)
def test_gallery_model_trains_like_one_device_and_restores(name, layout_name, tmp_path):
    layout = Layout.named(layout_name, MESH)
    model, optimizer, losses, step = _train(name, layout)
    ref_losses, ref_rest = reference(name)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    rest = nnx.state(model, nnx.Not(nnx.Param))  # batch statistics, rng counts, data arrays
    for got, want in zip(jax.tree.leaves(rest), jax.tree.leaves(ref_rest), strict=True):
        np.testing.assert_allclose(_host(got), want, rtol=1e-5, atol=1e-6)
    checkpointer = sf.Checkpointer(tmp_path)
    checkpointer.save(model, optimizer, STEPS)
    saved = _snapshot(model, optimizer)
    step(model, optimizer, GALLERY[name].batch(STEPS))  # move on, then go back
    checkpointer.restore(model, optimizer)
    _assert_restored(model, optimizer, saved)
    if layout_name == "fsdp":  # and into a freshly created model (one layout: suite time)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ShardingWarning)
            fresh = sf.create_sharded_model(GALLERY[name].factory, layout=layout)
        fresh_optimizer = sf.create_sharded_optimizer(fresh, _tx())
        checkpointer.restore(fresh, fresh_optimizer)
        _assert_restored(fresh, fresh_optimizer, saved)
    checkpointer.close()


def test_explicit_style_specs_are_honoured_as_given():
    model = sf.create_sharded_model(GALLERY["explicit-decoder"].factory, layout="fsdp",
                                    mesh=DeviceMeshManager.create_device_mesh(MESH))  # fmt: skip
    assert model.wq[...].sharding.spec == P("model", "data", None)
    assert model.wo[...].sharding.spec == P("model", None, "data")
    report = sf.sharding_report(model)
    assert report.row("wq").rule == "model->model, data->('data', 'model')"


def test_explicit_style_models_train_on_an_explicit_mesh():
    mesh = DeviceMeshManager.create_device_mesh(MESH, axis_types=(AxisType.Explicit,) * 2)
    _, optimizer, losses, _ = _train("flax-guide", Layout.named("fsdp", mesh))
    np.testing.assert_allclose(losses, reference("flax-guide")[0], rtol=1e-5)
    assert int(optimizer.step[...]) == STEPS


def test_dropout_trains_at_half_rate():
    model = sf.create_sharded_model(lambda: DropoutMLP(nnx.Rngs(0), rate=0.5), layout="fsdp",
                                    mesh=DeviceMeshManager.create_device_mesh(MESH))  # fmt: skip
    optimizer = sf.create_sharded_optimizer(model, _tx())
    step = sf.make_train_step(token_loss)
    # the model's own stream draws per device: the manual step, no warning
    assert step.data_parallel_for(model, optimizer, tokens(0)) == "manual"
    first = float(step(model, optimizer, tokens(0))["loss"])
    count = int(model.drop.rngs.count[...])
    later = [float(step(model, optimizer, tokens(0))["loss"]) for _ in range(5)]
    assert int(model.drop.rngs.count[...]) == count + 5  # one draw per step, carried
    assert np.isfinite(later).all() and later[-1] < first


def test_short_annotations_and_flax_pairs_with_batch():
    mesh = DeviceMeshManager.create_device_mesh(MESH)
    model = sf.create_sharded_model(lambda: ShortNames(nnx.Rngs(0)), mesh, FLAX_PAIRS)
    row = sf.sharding_report(model).row("qkv")
    assert row.spec == P("model", None, None)
    assert [r.kind for r in row.reasons] == ["padded", "unmapped"]  # ('heads', None) maps nothing
    optimizer = sf.create_sharded_optimizer(model, _tx())
    metrics = sf.make_train_step(token_loss)(model, optimizer, tokens(0))  # batch axes: 'batch'
    np.testing.assert_allclose(float(metrics["loss"]), reference("short-names")[0][0], rtol=1e-5)


def _published_reference(entry):
    """Losses of a plain nnx/optax run on one device (Explicit axes where the model needs them)."""
    types = (AxisType.Explicit,) * 2 if entry.explicit else None
    mesh = DeviceMeshManager.create_device_mesh({"data": 1, "model": 1}, jax.devices()[:1],
                                                axis_types=types)  # fmt: skip
    with nnx.use_eager_sharding(False), jax.set_mesh(mesh):
        model = entry.factory()
        optimizer = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
        return train(model, optimizer, [entry.batch(i) for i in range(STEPS)], entry.loss)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_model_trains_like_one_device(name):
    """Configs, lists, sets, keys in the batch or the loss, own specs, Explicit-style types."""
    entry = PUBLISHED[name]
    types = (AxisType.Explicit,) * 2 if entry.explicit else None
    mesh = DeviceMeshManager.create_device_mesh(MESH, axis_types=types)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingWarning)  # tiny widths: some do not divide
        model = sf.create_sharded_model(entry.factory, mesh, entry.rules, layout=entry.layout)
    optimizer = sf.create_sharded_optimizer(model, _tx())
    step = sf.make_train_step(entry.loss)
    draws = name.startswith("drop-path")
    with (
        pytest.warns(ShardingWarning, match="draws random numbers")
        if draws
        else warnings.catch_warnings()
    ):  # a key shared by every device's rows: XLA's step, which equals one device, and says so
        mode = step.data_parallel_for(model, optimizer, entry.batch(0))
    assert mode == ("xla" if draws or entry.explicit else "manual")
    losses = [float(step(model, optimizer, entry.batch(i))["loss"]) for i in range(STEPS)]
    np.testing.assert_allclose(losses, _published_reference(entry), rtol=1e-5)
