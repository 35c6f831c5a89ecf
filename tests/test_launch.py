"""The launcher fails fast, names the process that failed and never leaves processes behind.

Each test bounds its own wait; the failing process is always process 1.
"""

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from substrax import launch

WORKER = os.path.join(os.path.dirname(__file__), "launch_worker.py")
FAST = ["--exit-timeout", "4", "--heartbeat-timeout", "4", "--grace", "2", "--timeout", "60"]


def _launch(mode, *options):
    """The run's result, its seconds as :func:`_watching` counts them, and its wall seconds
    (for a lower bound)."""
    command = [sys.executable, "-m", "substrax.launch", "--num-processes", "2",
               "--devices-per-process", "1", *FAST, *options, WORKER, mode]  # fmt: skip
    wall = time.monotonic()
    with _watching() as clock:
        start = clock.now
        result = subprocess.run(command, capture_output=True, text=True, timeout=90, check=False)
    return result, clock.since(start), time.monotonic() - wall


@contextlib.contextmanager
def _watching():
    """The launcher's clock, read every 50 ms from a thread while the block runs.

    Its ``since`` leaves a stall of the whole machine out, as the launcher's limits do: an
    upper bound on it fails on a slow launcher, not on a paused machine. (Stopping the test
    and its launcher for 25 s while a run ended in 5 s measured 30.1 s of wall time.)
    """
    clock, ended = launch._Clock(), threading.Event()

    def tick():
        while not ended.wait(0.05):
            clock.tick()

    watch = threading.Thread(target=tick)
    watch.start()
    try:
        yield clock
    finally:
        ended.set()
        watch.join()
        clock.tick()


def _report_line(result):
    return next(line for line in result.stderr.splitlines() if line.startswith("substrax.launch"))


def test_a_raising_process_ends_the_run_with_its_own_status_and_message():
    result, seconds, _ = _launch("raise")
    assert result.returncode == 1, result.stderr
    line = _report_line(result)
    assert "process 1 exited with status 1 (raised ValueError: worker 1 failed on purpose)" in line
    assert "  | ValueError: worker 1 failed on purpose" in result.stderr
    assert seconds < 30  # it did not wait at jax's exit barrier


def test_a_process_that_exits_0_mid_run_fails_the_run():
    result, seconds, _ = _launch("exit0")
    assert result.returncode == 1, result.stderr
    assert "process 1 " in _report_line(result)
    assert "while processes [0] kept running (--exit-timeout 4)" in _report_line(result)
    assert seconds < 30


def test_a_killed_process_is_named_with_its_signal():
    result, seconds, _ = _launch("killed")
    assert result.returncode == 128 + signal.SIGKILL
    assert _report_line(result) == "substrax.launch: process 1 was killed by SIGKILL."
    assert seconds < 30


def test_a_frozen_process_is_caught_by_its_heartbeat():
    result, seconds, _ = _launch("hang")
    assert result.returncode == 1
    assert "process 1 sent no heartbeat for" in _report_line(result)
    assert seconds < 30


def test_a_run_paused_as_it_ends_is_not_failed_for_the_pause(tmp_path):
    """The machine stops (the launcher and every process) for 8 s just as process 0 starts to
    exit, 2 s before process 1 does: the launcher does not count the pause against process 1
    (--exit-timeout 6). A fresh-clone CI run failed so, "process 0 started to exit 24 s ago,
    while processes [1] kept running (--exit-timeout 4)", on a run ending as it should."""
    command = [sys.executable, "-m", "substrax.launch", "--num-processes", "2",
               "--devices-per-process", "1", *FAST, "--exit-timeout", "6", WORKER,
               "ends-apart"]  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the launcher's status directory goes here
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("substrax-launch-*/0.exit")):
        assert launcher.poll() is None, launcher.communicate()  # it ends after process 1's 2 s
        assert time.monotonic() < deadline
        time.sleep(0.005)
    os.killpg(launcher.pid, signal.SIGSTOP)
    try:
        running = not list(tmp_path.glob("substrax-launch-*/1.exit"))
        time.sleep(8)
        os.killpg(launcher.pid, signal.SIGCONT)
        _, err = launcher.communicate(timeout=60)
    finally:  # nothing left stopped or running if the test fails
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert running, "process 1 had started to exit before the pause"
    assert launcher.returncode == 0, err[-3000:]


def test_the_launchers_limits_count_only_the_time_it_watched():
    """A gap of more than a second between two readings is left out of every limit; a process
    late by the watched time alone is still late."""
    watched = [120.1 + 0.5 * i for i in range(1, 11)]  # polls every 0.5 s to 125.1
    readings = iter([100.0, 100.05, 120.05, 120.1, *watched])
    clock = launch._Clock(lambda: next(readings))  # 100.0
    clock.tick()  # 100.05
    assert clock.tick() == 120.05  # 20 s unwatched
    assert clock.since(100.0) == pytest.approx(0.05)
    clock.tick()
    assert clock.since(100.0) == pytest.approx(0.1)
    assert clock.since(110.0) == pytest.approx(0.05)  # written during the gap
    assert clock.since(120.1) == 0.0
    for _ in watched:  # 5 s watched: a limit of 4 s is exceeded
        clock.tick()
    assert clock.since(100.0) == pytest.approx(5.1) and clock.since(120.1) == pytest.approx(5.0)


