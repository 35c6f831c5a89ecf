"""Checkpoints: bit-exact round trips across layouts, mismatches, retention, and SIGKILL."""

import os
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax_test_models import Transformer, token_loss, tokens
from killed_save import kill_during_second_save, restore_target

import substrax_flax as sf
from substrax.mesh import DeviceMeshManager, MeshRules

NAMES = dict(vocab=None, kv=None, layers=None)
LAYOUTS = {
    "fsdp 2x4": (
        {"data": 2, "model": 4},
        MeshRules(data=("data", "model"), embed=("data", "model")),
    ),
    "tp 1x8": (
        {"data": 1, "model": 8},
        MeshRules(data="data", mlp="model", extra={"vocab": "model"}),
    ),
    "dp 8x1": ({"data": 8, "model": 1}, MeshRules(data="data")),
    "fsdp+tp 2x4": ({"data": 2, "model": 4}, MeshRules(data="data", embed="data", mlp="model")),
}


def _create(layout, seed):
    shape, rules = LAYOUTS[layout]
    rules = rules.extend(**{k: v for k, v in NAMES.items() if k not in dict(rules.extra)})
    mesh = DeviceMeshManager.create_device_mesh(shape)
    model = sf.create_sharded_model(lambda: Transformer(nnx.Rngs(seed)), mesh, rules)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), mesh, rules)
    return mesh, rules, model, optimizer


def _values(model, optimizer):
    return [np.asarray(a) for a in jax.tree.leaves((nnx.state(model), nnx.state(optimizer)))]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    mesh, rules, model, optimizer = _create("fsdp 2x4", seed=0)
    step = sf.make_train_step(token_loss, mesh, rules)
    for i in range(2):
        step(model, optimizer, tokens(seed=i))
    sf.Checkpointer(directory).save(model, optimizer, 2, {"step": 2, "data_position": 2})
    return directory, _values(model, optimizer)


@pytest.mark.parametrize("layout", ["tp 1x8", "dp 8x1", "fsdp+tp 2x4"])
def test_round_trip_is_bit_exact_onto_another_layout(saved, layout):
    directory, expected = saved
    _, rules, model, optimizer = _create(layout, seed=7)
    metadata = sf.Checkpointer(directory).restore(model, optimizer)
    assert metadata == {"step": 2, "data_position": 2}
    for want, got in zip(expected, _values(model, optimizer), strict=True):
        np.testing.assert_array_equal(got, want)
    planned = sf.get_shardings(model, model_mesh(model), rules)
    arrays = jax.tree.leaves(nnx.state(model))
    for array, sharding in zip(arrays, jax.tree.leaves(planned), strict=True):
        assert array.sharding.is_equivalent_to(sharding, array.ndim)


def model_mesh(model):
    return jax.tree.leaves(nnx.state(model))[0].sharding.mesh


def test_shape_mismatch_names_the_paths(saved):
    directory, _ = saved
    shape, rules = LAYOUTS["dp 8x1"]
    rules = rules.extend(**NAMES)
    mesh = DeviceMeshManager.create_device_mesh(shape)
    model = sf.create_sharded_model(lambda: Transformer(nnx.Rngs(0), layers=3), mesh, rules)
    optimizer = sf.create_sharded_optimizer(model, optax.adamw(1e-2), mesh, rules)
    with pytest.raises(ValueError) as info:
        sf.Checkpointer(directory).restore(model, optimizer)
    assert "does not match the target model" in str(info.value)
    assert "model/blocks/2/wq: checkpoint missing, target (32, 4, 8)" in str(info.value)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    _, _, model, optimizer = _create("dp 8x1", seed=0)
    with pytest.raises(FileNotFoundError, match=r"No checkpoint in .*; steps there: \[\]"):
        sf.Checkpointer(tmp_path / "empty").restore(model, optimizer)


def test_only_the_last_k_are_kept(tmp_path):
    _, _, model, optimizer = _create("dp 8x1", seed=0)
    checkpointer = sf.Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        checkpointer.save(model, optimizer, step, {"step": step})
    assert checkpointer.all_steps() == [2, 3] and checkpointer.latest_step() == 3
    with pytest.raises(ValueError, match="keep must be an integer of at least 1"):
        sf.Checkpointer(tmp_path, keep=0)


def test_sigkill_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    """A kill -9 while an asynchronous save writes in the background loses only that step."""
    directory, first = tmp_path / "ckpt", tmp_path / "first.npy"

    def in_flight(process):
        deadline = time.monotonic() + 120
        while not any("tmp" in p.name and p.name.startswith("2") for p in directory.iterdir()):
            assert process.poll() is None, "the second save finished before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.001)

    kill_during_second_save(directory, first, in_flight=in_flight)
    assert any(".orbax-checkpoint-tmp" in p.name for p in directory.iterdir())
    with pytest.warns(sf.CheckpointWarning, match=r"Removed 2.orbax-checkpoint-tmp\S* in "):
        checkpointer = sf.Checkpointer(directory)
    assert checkpointer.latest_step() == 1
    assert [p.name for p in directory.iterdir() if not p.name.startswith(".")] == ["1"]
    model, optimizer = restore_target()
    assert checkpointer.restore(model, optimizer) == {"step": 1}
    np.testing.assert_array_equal(np.asarray(model.w[...][:4]), np.load(first))


def test_saving_at_an_old_step_is_an_error_unless_overwriting(tmp_path):
    _, _, model, optimizer = _create("dp 8x1", seed=0)
    checkpointer = sf.Checkpointer(tmp_path)
    for step in (1, 2, 3):
        checkpointer.save(model, optimizer, step, {"step": step})
    for step in (3, 2):  # the same step, and one before the latest: never silently skipped
        with pytest.raises(ValueError, match=rf"Cannot save step {step} .* latest checkpoint"):
            checkpointer.save(model, optimizer, step, {"step": step})
    assert checkpointer.all_steps() == [1, 2, 3]
    checkpointer.save(model, optimizer, 2, {"step": 2, "again": True}, overwrite=True)
    assert checkpointer.all_steps() == [1, 2]  # the rolled-back run's future is gone
    assert checkpointer.restore(model, optimizer) == {"step": 2, "again": True}


def test_metadata_json_cannot_hold_is_refused_before_anything_is_written(tmp_path):
    _, _, model, optimizer = _create("dp 8x1", seed=0)
    checkpointer = sf.Checkpointer(tmp_path)
    with pytest.raises(TypeError, match=r"metadata\['path'\] is not JSON-serialisable .* nothing "
                       r"was saved\. .* str\(path\)"):  # fmt: skip
        checkpointer.save(model, optimizer, 1, {"step": 1, "path": tmp_path})
    checkpointer.wait()
    assert checkpointer.all_steps() == [] and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in tmp_path.iterdir() if not p.name.startswith("1")
    )  # no step directory, no orbax temporary
    checkpointer.save(model, optimizer, 1, {"step": 1, "path": str(tmp_path)})
    assert checkpointer.all_steps() == [1]


def test_one_writer_per_directory(tmp_path):
    """A second Checkpointer on a directory in use is refused, naming the holder; close frees it."""
    first = sf.Checkpointer(tmp_path)
    with pytest.raises(
        sf.DirectoryLocked, match=rf"in use by another writer \(pid {os.getpid()} on"
    ):
        sf.Checkpointer(tmp_path)
    first.close()
    with sf.Checkpointer(tmp_path) as again:  # released: the next run may write
        assert again.latest_step() is None
    sf.Checkpointer(tmp_path).close()
