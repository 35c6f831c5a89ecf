import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from substrax.mesh import DeviceMeshManager, MeshRules, fsdp_rules
from substrax.spmd import (
    active_rules,
    batch_sharding,
    check_rows,
    constrain,
    replicate,
    shard_batch,
    use_rules,
)


def test_shard_batch_over_one_axis(mesh_2x4):
    batch = {"x": np.arange(24.0).reshape(4, 6), "y": np.arange(4)}
    placed = shard_batch(batch, mesh_2x4, "data")
    assert placed["x"].sharding.spec == P("data")
    assert placed["x"].addressable_shards[0].data.shape == (2, 6)
    np.testing.assert_array_equal(placed["x"], batch["x"])
    np.testing.assert_array_equal(placed["y"], batch["y"])


def test_shard_batch_over_several_axes(mesh_2x4):
    placed = shard_batch(np.arange(16.0).reshape(8, 2), mesh_2x4, ("data", "model"))
    assert placed.sharding.spec == P(("data", "model"))
    assert placed.addressable_shards[0].data.shape == (1, 2)
    np.testing.assert_array_equal(placed, np.arange(16.0).reshape(8, 2))


def test_batch_that_does_not_divide_is_an_error(mesh_2x4):
    message = (
        "The batch's 6 rows (leaf ['x'] of shape (6, 2)) do not split evenly over the 8 "
        "devices of its batch axes ('data', 'model'); pass a batch of a multiple of 8 rows."
    )
    with pytest.raises(ValueError, match=re.escape(message)):  # the steps' check, word for word
        shard_batch({"x": np.ones((6, 2))}, mesh_2x4, ("data", "model"))
    with pytest.raises(ValueError, match=re.escape(message.replace("6, 2", "6, 16, 2"))):
        shard_batch({"x": jax.ShapeDtypeStruct((6, 16, 2), np.float32)}, mesh_2x4,
                    ("data", "model"))  # fmt: skip


def test_rows_that_split_over_the_replicas_and_their_microbatches_pass():
    check_rows(16, 8, ("data",), microbatches=2)
    check_rows(3, 1, (), microbatches=3)  # one replica: only the slices


