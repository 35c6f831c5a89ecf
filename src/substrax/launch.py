"""Run a script as N local processes of one jax program: ``python -m substrax.launch``.

    python -m substrax.launch --num-processes 2 --devices-per-process 4 script.py [args...]

Each process gets the coordinator address, its process id, its simulated CPU device count and
gloo CPU collectives through the environment (read by :func:`substrax.distributed.initialize`).
Output is streamed with a ``[i]`` prefix (gloo's per-rank connection lines only with
``--verbose``).

The run fails fast and names the process that failed:

- a process that exits with a non-zero status or is killed by a signal stops the run at once;
- a process that starts to exit (``sys.exit``, even with status 0, or the end of its script)
  while others keep running for more than ``--exit-timeout`` seconds stops the run;
- a process that has called ``initialize`` and then sends no heartbeat for
  ``--heartbeat-timeout`` seconds (stopped, or frozen with the interpreter lock held) stops it;
- ``--timeout`` bounds the whole run. A process that is alive, beating and simply slow (a
  ``time.sleep``, a long compile) is bounded only by ``--timeout``.

``--exit-timeout``, ``--heartbeat-timeout`` and ``--stall-timeout`` count only the time the
launcher watched: where it did not run for more than a second (the machine stalled, the
launcher was stopped, the wall clock stepped forward), it cannot tell what its processes did,
so that time is not held against them. ``--timeout`` is wall time.

Stopping means SIGTERM, then SIGKILL after ``--grace`` seconds. The launcher never leaves its
processes behind: SIGTERM, SIGINT and SIGHUP stop them the same way, and on Linux each process
gets a parent-death signal, so even a SIGKILL of the launcher ends them.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import dataclasses
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from substrax import _worker
from substrax._worker import ENV_COORDINATOR, ENV_CPU_DEVICES, ENV_NUM_PROCESSES, ENV_PROCESS_ID

__all__ = ["STALL_STATUS", "launch", "main"]

_TAIL_LINES = 10
_STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
#: Seconds between two of the watch's readings of the clock beyond which it did not watch.
_UNWATCHED = 1.0
#: How many such gaps :class:`_Clock` remembers (the limits look back seconds to minutes).
_GAPS_KEPT = 256


class _Clock:
    """Wall time as the launcher watched it: gaps of more than :data:`_UNWATCHED` s left out.

    Each limit the watch applies is a time since a process wrote a file (its exit, its
    heartbeat, its last step). When the launcher itself did not run for a while, every
    process looks late by that much. A fresh-clone CI run failed a healthy 2-process run as
    "process 0 started to exit 24 s ago, while processes [1] kept running (--exit-timeout 4)":
    the launcher, which reads the clock every 50 ms, had not run (or its clock had jumped)
    for about 20 s as the processes were ending. So a limit counts only the time between
    readings that follow each other closely.

    Args:
      read: The wall clock, ``time.time`` (a test passes its own readings).
    """

    def __init__(self, read: Callable[[], float] = time.time) -> None:
        self._read = read
        self.now = read()
        self._gaps: collections.deque[tuple[float, float]] = collections.deque(maxlen=_GAPS_KEPT)

    def tick(self) -> float:
        """Reads the wall clock, setting aside a long gap since the last reading.

        Returns:
          The wall time now.
        """
        now = self._read()
        if now - self.now > _UNWATCHED:
            self._gaps.append((self.now, now))
        self.now = now
        return now

    def since(self, then: float) -> float:
        """Seconds watched from ``then`` (a wall time, such as a file's) to the last reading."""
        unwatched = sum(end - max(start, then) for start, end in self._gaps if end > then)
        return self.now - then - unwatched


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now.

    Returns:
      The port number.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclasses.dataclass
class _Worker:
    """One launched process, the last lines it printed and when it was seen to end."""

    index: int
    process: subprocess.Popen
    tail: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=_TAIL_LINES)
    )
    ended_at: float | None = None


