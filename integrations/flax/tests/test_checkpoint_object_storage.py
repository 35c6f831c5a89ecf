"""Checkpoints on object storage: a ``gs://`` directory against a GCS server on 127.0.0.1.

The server is ``gcs_server.py`` (``gcp-storage-emulator``, in memory, with the generation
headers and preconditions of real GCS), started here; TensorStore (Orbax's array writer)
reaches it through ``TENSORSTORE_GCS_HTTP_URL`` and gcsfs (Orbax's and substrax's file
operations, through ``etils.epath``) through ``STORAGE_EMULATOR_HOST``.
"""

import os
import pathlib
import re
import socket
import subprocess
import sys
import time
import uuid

import numpy as np
import optax
import pytest
from flax import nnx
from killed_save import kill_during_second_save, restore_target

import substrax_flax as sf
from substrax.mesh import DeviceMeshManager, MeshRules

RULES = MeshRules(embed="data")
BUCKET = "substrax-tests"


@pytest.fixture(scope="module")
def bucket():
    """A GCS-compatible server on a free local port, and the environment that points at it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, pathlib.Path(__file__).with_name("gcs_server.py"), str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    environment = {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # no gRPC lookups of the bucket's kind
    }
    before = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "no GCS server"
                time.sleep(0.2)
        import gcsfs

        gcsfs.GCSFileSystem(token="anon").mkdir(BUCKET)
        yield f"gs://{BUCKET}"
    finally:
        server.kill()
        server.wait(30)
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class Tiny(nnx.Module):
    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.normal(), ("embed", None))
        self.w = nnx.Param(init(rngs.params(), (8, 4)))


def _create(seed=0):
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    model = sf.create_sharded_model(lambda: Tiny(nnx.Rngs(seed)), mesh, RULES)
    return model, sf.create_sharded_optimizer(model, optax.adam(1e-2))


def _fresh(bucket):
    return f"{bucket}/{uuid.uuid4().hex[:8]}"


def test_a_bucket_saves_rotates_and_resumes_as_a_local_directory_does(bucket):
    directory = _fresh(bucket)
    model, optimizer = _create()
    weights = {}
    with sf.Checkpointer(directory, keep=2) as checkpointer:
        assert str(checkpointer.directory) == directory
        for step in (1, 2, 3):
            model.w[...] = model.w[...] + 1.0
            checkpointer.save(model, optimizer, step, {"step": step})
            weights[step] = np.asarray(model.w[...])
        assert checkpointer.all_steps() == [2, 3]  # rotated on the bucket
    resumed, resumed_optimizer = _create(seed=1)
    with sf.Checkpointer(directory, keep=2) as checkpointer:
        assert checkpointer.restore(resumed, resumed_optimizer) == {"step": 3}
        np.testing.assert_array_equal(np.asarray(resumed.w[...]), weights[3])
        # damage on the bucket is found from the store's checksums: the step is set aside
        import fsspec

        fs, root = fsspec.core.url_to_fs(f"{directory}/3")
        data = [key for key in fs.find(root) if "/d/" in key]
        fs.pipe_file(data[0], fs.cat_file(data[0])[:-1] + b"\x00")
        with pytest.warns(sf.CheckpointWarning, match=r"Skipped checkpoint step 3 in gs://.*"
                          r"fails its CRC-32 check \(corrupted\)"):  # fmt: skip
            assert checkpointer.restore(resumed, resumed_optimizer) == {"step": 2}
        np.testing.assert_array_equal(np.asarray(resumed.w[...]), weights[2])
        assert checkpointer.all_steps() == [2]


def test_a_second_writer_on_a_bucket_is_refused_while_the_first_renews(bucket):
    directory = _fresh(bucket)
    first = sf.Checkpointer(directory, lease=1.5)
    started = time.monotonic()
    held = rf"in use by another writer \(pid {os.getpid()} on .*, renewing its lock\)"
    with pytest.raises(sf.DirectoryLocked, match=rf"Checkpoint directory {directory} is {held}"):
        sf.Checkpointer(directory, lease=1.5)
    assert time.monotonic() - started < 1.5  # seen renewing within a third of the lease or so
    first.close()
    sf.Checkpointer(directory, lease=1.5).close()  # released: the next writer opens at once


def test_the_lock_is_created_only_if_absent(bucket, monkeypatch):
    """Two writers that both found no lock: the store's precondition lets one create it."""
    from substrax_flax._checkpoint_files import ObjectLock

    directory = _fresh(bucket)
    with sf.Checkpointer(directory):
        monkeypatch.setattr(ObjectLock, "_wait_for_lapse", lambda self: None)  # saw no lock
        with pytest.raises(sf.DirectoryLocked, match=rf"Checkpoint directory {directory} is in "
                           rf"use by another writer \(pid {os.getpid()} on "):  # fmt: skip
            sf.Checkpointer(directory)


def test_a_url_orbax_cannot_write_is_refused_with_the_alternatives():
    refused = r"Orbax 0.12.8 writes arrays to gs:// and to local or mounted paths"
    with pytest.raises(ValueError, match=rf"'s3://bucket/run': {refused}.*mount the bucket"):
        sf.Checkpointer("s3://bucket/run")
    with pytest.raises(ValueError, match=r"lease must be a positive number of seconds, got 0"):
        sf.Checkpointer("gs://bucket/run", lease=0)


def test_a_kill_during_an_async_save_to_a_bucket_loses_only_that_step(bucket, tmp_path):
    """The killed writer's lock lapses and is taken over; its unfinished step is removed."""
    directory, first = _fresh(bucket), tmp_path / "first.npy"

    def in_flight(process):  # copied to host memory; writing in the background
        assert process.stdout.readline().strip() == "saved 2"

    pid = kill_during_second_save(directory, first, "1024", "2", in_flight=in_flight)
    with pytest.warns(sf.CheckpointWarning) as warned:
        checkpointer = sf.Checkpointer(directory, lease=2)
    messages = [str(w.message) for w in warned]
    assert re.fullmatch(
        rf"Took over the writer lock of {directory} from pid {pid} on .*: it was not "
        r"renewed for \d+ s \(lease 2 s\), so that writer is gone\.",
        messages[0],
    ), messages
    # what the killed save wrote (uncommitted step 2), if it wrote anything yet, is removed
    assert messages[1:] in ([], [f"Removed 2 in {directory}: a save that did not finish."])
    assert checkpointer.all_steps() == [1]

    model, optimizer = restore_target(rows=1024)
    assert checkpointer.restore(model, optimizer) == {"step": 1}
    np.testing.assert_array_equal(np.asarray(model.w[...][:4]), np.load(first))
    model.w[...] = model.w[...] + 1.0
    checkpointer.save(model, optimizer, 2, {"step": 2})  # the lost step is saved again
    assert checkpointer.all_steps() == [1, 2]
    checkpointer.close()
