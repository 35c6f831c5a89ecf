"""Random numbers on the manual data-parallel step: each device draws from the model's own
``nnx.Rngs`` streams folded with its position, so masks differ across devices, repeat across
runs, and a rate of 0 equals one device."""

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import substrax_flax as sf
from substrax.layout import Layout

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


def _masks(rate: float, seed: int = 0, steps: int = 1) -> np.ndarray:
    """The masks each row drew (1 kept, 0 dropped), one per step, from the table's updates."""
    layout = Layout.named("fsdp", {"data": 8})
    model = sf.create_sharded_model(lambda: Masked(rate, nnx.Rngs(dropout=seed)), layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.sgd(1.0))
    step = sf.make_train_step(_loss)
    ids = np.arange(ROWS, dtype=np.int32)
    assert step.data_parallel_for(model, optimizer, ids) == "manual"
    masks = []
    for _ in range(steps):
        before = np.asarray(model.table[...])
        step(model, optimizer, ids)
        masks.append((before - np.asarray(model.table[...])) != 0)
    return np.stack(masks)


def test_dropout_masks_differ_across_devices_and_repeat_across_runs():
    masks = _masks(0.5, steps=2)
    rows = masks[0]  # one row per device
    assert 0.3 < rows.mean() < 0.7  # about half kept
    assert len({r.tobytes() for r in rows}) == ROWS  # each device its own mask
    assert not (masks[0] == masks[1]).all()  # a new mask each step
    np.testing.assert_array_equal(masks, _masks(0.5, steps=2))  # same seed, same layout
    assert not (masks == _masks(0.5, seed=1, steps=2)).all()


def test_a_dropout_rate_of_zero_equals_one_device():
    assert _masks(0.0).all()


def test_a_decoder_with_dropout_moves_what_one_without_moves():
    """Two nnx.Dropout per block stay on the gather + reduce-scatter step: no all-reduce of
    gradients (the benchmark decoder at full size: 35.0 MiB either way, 52.5 on XLA's)."""
    import dataclasses

    import gpt

    from substrax.hlo import traffic_by_kind

    tiny = gpt.Config(vocab=256, d_model=64, heads=4, mlp=128, layers=2, seq=16)
    batch = gpt.batch_at(0, 16, tiny.seq)
    traffic = {}
    for rate in (0.0, 0.1):
        config = dataclasses.replace(tiny, dropout=rate)
        model = sf.create_sharded_model(lambda c=config: gpt.GPT(c, nnx.Rngs(0)),
                                        layout=Layout.named("fsdp", {"data": 8}))  # fmt: skip
        optimizer = sf.create_sharded_optimizer(model, gpt.optimizer())
        hlo = sf.make_train_step(gpt.loss_fn).lower(model, optimizer, batch).compile().as_text()
        traffic[rate] = traffic_by_kind(hlo, 8)
    assert model.blocks[0].attn_drop.rate == 0.1  # the test can fail: dropout is there
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
        assert traffic[0.1][kind] == traffic[0.0][kind], kind
    # the loss and metrics only: a gradient all-reduce would move as much as the scatter
    assert traffic[0.1]["all-reduce"]["bytes"] < traffic[0.1]["reduce-scatter"]["bytes"] / 100