def test_gloo_connection_lines_only_with_verbose(tmp_path):
    chatter = "[Gloo] Rank 0 is connected to 7 peer ranks."
    script = tmp_path / "chatty.py"
    script.write_text(f"print({chatter!r})\nprint('work')\n")
    command = [sys.executable, "-m", "substrax.launch", "--num-processes", "1"]
    quiet = subprocess.run([*command, str(script)], capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0 and quiet.stdout == "[0] work\n"
    loud = subprocess.run([*command, "--verbose", str(script)], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert loud.stdout == f"[0] {chatter}\n[0] work\n"


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL])
def test_stopping_the_launcher_stops_its_processes(signum):
    command = [sys.executable, "-m", "substrax.launch", "--num-processes", "2", "--grace", "2",
               WORKER, "sleep"]  # fmt: skip
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    with subprocess.Popen(command, **pipes) as launcher:
        pids = [int(launcher.stdout.readline().split()[-1]) for _ in range(2)]
        assert all(_alive(pid) for pid in pids)
        launcher.send_signal(signum)
        status = launcher.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids), f"{signum!r} left {pids} running"
        if signum != signal.SIGKILL:
            assert status == 128 + signum
            assert f"the launcher received {signum.name}" in launcher.stderr.read()


def test_jax_waits_longer_than_the_launcher_for_a_silent_process(monkeypatch):
    """Else jax's coordination service aborts the healthy process first, and gets it blamed."""
    from substrax import _worker
    from substrax.distributed import _jax_heartbeat

    monkeypatch.setenv(_worker.ENV_HEARTBEAT_TIMEOUT, "30")
    assert _jax_heartbeat(30) == 70
    monkeypatch.setenv(_worker.ENV_HEARTBEAT_TIMEOUT, "4")
    assert _jax_heartbeat(30) == 30
    monkeypatch.delenv(_worker.ENV_HEARTBEAT_TIMEOUT)
    assert _jax_heartbeat(30) == 30


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_second_interrupt_stops_at_once_without_a_traceback():
    command = [sys.executable, "-m", "substrax.launch", "--num-processes", "2", "--grace", "60",
               WORKER, "stubborn"]  # fmt: skip
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    with subprocess.Popen(command, **pipes) as launcher:
        pids = [int(launcher.stdout.readline().split()[-1]) for _ in range(2)]
        launcher.send_signal(signal.SIGINT)  # workers ignore the SIGTERM: 60 s of grace
        time.sleep(1.0)
        assert launcher.poll() is None and all(_alive(pid) for pid in pids)
        with _watching() as clock:
            start = clock.now
            launcher.send_signal(signal.SIGINT)  # no more grace
            status = launcher.wait(timeout=30)
        assert clock.since(start) < 10 and status == 128 + signal.SIGINT
        stderr = launcher.stderr.read()
        assert "Traceback" not in stderr and "the launcher received SIGINT" in stderr
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in pids)


def test_processes_with_different_device_counts_are_refused_at_initialize():
    result, seconds, _ = _launch("devices-differ", "--timeout", "80")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "devices of each process differs" in result.stderr
    assert "2 cpu device(s)" in result.stderr and "1 cpu device(s)" in result.stderr
    assert "initialized" not in result.stdout and seconds < 30  # not in a collective, later


def test_a_process_that_compiles_longer_than_the_stall_time_is_not_a_stall():
    """Process 0 traces its first step for 8 s; --stall-timeout 3 must not stop the run."""
    result, _, wall = _launch("slow-compile", "--stall-timeout", "3", "--timeout", "80")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("done, loss") == 2 and "hung" not in result.stderr
    assert wall > 8  # it did wait for the compile


def test_a_run_that_stops_making_progress_is_reported_with_the_laggard_and_its_stack():
    """Both processes beat; process 1 sleeps before its 4th step, process 0 waits in it."""
    result, seconds, _ = _launch("stall", "--stall-timeout", "4", "--timeout", "80")
    assert result.returncode == 3, result.stderr[-3000:]  # launch.STALL_STATUS
    report = result.stderr
    assert "no process entered a new step or save for 4 s (--stall-timeout 4): the run is hung" in (
        report
    )
    assert "process 0: manual step, call 4 (entered" in report
    assert "process 1: manual step, call 3 (entered" in report
    assert "<- behind: the others wait for it" in report.split("process 1: ")[1].splitlines()[0]
    lines = pathlib.Path(WORKER).read_text().splitlines()
    sleep = next(n for n, line in enumerate(lines, 1) if "stuck between steps" in line)
    stack = report.split("Python stack of process 1:")[1]
    assert f'launch_worker.py", line {sleep} in <module>' in stack  # where it is stuck
    assert seconds < 3 * 4 + 30  # the stall time, the workers' start and the report