class _Stopped(Exception):
    """The launcher received a stop signal."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Asks Linux to SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)


def _is_gloo_chatter(line: str) -> bool:
    return line.startswith("[Gloo] Rank ")


def _stream(worker: _Worker, verbose: bool) -> None:
    for raw in iter(worker.process.stdout.readline, b""):
        line = raw.decode(errors="replace")
        worker.tail.append(line.rstrip("\n"))
        if verbose or not _is_gloo_chatter(line):
            sys.stdout.write(f"[{worker.index}] {line}")
            sys.stdout.flush()
    worker.process.stdout.close()


def _stop(workers: list[_Worker], grace: float) -> None:
    for worker in workers:
        if worker.process.poll() is None:
            worker.process.send_signal(signal.SIGTERM)
            worker.process.send_signal(signal.SIGCONT)  # a stopped process must run to end
    deadline = time.monotonic() + grace
    for worker in workers:
        try:
            worker.process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            worker.process.kill()
            worker.process.wait()


def launch(
    command: list[str],
    num_processes: int,
    devices_per_process: int | None = None,
    *,
    timeout: float | None = None,
    grace: float = 10.0,
    exit_timeout: float = 30.0,
    heartbeat_timeout: float = 30.0,
    stall_timeout: float | None = None,
    verbose: bool = False,
) -> int:
    """Runs ``command`` as ``num_processes`` processes of one jax program on this machine.

    When the run fails, one line on stderr names the process that failed and how, followed by
    the last lines it printed; the other processes are stopped (SIGTERM, then SIGKILL).

    Args:
      command: The command each process runs, such as ``[sys.executable, "train.py"]``.
      num_processes: How many processes.
      devices_per_process: Simulated CPU devices per process (None: jax's default).
      timeout: Seconds after which every process is stopped and the run fails (None: none).
        Wall time; the three limits below count only the seconds the launcher watched (see
        the module's description).
      grace: Seconds between SIGTERM and SIGKILL when stopping processes.
      exit_timeout: Seconds the other processes may keep running after one started to exit.
      heartbeat_timeout: Seconds without a heartbeat after which a process counts as hung
        (heartbeats start at :func:`substrax.distributed.initialize`).
      stall_timeout: Seconds in which no process enters a new step or checkpoint save
        (:func:`substrax.distributed.progress`) after which the run counts as hung, though
        every process beats (stuck in a collective, sleeping in a step): the launcher then
        prints each process's step, which one is behind and its Python stack, and stops the
        run with status :data:`STALL_STATUS`. None: 5 x the median time between steps, at
        least 60 s, once three steps were seen. Never while a process is in work marked
        busy (compiling a step's program, loading weights, restoring a checkpoint).
      verbose: Also print gloo's per-rank connection lines.

    Returns:
      0 if every process succeeded; else the failed process's status (128 + the signal number
      for a signal), 1 for a process that exited early with status 0 or stopped beating, 124
      on timeout, :data:`STALL_STATUS` for a run that stopped making progress, and 128 + the
      signal number when the launcher itself was stopped.

    Raises:
      ValueError: If ``num_processes`` or ``devices_per_process`` is not positive, or a
        timeout is not positive.
    """
    _check_arguments(num_processes, devices_per_process, timeout, exit_timeout, heartbeat_timeout,
                     stall_timeout)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="substrax-launch-") as status_dir:
        env = _environment(num_processes, devices_per_process, status_dir, heartbeat_timeout)
        previous = _catch_stop_signals()
        workers: list[_Worker] = []
        try:
            workers = _start(command, num_processes, env)
            streams = [threading.Thread(target=_stream, args=(w, verbose)) for w in workers]
            for thread in streams:
                thread.start()
            try:
                status, failure = _watch(
                    workers, status_dir, timeout, exit_timeout, heartbeat_timeout,
                    _Stalls(stall_timeout),
                )  # fmt: skip
            except _Stopped as stopped:
                name = signal.Signals(stopped.signum).name
                status = 128 + stopped.signum
                failure = _failure(None, f"the launcher received {name}")
            _stop_unless_told_again(workers, grace)
            for thread in streams:
                thread.join()
        finally:
            _stop_unless_told_again(workers, grace)
            _restore_signals(previous)
    if failure is not None:
        _report(*failure, others=[w.index for w in workers])
    return status


def _check_arguments(num_processes, devices_per_process, timeout, exit_timeout, heartbeat,
                     stall=None):  # fmt: skip
    if num_processes < 1 or (devices_per_process is not None and devices_per_process < 1):
        raise ValueError(
            f"num_processes and devices_per_process must be positive, got {num_processes} "
            f"and {devices_per_process}."
        )
    for name, value in (("timeout", timeout), ("exit_timeout", exit_timeout),
                        ("heartbeat_timeout", heartbeat), ("stall_timeout", stall)):  # fmt: skip
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value}.")


def _environment(
    num_processes: int, devices_per_process: int | None, status_dir: str, heartbeat: float
) -> dict:
    env = {**os.environ, ENV_COORDINATOR: f"127.0.0.1:{_free_port()}"}
    env[ENV_NUM_PROCESSES] = str(num_processes)
    if devices_per_process is not None:
        env[ENV_CPU_DEVICES] = str(devices_per_process)
    env[_worker.ENV_LAUNCH_DIR] = status_dir
    env[_worker.ENV_HEARTBEAT_TIMEOUT] = str(heartbeat)  # jax's heartbeat then waits longer
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start(command: list[str], num_processes: int, env: dict) -> list[_Worker]:
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    workers = []
    for index in range(num_processes):
        process = subprocess.Popen(
            command,
            env={**env, ENV_PROCESS_ID: str(index)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec,
        )
        workers.append(_Worker(index, process))
    return workers


def _stop_unless_told_again(workers: list[_Worker], grace: float) -> None:
    """Stops the workers within ``grace``, or at once on a second stop signal meanwhile."""
    try:
        _stop(workers, grace)
    except _Stopped:  # asked again while they finish: no more grace
        _stop(workers, 0.0)


def _catch_stop_signals() -> dict:
    received = []

    def handler(signum, frame):
        received.append(signum)
        if len(received) <= 2:  # the first stops the run, the second its grace; then ignored
            raise _Stopped(signum)

    previous = {}
    if threading.current_thread() is not threading.main_thread():
        return previous  # signal handlers can only be set from the main thread
    for name in _STOP_SIGNALS:
        number = getattr(signal, name, None)
        if number is not None:
            previous[number] = signal.signal(number, handler)
    return previous


def _restore_signals(previous: dict) -> None:
    for number, handler in previous.items():
        signal.signal(number, handler)


#: The launcher's status for a run whose processes all beat but none made progress.
STALL_STATUS = 3


class _Stalls:
    """Watches the processes' progress records for a run that stopped moving."""

    def __init__(self, timeout: float | None):
        self.timeout = timeout
        self.seen: dict[int, list[float]] = {}

    def threshold(self) -> float | None:
        """The stall time: as given, or 5 x the median interval between steps (>= 60 s)."""
        if self.timeout is not None:
            return self.timeout
        gaps = sorted(b - a for times in self.seen.values() for a, b in itertools.pairwise(times))
        return max(60.0, 5 * gaps[len(gaps) // 2]) if len(gaps) >= 3 else None

    def check(self, workers, status_dir, clock: _Clock):
        """``(status, failure)`` when nothing moved for the stall time, else None.

        A process in work of no known length (a ``busy`` mark: compiling, loading weights,
        restoring) keeps the run from counting as stalled; the others may wait for it.
        """
        records = {w.index: _read_progress(status_dir, w.index) for w in workers}
        for index, record in records.items():
            times = self.seen.setdefault(index, [])
            if record is not None and not record[2] and (not times or record[0] != times[-1]):
                times.append(record[0])
        known = [r for r in records.values() if r is not None]
        if any(busy for _, _, busy in known):
            return None
        threshold = self.threshold()
        if not known or threshold is None or clock.since(max(t for t, _, _ in known)) <= threshold:
            return None
        return STALL_STATUS, _failure(None, _stall_report(workers, status_dir, clock.now, records,
                                                          threshold, self.timeout))  # fmt: skip


def _read_progress(status_dir: str, index: int) -> tuple[float, str, bool] | None:
    """``(when, what, busy)`` of a process's last progress mark, or None before any."""
    try:
        text = _worker.progress_path(status_dir, index).read_text().strip()
        stamp, kind, what = text.split(" ", 2)
        return float(stamp), what, kind == "busy"
    except (OSError, ValueError):
        return None


def _stall_report(workers, status_dir, now, records, threshold, asked) -> str:
    """Each process's step and age, which one is behind, and its Python stack."""
    for worker in workers:  # faulthandler writes every thread's stack
        if worker.process.poll() is None:
            worker.process.send_signal(signal.SIGUSR1)
    time.sleep(1.0)
    known = {i: r for i, r in records.items() if r is not None}
    behind = min(known, key=lambda i: known[i][0]) if known else None
    setting = f"--stall-timeout {asked:g}" if asked is not None else "5 x the median step"
    lines = [f"no process entered a new step or save for {threshold:.0f} s ({setting}): the run "
             "is hung"]  # fmt: skip
    for index, record in sorted(records.items()):
        where = f"{record[1]} (entered {now - record[0]:.0f} s ago)" if record else "no step yet"
        mark = "  <- behind: the others wait for it" if index == behind else ""
        lines.append(f"  process {index}: {where}{mark}")
    if behind is not None:
        try:
            stack = _worker.stack_path(status_dir, behind).read_text().strip().splitlines()
        except OSError:
            stack = []
        lines.append(f"  Python stack of process {behind}:")
        lines += [f"  | {line}" for line in stack[-40:]] or ["  | (none written)"]
    return "\n".join(lines)


def _watch(workers, status_dir, timeout, exit_timeout, heartbeat_timeout, stalls=None):
    """Polls until every process succeeded or one failed.

    Returns:
      ``(status, failure)``: the launcher's exit status, and None or what :func:`_failure` says.
    """
    clock = _Clock()
    start = clock.now
    while True:
        now = clock.tick()
        for worker in workers:
            if worker.ended_at is None and worker.process.poll() is not None:
                worker.ended_at = now
        if all(w.process.returncode == 0 for w in workers):
            return 0, None
        verdict = (
            _failed(workers, status_dir)
            or _exited_early(workers, status_dir, clock, exit_timeout)
            or _frozen(workers, status_dir, clock, heartbeat_timeout)
            or (stalls.check(workers, status_dir, clock) if stalls is not None else None)
        )
        if verdict is not None:
            return verdict
        if timeout is not None and now - start > timeout:
            return 124, _failure(None, f"the run exceeded --timeout {timeout:g} s")
        time.sleep(0.05)


def _failed(workers, status_dir):
    """The first process to end with a non-zero status or a signal, if any."""
    failed = [w for w in workers if w.process.returncode not in (None, 0)]
    if not failed:
        return None
    culprit = min(failed, key=lambda w: _exit_time(w, status_dir))
    return _status_of(culprit.process.returncode), _failure(culprit, _how(culprit, status_dir))


def _exited_early(workers, status_dir, clock: _Clock, exit_timeout):
    """A process that started to exit longer than ``exit_timeout`` ago while others run."""
    early = _first_to_exit(workers, status_dir)
    if early is None or clock.since(_exit_time(early, status_dir)) <= exit_timeout:
        return None
    running = [w.index for w in workers if w.process.returncode is None and w is not early]
    text = (
        f"{_how(early, status_dir)} (sys.exit or the end of its script) "
        f"{clock.now - _exit_time(early, status_dir):.0f} s ago, while processes {running} kept "
        f"running (--exit-timeout {exit_timeout:g})"
    )
    return 1, _failure(early, text)


def _frozen(workers, status_dir, clock: _Clock, heartbeat_timeout):
    """A running process whose heartbeat is older than ``heartbeat_timeout`` (watched)."""
    for worker in workers:
        silent = _silence(worker, status_dir, clock)
        if worker.process.returncode is None and silent > heartbeat_timeout:
            text = f"sent no heartbeat for {silent:.0f} s: it is stopped or frozen"
            return 1, _failure(worker, f"{text} (--heartbeat-timeout {heartbeat_timeout:g})")
    return None


def _failure(worker: _Worker | None, text: str) -> tuple:
    """What to report: the process, how it failed, and its last lines as they were then."""
    return worker, text, list(worker.tail) if worker is not None else []


def _exit_time(worker: _Worker, status_dir: str) -> float:
    """When the process said it was exiting, else when it was seen to end (else never)."""
    try:
        return os.stat(_worker.exit_path(status_dir, worker.index)).st_mtime
    except OSError:
        return worker.ended_at if worker.ended_at is not None else float("inf")


def _first_to_exit(workers: list[_Worker], status_dir: str) -> _Worker | None:
    exiting = [w for w in workers if _exit_time(w, status_dir) != float("inf")]
    return min(exiting, key=lambda w: _exit_time(w, status_dir)) if exiting else None


def _silence(worker: _Worker, status_dir: str, clock: _Clock) -> float:
    try:
        return clock.since(os.stat(_worker.heartbeat_path(status_dir, worker.index)).st_mtime)
    except OSError:
        return 0.0  # not beating yet: it has not called initialize


def _status_of(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _how(worker: _Worker, status_dir: str) -> str:
    code = worker.process.returncode
    try:
        said = _worker.exit_path(status_dir, worker.index).read_text()
    except OSError:
        said = ""
    if code is None:
        how = "started to exit"
    elif code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"exited with status {code}"
    return f"{how} ({said})" if said.startswith("raised") else how


def _report(worker: _Worker | None, text: str, tail: list[str], others: list[int]) -> None:
    if worker is None:
        first, _, rest = text.partition("\n")
        print(f"substrax.launch: {first}; stopped processes {others}.", file=sys.stderr)
        if rest:
            print(rest, file=sys.stderr)
        return
    print(f"substrax.launch: process {worker.index} {text}.", file=sys.stderr)
    if tail:
        print(f"  last lines of process {worker.index}:", file=sys.stderr)
        for line in tail:
            print(f"  | {line}", file=sys.stderr)
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    """The command line: ``python -m substrax.launch [options] script.py [args...]``.

    Args:
      argv: The arguments (``sys.argv[1:]`` when None).

    Returns:
      The exit status.
    """
    parser = argparse.ArgumentParser(
        prog="python -m substrax.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None, help="seconds for the whole run")
    parser.add_argument("--exit-timeout", type=float, default=30.0,
                        help="seconds the others may run after one started to exit")  # fmt: skip
    parser.add_argument("--heartbeat-timeout", type=float, default=30.0,
                        help="seconds without a heartbeat before a process is hung")  # fmt: skip
    parser.add_argument("--stall-timeout", type=float, default=None,
                        help="seconds in which no process enters a new step before the run is "
                        "hung (default: 5 x the median step, at least 60)")  # fmt: skip
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds between SIGTERM and SIGKILL when stopping")  # fmt: skip
    parser.add_argument("--verbose", action="store_true", help="print gloo's connection lines")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        return launch(
            [sys.executable, args.script, *args.args],
            args.num_processes,
            args.devices_per_process,
            timeout=args.timeout,
            grace=args.grace,
            exit_timeout=args.exit_timeout,
            heartbeat_timeout=args.heartbeat_timeout,
            stall_timeout=args.stall_timeout,
            verbose=args.verbose,
        )
    except (ValueError, OSError) as error:  # bad arguments, or a command that cannot start
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
