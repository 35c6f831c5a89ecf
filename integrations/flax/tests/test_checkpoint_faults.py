"""Checkpoints under damage: fallback to the newest intact step, dtypes, NaN retention, paths."""

import errno
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import substrax_flax as sf
from substrax.mesh import DeviceMeshManager, MeshRules

RULES = MeshRules(embed="data")


class Tiny(nnx.Module):
    def __init__(self, rngs, dtype=jnp.float32):
        init = nnx.with_partitioning(nnx.initializers.normal(), ("embed", None))
        self.w = nnx.Param(init(rngs.params(), (8, 4), dtype))


def _create(seed=0, dtype=jnp.float32):
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    model = sf.create_sharded_model(lambda: Tiny(nnx.Rngs(seed), dtype), mesh, RULES)
    return model, sf.create_sharded_optimizer(model, optax.adam(1e-2))


def _saved_steps(directory, steps, keep=3):
    model, optimizer = _create()
    checkpointer = sf.Checkpointer(directory, keep=keep)
    weights = {}
    for step in steps:
        model.w[...] = model.w[...] + 1.0
        checkpointer.save(model, optimizer, step, {"step": step})
        weights[step] = np.asarray(model.w[...])
    return weights


def _data_files(step_dir):
    return [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]


def _truncate(step_dir):
    for path in _data_files(step_dir):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(step_dir):
    for path in _data_files(step_dir):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


