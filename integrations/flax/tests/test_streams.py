"""Random numbers on the manual data-parallel step are one device's: each device (and each
accumulation slice) computes its rows' share of the whole batch's draw, so the step with
dropout equals one device's on every layout, device count and accumulation."""

import dataclasses

import gpt
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import substrax_flax as sf
from substrax import ShardingWarning
from substrax.layout import Layout
from substrax_flax._streams import RowDraws, row_counts, row_draws, rows_impl, threefry_obstacle

ROWS, WIDTH = 8, 64


class Masked(nnx.Module):
    """Row ``i`` of the batch reads row ``ids[i]`` of ``table`` through dropout, so the update of
    each table row is that row's mask."""

    def __init__(self, rate: float, rngs: nnx.Rngs):
        self.table = nnx.Param(jnp.ones((ROWS, WIDTH)), out_sharding=("vocab", "embed"))
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, ids):
        return self.drop(self.table[...][ids]).sum()


def _loss(model, ids):
    return model(ids) / ids.shape[0]


def _one_device(factory):
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    return sf.create_sharded_model(factory, mesh=mesh, layout=Layout.named("dp", {"data": 1}))


def _masks(rate, layout=None, seed=0, steps=1, microbatches=1) -> np.ndarray:
    """The masks each row drew (1 kept, 0 dropped), one per step, from the table's updates."""
    factory = lambda: Masked(rate, nnx.Rngs(dropout=seed))  # noqa: E731
    if layout is None:
        model = _one_device(factory)
    else:
        model = sf.create_sharded_model(factory, layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.sgd(1.0))
    step = sf.make_train_step(_loss, microbatches=microbatches)
    ids = np.arange(ROWS, dtype=np.int32)
    if layout is not None and layout.batch_degree > 1:
        assert step.data_parallel_for(model, optimizer, ids) == "manual"
    masks = []
    for _ in range(steps):
        before = np.asarray(model.table[...])
        step(model, optimizer, ids)
        masks.append((before - np.asarray(model.table[...])) != 0)
    return np.stack(masks)


def test_dropout_masks_are_one_devices_on_every_device_count_and_accumulation():
    one = _masks(0.5, steps=2)
    assert 0.3 < one.mean() < 0.7  # about half kept: dropout is on
    assert not (one[0] == one[1]).all()  # a new mask each step
    assert not (one == _masks(0.5, seed=1, steps=2)).all()  # the seed matters
    for degree, k in ((8, 1), (4, 2), (2, 4), (1, 8)):
        layout = Layout.named("fsdp", {"data": degree})
        got = _masks(0.5, layout, steps=2, microbatches=k)
        np.testing.assert_array_equal(got, one, err_msg=f"{degree} devices x {k} slices")


def test_a_dropout_rate_of_zero_keeps_every_row():
    assert _masks(0.0, Layout.named("fsdp", {"data": 8})).all()


TINY = gpt.Config(vocab=128, d_model=32, heads=4, mlp=64, layers=2, seq=16, dropout=0.3)
BATCH = gpt.batch_at(0, 16, TINY.seq)


def _losses(layout=None, microbatches=1, config=TINY, steps=3, remat="none"):
    factory = lambda: gpt.GPT(config, nnx.Rngs(0))  # noqa: E731
    model = (
        _one_device(factory) if layout is None else sf.create_sharded_model(factory, layout=layout)
    )
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2))
    step = sf.make_train_step(gpt.loss_fn, microbatches=microbatches, remat=remat)
    path = step.plan_for(model, optimizer, BATCH).path
    return [float(step(model, optimizer, BATCH)["loss"]) for _ in range(steps)], path


@pytest.fixture(scope="module")
def one_device_losses():
    losses, _ = _losses()
    undropped, _ = _losses(config=dataclasses.replace(TINY, dropout=0.0))
    assert abs(losses[-1] - undropped[-1]) > 1e-3  # the test can fail: dropout changes them
    return losses


@pytest.mark.parametrize(
    ("name", "axes", "microbatches", "remat"),
    [("dp", {"data": 8}, 1, "none"), ("fsdp", {"data": 8}, 1, "none"),
     ("fsdp+tp", {"data": 4, "model": 2}, 1, "none"), ("zero1", {"data": 8}, 1, "none"),
     ("fsdp", {"data": 4}, 2, "none"), ("fsdp+tp", {"data": 4, "model": 2}, 1, "offload")],
    ids=["dp", "fsdp", "fsdp+tp", "zero1", "fsdp-accumulated", "fsdp+tp-offload"],
)  # fmt: skip
def test_a_decoder_with_dropout_trains_as_on_one_device(one_device_losses, name, axes,
                                                        microbatches, remat):  # fmt: skip
    """Recomputed blocks (remat offload) draw the same masks again in the backward pass."""
    losses, path = _losses(Layout.named(name, axes), microbatches, remat=remat)
    assert path == "manual"
    np.testing.assert_allclose(losses, one_device_losses, rtol=1e-5)