@pytest.mark.parametrize(
    ("rows", "microbatches", "message"),
    [
        (12, 2, "The batch's 12 rows do not split evenly over the 8 devices of its batch axes "
                "('data',); pass a batch of a multiple of 16 rows (microbatches=2 slices each "
                "device's rows)."),
        (16, 4, "microbatches=4 slices each device's rows, but the batch's 16 rows over 8 "
                "data-parallel replicas (('data',)) give 2 per device; pass a batch of a "
                "multiple of 32 rows or a microbatches that divides 2."),
    ],
    ids=["over the replicas", "into microbatches"],
)  # fmt: skip
def test_rows_that_do_not_split_are_named_with_a_multiple_that_would(rows, microbatches, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_rows(rows, 8, ("data",), microbatches=microbatches)


def test_scalar_leaves_are_replicated_next_to_the_rows(mesh_2x4):
    key = jax.random.key(3)
    placed = shard_batch({"x": np.arange(16.0).reshape(8, 2), "lr": np.float32(0.1), "key": key},
                         mesh_2x4)  # fmt: skip
    assert placed["x"].sharding.spec == P("data")
    for name in ("lr", "key"):
        assert placed[name].sharding.is_fully_replicated and placed[name].shape == ()
        assert len(placed[name].sharding.device_set) == 8
    assert float(placed["lr"]) == np.float32(0.1)
    assert (jax.random.key_data(placed["key"]) == jax.random.key_data(key)).all()
    with pytest.raises(ValueError, match="The batch has no rows: every leaf is 0-d"):
        shard_batch({"lr": np.float32(0.1)}, mesh_2x4)


def test_unknown_data_axis_is_an_error(mesh_2x4):
    with pytest.raises(ValueError, match=r"must be distinct axes of the mesh; its axes are"):
        batch_sharding(mesh_2x4, "batch")
    with pytest.raises(ValueError, match="must name one or more mesh axes"):
        batch_sharding(mesh_2x4, ())
    rows = np.zeros((8, 4), np.float32)  # was a bare KeyError: 'batch'
    with pytest.raises(ValueError, match=r"batch_axes \('batch',\) names \['batch'\], which "
                       r"the mesh lacks; its axes are \('data', 'model'\)"):  # fmt: skip
        shard_batch(rows, mesh_2x4, "batch")
    with pytest.raises(ValueError, match=r"seq_axes \('context',\) names"):
        shard_batch(rows, mesh_2x4, "data", seq_axes=("context",))


def test_replicate(mesh_2x4):
    placed = replicate({"a": np.arange(3), "b": np.float32(2.0)}, mesh_2x4)
    assert placed["a"].sharding.is_fully_replicated
    assert len(placed["a"].sharding.device_set) == 8
    assert float(placed["b"]) == 2.0


def test_constrain_is_the_identity_outside_a_context():
    x = jnp.ones((4, 8))
    assert constrain(x, "data", "embed") is x
    assert active_rules() is None


def test_constrain_resolves_through_the_active_rules(mesh_2x4):
    rules = fsdp_rules()

    @jax.jit
    def f(x):
        return constrain(x * 2, "data", "mlp")

    with use_rules(mesh_2x4, rules) as active:
        assert active is rules and active_rules() == (mesh_2x4, rules)
        y = f(jnp.ones((4, 8)))
    assert active_rules() is None
    assert y.sharding.is_equivalent_to(NamedSharding(mesh_2x4, P("data", "model")), 2)


def test_use_rules_nests_and_validates(mesh_2x4):
    with use_rules(mesh_2x4, fsdp_rules()), use_rules(mesh_2x4, MeshRules(data="model")):
        assert active_rules()[1] == MeshRules(data="model")
    with (
        pytest.raises(ValueError, match="names mesh axis 'tensor'"),
        use_rules(mesh_2x4, MeshRules(mlp="tensor")),
    ):
        pass


def test_constrain_checks_rank_and_names(mesh_2x4):
    with pytest.raises(ValueError, match=r"got 1 logical names \('data',\) for an array of shape"):
        constrain(jnp.ones((2, 2)), "data")
    with use_rules(mesh_2x4, fsdp_rules()), pytest.raises(ValueError, match="'vocab'"):
        constrain(jnp.ones((2, 2)), "data", "vocab")


def test_constrain_on_an_explicit_mesh_reshards():
    from jax.sharding import AxisType

    mesh = DeviceMeshManager.create_device_mesh(
        {"data": 2, "model": 4}, axis_types=(AxisType.Explicit,) * 2
    )
    with jax.set_mesh(mesh), use_rules(mesh, fsdp_rules()):
        y = jax.jit(lambda x: constrain(x, "data", "embed"))(jnp.ones((4, 8)))
    assert y.sharding.spec == P("data", "model")


def test_rules_are_isolated_between_threads_and_asyncio_tasks(mesh_2x4):
    import asyncio
    import threading

    seen = {}

    def worker(name, rules):
        with use_rules(mesh_2x4, rules):
            barrier.wait()  # both threads inside their contexts at once
            seen[name] = active_rules()[1]
            barrier.wait()

    barrier = threading.Barrier(2)
    a, b = MeshRules(data="data"), MeshRules(data="model")
    threads = [threading.Thread(target=worker, args=(n, r)) for n, r in (("a", a), ("b", b))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert seen == {"a": a, "b": b} and active_rules() is None

    async def task(name, rules, started, other_started):
        with use_rules(mesh_2x4, rules):
            started.set()
            await other_started.wait()
            seen[name] = active_rules()[1]

    async def both():
        first, second = asyncio.Event(), asyncio.Event()
        await asyncio.gather(task("x", a, first, second), task("y", b, second, first))

    asyncio.run(both())
    assert seen["x"] == a and seen["y"] == b and active_rules() is None


def test_leaving_rule_contexts_out_of_order_restores_the_right_rules(mesh_2x4):
    outer, inner = MeshRules(data="data"), MeshRules(data="model")
    first, second = use_rules(mesh_2x4, outer), use_rules(mesh_2x4, inner)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the outer one leaves first
    assert active_rules() == (mesh_2x4, inner)
    second.__exit__(None, None, None)
    assert active_rules() is None  # nothing leaks after every context exited


def test_a_jitted_function_is_traced_again_under_other_rules(mesh_2x4):
    traces = []

    @jax.jit
    def f(x):
        traces.append(1)
        return constrain(x * 2, "data", None)

    x = jnp.ones((8, 4))
    with use_rules(mesh_2x4, MeshRules(data="data")):
        assert f(x).sharding.spec[0] == "data"
    with use_rules(mesh_2x4, MeshRules(data="model")):
        assert f(x).sharding.spec[0] == "model"  # not the first trace's layout
    with use_rules(mesh_2x4, MeshRules(data="data")):
        f(x)
    assert len(traces) == 2  # the first rules' trace is reused for the same rules