DAMAGE = {
    "truncated data": (_truncate, r"state/d/\w+ has \d+ of its \d+ bytes \(truncated\)"),
    "flipped bits": (_flip, r"state/d/\w+ fails its CRC-32 check \(corrupted\)"),
    "missing metadata": (lambda d: (d / "state" / "_METADATA").unlink(), "lacks state/_METADATA"),
    "missing manifest": (
        lambda d: (d / "state" / "manifest.ocdbt").unlink(),
        "lacks state/manifest.ocdbt",
    ),
    "empty step directory": (
        lambda d: (shutil.rmtree(d), d.mkdir()),
        "its directory is empty",
    ),
    "missing run metadata": (lambda d: (d / "metadata" / "metadata").unlink(), "lacks metadata/"),
    "empty run metadata": (
        lambda d: (d / "metadata" / "metadata").write_text(""),
        r"metadata/metadata has 0 of its \d+ bytes \(truncated\)",
    ),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_restore_falls_back_to_the_newest_intact_step(tmp_path, damage):
    weights = _saved_steps(tmp_path, [1, 2])
    harm, reason = DAMAGE[damage]
    harm(tmp_path / "2")
    model, optimizer = _create(seed=5)
    checkpointer = sf.Checkpointer(tmp_path)
    with pytest.warns(sf.CheckpointWarning, match=rf"Skipped checkpoint step 2 .*{reason}"):
        assert checkpointer.restore(model, optimizer) == {"step": 1}
    np.testing.assert_array_equal(np.asarray(model.w[...]), weights[1])
    assert (tmp_path / "2.corrupt").is_dir() and checkpointer.all_steps() == [1]
    checkpointer.save(model, optimizer, 2, {"step": 2})  # the run can go on from there
    assert checkpointer.all_steps() == [1, 2]


@pytest.mark.parametrize("damage", DAMAGE)
def test_metadata_is_the_newest_intact_steps_as_restore_would_restore(tmp_path, damage):
    """A run reads its data position before restoring (the example does): a damaged latest
    step must not block that read."""
    _saved_steps(tmp_path, [1, 2])
    harm, reason = DAMAGE[damage]
    harm(tmp_path / "2")
    checkpointer = sf.Checkpointer(tmp_path)
    with pytest.warns(sf.CheckpointWarning, match=rf"Skipped checkpoint step 2 .*{reason}"):
        assert checkpointer.metadata() == {"step": 1}
    assert checkpointer.all_steps() == [1] and (tmp_path / "2.corrupt").is_dir()
    with pytest.raises(ValueError, match=r"Checkpoint step 1 in .* is unusable: .*truncated"):
        _truncate(tmp_path / "1")
        checkpointer.metadata(1)


def test_a_named_damaged_step_is_an_error_and_nothing_intact_says_why(tmp_path):
    _saved_steps(tmp_path, [1])
    _truncate(tmp_path / "1")
    model, optimizer = _create()
    checkpointer = sf.Checkpointer(tmp_path)
    with pytest.raises(ValueError, match=r"Checkpoint step 1 in .* is unusable: .*truncated"):
        checkpointer.restore(model, optimizer, step=1)
    with (
        pytest.warns(sf.CheckpointWarning),
        pytest.raises(
            FileNotFoundError, match=r"No intact checkpoint in .* \(skipped step 1: .*truncated"
        ),
    ):
        checkpointer.restore(model, optimizer)


# Orbax's failed read leaves tensorstore callbacks that hit a closed event loop later
# ("RuntimeError: Event loop is closed", printed by Python, not raised): noise, not a failure.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_damage_without_checksums_is_still_caught_when_read(tmp_path):
    weights = _saved_steps(tmp_path, [1, 2])
    (tmp_path / "2" / "substrax-checksums.json").unlink()  # as an older version saved it
    _truncate(tmp_path / "2")
    model, optimizer = _create(seed=5)
    with pytest.warns(sf.CheckpointWarning, match=r"step 2 .*: unreadable \(ValueError: "):
        assert sf.Checkpointer(tmp_path).restore(model, optimizer) == {"step": 1}
    np.testing.assert_array_equal(np.asarray(model.w[...]), weights[1])


def test_a_leftover_empty_step_directory_does_not_block_resume(tmp_path):
    weights = _saved_steps(tmp_path, [1])
    (tmp_path / "5").mkdir()
    model, optimizer = _create(seed=5)
    with pytest.warns(sf.CheckpointWarning, match="step 5 .* its directory is empty"):
        assert sf.Checkpointer(tmp_path).restore(model, optimizer) == {"step": 1}
    np.testing.assert_array_equal(np.asarray(model.w[...]), weights[1])


def test_an_unwritable_directory_fails_at_construction(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(
        PermissionError, match=r"Checkpoint directory .*a-file/ckpt is not writable"
    ):
        sf.Checkpointer(tmp_path / "a-file" / "ckpt")


def test_another_dtype_is_an_error_unless_cast(tmp_path):
    weights = _saved_steps(tmp_path, [1])
    model, optimizer = _create(dtype=jnp.bfloat16)
    checkpointer = sf.Checkpointer(tmp_path)
    with pytest.raises(ValueError, match=r"model/w: checkpoint float32, target bfloat16"):
        checkpointer.restore(model, optimizer)
    with pytest.warns(sf.CheckpointWarning, match="Casting checkpoint step 1: model/w"):
        checkpointer.restore(model, optimizer, cast=True)
    assert model.w[...].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(model.w[...], np.float32), weights[1], rtol=1e-2)


def test_the_newest_finite_checkpoint_is_never_rotated_out(tmp_path):
    model, optimizer = _create()
    checkpointer = sf.Checkpointer(tmp_path, keep=2)
    checkpointer.save(model, optimizer, 1, {"step": 1})
    good = np.asarray(model.w[...])
    model.w[...] = jnp.full_like(model.w[...], jnp.nan)
    for step in (2, 3, 4):
        checkpointer.save(model, optimizer, step, {"step": step})
    assert checkpointer.all_steps() == [1, 3, 4]
    assert [checkpointer.is_finite(s) for s in (1, 3, 4)] == [True, False, False]
    with pytest.warns(sf.CheckpointWarning, match=r"step 4 .* non-finite .* step 1: restore"):
        checkpointer.restore(model, optimizer)
    checkpointer.restore(model, optimizer, step=1)
    np.testing.assert_array_equal(np.asarray(model.w[...]), good)
    assert jax.tree.leaves(nnx.state(optimizer))  # the optimizer came back too


def test_arguments_in_the_wrong_order_are_named(tmp_path):
    model, optimizer = _create()
    with sf.Checkpointer(tmp_path) as checkpointer:
        with pytest.raises(TypeError, match=r"save\(model, optimizer, step, ...\): model must be "
                           r"an nnx.Module, got int"):  # fmt: skip
            checkpointer.save(1, model, optimizer)
        with pytest.raises(TypeError, match=r"restore\(model, optimizer, step, ...\): step must "
                           r"be an int or None, got str"):  # fmt: skip
            checkpointer.restore(model, optimizer, "latest")


@pytest.mark.parametrize(
    "refusal",
    [
        lambda path: OSError(errno.ENOSPC, "No space left on device", path),
        # how TensorStore reports it: a ValueError, no errno
        lambda path: ValueError(
            f'RESOURCE_EXHAUSTED: Error writing local file "{path}": [OS error 28: No space '
            "left on device]"
        ),
    ],
    ids=["OSError", "TensorStore"],
)
def test_a_full_disk_says_so_and_names_the_newest_complete_step(tmp_path, monkeypatch, refusal):
    """Orbax buries the disk's error in its own; the save names it and the newest whole step."""
    model, optimizer = _create()
    with sf.Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(model, optimizer, 1)

        def full(*args, **kwargs):
            try:
                raise refusal(str(tmp_path / "2.tmp"))
            except (OSError, ValueError) as error:
                raise RuntimeError("orbax: a writer thread failed") from error

        monkeypatch.setattr(checkpointer._manager, "save", full)
        with pytest.raises(OSError) as raised:
            checkpointer.save(model, optimizer, 2)
        assert str(raised.value) == (
            f"[Errno 28] No space left on the device of {tmp_path} while saving step 2; nothing "
            "was lost: the newest complete step is 1 (steps [1]). Free space, then resume."
        )
        assert raised.value.__cause__ is None  # one line, no chained Orbax traceback


def test_orbax_logs_of_a_disk_refusal_are_left_to_the_one_error(tmp_path, caplog):
    """Orbax logs a full disk once per background thread, with a traceback each; the save's
    OSError says it once, so those records are dropped and every other error still shows."""
    import logging

    sf.Checkpointer(tmp_path).close()
    log = logging.getLogger("absl")
    full = ValueError('RESOURCE_EXHAUSTED: Failed writing: "d/1" [OS error 28: No space left '
                      "on device]")  # fmt: skip
    # XLA names a device out of memory RESOURCE_EXHAUSTED too: that is no full disk
    device = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB."
    errors = (full, OSError(errno.ENOSPC, "No space left on device"), ValueError("other"),
              ValueError(device))  # fmt: skip
    for error in errors:
        try:
            raise error
        except (ValueError, OSError):
            log.error("_SignalingThread.run() raised an exception", exc_info=True)
    assert [str(record.exc_info[1]) for record in caplog.records] == ["other", device]


def test_a_refused_saves_late_writes_print_nothing_and_other_unraisable_errors_do(
    tmp_path, monkeypatch
):
    """A full disk closes Orbax's event loop with TensorStore writes in flight; each that
    completes later hits the closed loop from TensorStore's thread, and Python printed it as
    unraisable (0 to 7 tracebacks per refused save on a 3 MB tmpfs). The checkpointer's hook
    drops exactly those; any other unraisable error reaches the hook that was there."""
    import asyncio
    import sys
    import types

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: seen.append(unraisable))
    sf.Checkpointer(tmp_path).close()
    loop = asyncio.new_event_loop()
    loop.close()
    errors = []
    for late in (lambda: loop.call_soon_threadsafe(print), lambda: loop.run_until_complete(None)):
        try:
            late()
        except RuntimeError as error:
            errors.append(error)
    assert [str(error) for error in errors] == ["Event loop is closed"] * 2
    for error in (*errors, ValueError("other")):
        sys.unraisablehook(types.SimpleNamespace(exc_type=type(error), exc_value=error,
                                                 exc_traceback=error.__traceback__,
                                                 err_msg=None, object=None))  # fmt: skip
    # the late completion is dropped; the same words raised elsewhere, and other errors, pass
    assert [unraisable.exc_value for unraisable in seen][:1] == errors[1:]
    assert len(seen) == 2 and str(seen[1].exc_value) == "other"