def test_the_plan_says_how_the_draws_split():
    model = sf.create_sharded_model(lambda: gpt.GPT(TINY, nnx.Rngs(0)),
                                    layout=Layout.named("fsdp", {"data": 8}))  # fmt: skip
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2))
    plan = sf.make_train_step(gpt.loss_fn).plan_for(model, optimizer, BATCH)
    assert plan.draws is not None and plan.draws.blocks == 8
    line = next(line for line in str(plan).splitlines() if line.strip().startswith("random"))
    assert line.split(None, 1)[1] == (
        "one device's draws: draws of 1 shape(s) split with the rows (dimension 0), of 0 not; 8 "
        "blocks of rows; each device computes its rows' share of the whole batch's"
    )


class Noisy(nnx.Module):
    """Adds noise of a shape that does not split with the rows (one more than the batch)."""

    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jnp.ones((8, 8)), out_sharding=("embed", "mlp"))
        self.rngs = rngs

    def __call__(self, x):
        noise = jax.random.normal(self.rngs.noise(), (x.shape[0] + 1,))
        return (x @ self.w[...]).sum() + noise.sum()


def test_a_draw_that_does_not_split_with_the_rows_keeps_xlas_step_and_says_why():
    model = sf.create_sharded_model(lambda: Noisy(nnx.Rngs(noise=0)),
                                    layout=Layout.named("fsdp", {"data": 8}))  # fmt: skip
    optimizer = sf.create_sharded_optimizer(model, optax.sgd(0.1))
    x = np.ones((16, 8), np.float32)
    with pytest.warns(ShardingWarning, match=r"shape \(17,\) on the whole batch.* runs XLA's"):
        plan = sf.make_train_step(lambda m, x: m(x)).plan_for(model, optimizer, x)
    assert plan.path == "xla"
    assert "shape (17,) on the whole batch and (3,) on 1/8 of its rows" in plan.reason
    with pytest.raises(ValueError, match=r"shape \(17,\) on the whole batch"):
        sf.make_train_step(lambda m, x: m(x), data_parallel="manual").plan_for(model, optimizer, x)


@pytest.mark.parametrize("abstract", [False, True])
def test_a_stream_of_another_prng_is_named_concrete_or_abstract(abstract):
    keys = [jax.random.key(0), jax.random.key(1, impl="rbg"), jax.random.key(2, impl="unsafe_rbg")]
    if abstract:  # as compile_for's model holds them
        keys = [jax.ShapeDtypeStruct(k.shape, k.dtype) for k in keys]
    assert threefry_obstacle(keys[:1]) is None
    assert threefry_obstacle(keys).startswith(
        "the model's random streams use the PRNG implementation(s) ['rbg', 'unsafe_rbg']"
    )


@pytest.mark.parametrize(
    ("shape", "dim", "blocks", "stride"),
    [((16, 5, 7), 0, 8, 1), ((3, 16, 6), 1, 4, 1), ((2, 3, 8), 2, 2, 1), ((16, 5), 0, 2, 4),
     ((3, 24, 2), 1, 3, 2)],
)  # fmt: skip
def test_a_blocks_counters_give_its_share_of_the_whole_draw(shape, dim, blocks, stride):
    """Contiguous blocks, and a pipeline's strided microbatches (rows m, m + M, ...)."""
    key = jax.random.key(3)
    data = jax.random.key_data(key)
    whole = np.asarray(jax.random.bits(key, shape))
    local = list(shape)
    local[dim] //= blocks * stride
    for block in range(blocks):
        for phase in range(stride):
            hi, lo = row_counts(tuple(local), dim, blocks, block, stride, phase)
            b1, b2 = jax.extend.random.threefry2x32_p.bind(data[0], data[1], hi, lo)
            rows = [(block * local[dim] + i) * stride + phase for i in range(local[dim])]
            np.testing.assert_array_equal(np.asarray(b1 ^ b2), np.take(whole, rows, axis=dim))


def test_row_keys_draw_narrow_widths_and_keep_their_block_through_fold_and_split():
    draws = RowDraws((((2, 6), 0),), blocks=4)
    key = jax.random.key(7)
    for block in range(4):
        data = jnp.concatenate([jax.random.key_data(key), jnp.array([block, 0], jnp.uint32)])
        rows = jax.random.wrap_key_data(data, impl=rows_impl(draws))
        whole = jax.random.fold_in(key, 5)
        mine = jax.random.fold_in(rows, 5)
        for bits in (8, 16, 32):
            dtype = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bits]
            share = jax.random.bits(whole, (8, 6), dtype)[2 * block : 2 * block + 2]
            np.testing.assert_array_equal(jax.random.bits(mine, (2, 6), dtype), share)
        split = jax.random.split(rows)[1]
        np.testing.assert_array_equal(jax.random.key_data(split)[2], block)


def test_draws_that_do_not_pair_are_refused_with_their_shapes():
    with pytest.raises(ValueError, match=r"3 times on the whole batch but 2 times"):
        row_draws([(8,), (8,), (3,)], [(2,), (2,)], 4)
    with pytest.raises(ValueError, match=r"shape \(8, 8\) on the whole batch and \(2, 2\)"):
        row_draws([(8, 8)], [(2, 2)], 4)
    with pytest.raises(ValueError, match=r"shape \(2,\) .* both split with the rows"):
        row_draws([(8,), (2,)], [(2,), (2,)], 4)
    with pytest.raises(ValueError, match=r"shape \(5,\) in the step, a shape its trace"):
        RowDraws((((2,), 0),), 4).dim((5,))
