"""How a process started by :mod:`substrax.launch` reports to its launcher.

The launcher gives each process a status directory (``SUBSTRAX_LAUNCH_DIR``). Once the process
has called :func:`substrax.distributed.initialize`, :func:`guard` makes it:

- touch ``<id>.heartbeat`` from a daemon thread every ``interval`` seconds, so the launcher can
  tell a frozen process (stopped, or deadlocked with the interpreter lock held) from a busy one;
- write ``<id>.exit`` when it starts to exit (``sys.exit``, the end of the script), so the
  launcher can bound how long the others may run after it;
- on an uncaught exception, print the traceback, write ``<id>.exit`` and leave at once with
  status 1 (130 for ``KeyboardInterrupt``) instead of waiting at jax's exit barrier for peers
  that are blocked in a collective with it;
- leave (status 1) when its parent is gone, should the parent-death signal not reach it;
- rewrite ``<id>.progress`` each time it enters a program with collectives (substrax's steps
  call :func:`progress`), and write its Python stacks to ``<id>.stack`` on ``SIGUSR1``
  (``faulthandler``), so the launcher can report a run that stopped making progress.

The exception hook is installed in every multi-process run, launched or not: a process that
raised can never complete a collective again, so waiting at the barrier only hides its status.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import pathlib
import signal
import sys
import threading
import time

__all__ = [
    "ENV_COORDINATOR",
    "ENV_CPU_DEVICES",
    "ENV_HEARTBEAT_TIMEOUT",
    "ENV_LAUNCH_DIR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "exit_path",
    "guard",
    "heartbeat_path",
    "progress",
    "progress_path",
    "stack_path",
]

# The launcher's variables, read by substrax.distributed.initialize (defined here, without jax,
# so that the launcher itself starts without importing jax).
ENV_COORDINATOR = "SUBSTRAX_COORDINATOR"
"""Coordinator address (``host:port``) set by :mod:`substrax.launch`."""
ENV_NUM_PROCESSES = "SUBSTRAX_NUM_PROCESSES"
"""Number of processes set by :mod:`substrax.launch`."""
ENV_PROCESS_ID = "SUBSTRAX_PROCESS_ID"
"""This process's id set by :mod:`substrax.launch`."""
ENV_CPU_DEVICES = "SUBSTRAX_CPU_DEVICES"
"""Simulated CPU devices per process (set by :mod:`substrax.launch`, or by hand)."""
ENV_LAUNCH_DIR = "SUBSTRAX_LAUNCH_DIR"
"""The launcher's status directory for its processes."""
ENV_HEARTBEAT_TIMEOUT = "SUBSTRAX_HEARTBEAT_TIMEOUT"
"""The launcher's ``--heartbeat-timeout``, so jax's own heartbeat waits longer than it."""

_guarded = False
_progress: int | None = None  # the open progress file (under the launcher)
_stacks = None  # the open stack file faulthandler writes to (kept open for it)


def heartbeat_path(directory: str | os.PathLike, process_id: int) -> pathlib.Path:
    """The file a process touches while it is alive."""
    return pathlib.Path(directory) / f"{process_id}.heartbeat"


def progress_path(directory: str | os.PathLike, process_id: int) -> pathlib.Path:
    """The file a process rewrites each time it enters a program with collectives."""
    return pathlib.Path(directory) / f"{process_id}.progress"


def stack_path(directory: str | os.PathLike, process_id: int) -> pathlib.Path:
    """Where a process writes its Python stacks when the launcher sends it ``SIGUSR1``."""
    return pathlib.Path(directory) / f"{process_id}.stack"


#: The kinds of progress mark: a step or save the launcher bounds by its stall time, and work
#: of no known length (compiling, loading weights, restoring) that it does not bound.
PROGRESS_KINDS = ("step", "busy")


def progress(what: str, *, busy: bool = False) -> None:
    """Records, cheaply, what this process is entering (``"train step call 12"``).

    Under the launcher: one small file rewritten in place (the launcher reads how far each
    process got when the run stops making progress). Elsewhere: nothing.

    Args:
      what: The program and step, one line.
      busy: Work of no known length (compiling, loading weights, restoring a checkpoint):
        the launcher does not count the run as stalled while a process is in it. The next
        mark ends it.
    """
    if _progress is not None:
        record = f"{time.time():.3f} {PROGRESS_KINDS[busy]} {what}"
        with contextlib.suppress(OSError):
            os.pwrite(_progress, record.ljust(200).encode()[:200], 0)


def exit_path(directory: str | os.PathLike, process_id: int) -> pathlib.Path:
    """The file a process writes when it starts to exit, holding how it exits."""
    return pathlib.Path(directory) / f"{process_id}.exit"


def guard(process_id: int, *, interval: float = 1.0) -> None:
    """Installs the exception hook and, under the launcher, the heartbeat and exit report.

    Idempotent: a second call does nothing.

    Args:
      process_id: This process's id in the run.
      interval: Seconds between heartbeats.
    """
    global _guarded
    if _guarded:
        return
    _guarded = True
    directory = os.environ.get(ENV_LAUNCH_DIR)
    report = (lambda text: _write(exit_path(directory, process_id), text)) if directory else None
    sys.excepthook = _exit_on_exception(sys.excepthook, report)
    if directory is None:
        return
    atexit.register(report, "exit")
    global _progress, _stacks
    with contextlib.suppress(OSError):
        _progress = os.open(progress_path(directory, process_id), os.O_RDWR | os.O_CREAT, 0o644)
        _stacks = stack_path(directory, process_id).open("w")
        faulthandler.register(signal.SIGUSR1, file=_stacks, all_threads=True)
    beat = heartbeat_path(directory, process_id)
    with contextlib.suppress(OSError):
        beat.touch()  # now, not when the thread first runs: a process may freeze before that
    thread = threading.Thread(
        target=_beat, args=(beat, os.getppid(), interval), name="substrax-heartbeat", daemon=True
    )
    thread.start()


def _write(path: pathlib.Path, text: str) -> None:
    with contextlib.suppress(OSError):  # the launcher removed its directory: nobody listens
        path.write_text(text)


def _exit_on_exception(previous, report):
    def hook(kind, value, tb):
        previous(kind, value, tb)
        if report is not None:
            lines = str(value).strip().splitlines()
            report(f"raised {kind.__name__}" + (f": {lines[0]}" if lines else ""))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if issubclass(kind, KeyboardInterrupt) else 1)

    return hook


def _beat(path: pathlib.Path, parent: int, interval: float) -> None:
    while True:
        if os.getppid() != parent:
            print("substrax: the launcher is gone; exiting.", file=sys.stderr, flush=True)
            os._exit(1)
        with contextlib.suppress(OSError):
            path.touch()
        time.sleep(interval)
