"""Run a script as N local processes of one jax program: ``python -m substrax.launch``.

    python -m substrax.launch --num-processes 2 --devices-per-process 4 script.py [args...]

Each process gets the coordinator address, its process id, its simulated CPU device count and
gloo CPU collectives through the environment (read by :func:`substrax.distributed.initialize`).
Output is streamed with a ``[i]`` prefix. The launcher exits with the first non-zero status and
stops the other processes (SIGTERM, then SIGKILL) when one fails; it never waits forever.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from substrax.distributed import ENV_COORDINATOR, ENV_CPU_DEVICES, ENV_NUM_PROCESSES, ENV_PROCESS_ID

__all__ = ["launch", "main"]


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now.

    Returns:
      The port number.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stream(process: subprocess.Popen, index: int) -> None:
    for line in iter(process.stdout.readline, b""):
        sys.stdout.write(f"[{index}] {line.decode(errors='replace')}")
        sys.stdout.flush()


def _stop(processes: list[subprocess.Popen], grace: float) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def launch(
    command: list[str],
    num_processes: int,
    devices_per_process: int | None = None,
    *,
    timeout: float | None = None,
    grace: float = 10.0,
) -> int:
    """Runs ``command`` as ``num_processes`` processes of one jax program on this machine.

    Args:
      command: The command each process runs, such as ``[sys.executable, "train.py"]``.
      num_processes: How many processes.
      devices_per_process: Simulated CPU devices per process (None: jax's default).
      timeout: Seconds after which every process is stopped and the run fails (None: none).
      grace: Seconds between SIGTERM and SIGKILL when stopping processes.

    Returns:
      0 if every process succeeded, else the first non-zero exit status (124 on timeout).

    Raises:
      ValueError: If ``num_processes`` or ``devices_per_process`` is not positive.
    """
    if num_processes < 1 or (devices_per_process is not None and devices_per_process < 1):
        raise ValueError(
            f"num_processes and devices_per_process must be positive, got {num_processes} "
            f"and {devices_per_process}."
        )
    base = {**os.environ, ENV_COORDINATOR: f"127.0.0.1:{_free_port()}"}
    base[ENV_NUM_PROCESSES] = str(num_processes)
    if devices_per_process is not None:
        base[ENV_CPU_DEVICES] = str(devices_per_process)
    base["PYTHONUNBUFFERED"] = "1"
    processes = [
        subprocess.Popen(
            command,
            env={**base, ENV_PROCESS_ID: str(index)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for index in range(num_processes)
    ]
    streams = [threading.Thread(target=_stream, args=(p, i)) for i, p in enumerate(processes)]
    for thread in streams:
        thread.start()
    status = _watch(processes, timeout, grace)
    for thread in streams:
        thread.join()
    return status


def _watch(processes: list[subprocess.Popen], timeout: float | None, grace: float) -> int:
    start = time.monotonic()
    while True:
        codes = [p.poll() for p in processes]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            _stop(processes, grace)
            return failed[0]
        if all(code == 0 for code in codes):
            return 0
        if timeout is not None and time.monotonic() - start > timeout:
            _stop(processes, grace)
            return 124
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    """The command line: ``python -m substrax.launch [options] script.py [args...]``.

    Args:
      argv: The arguments (``sys.argv[1:]`` when None).

    Returns:
      The exit status.
    """
    parser = argparse.ArgumentParser(prog="python -m substrax.launch", description=__doc__)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None, help="seconds for the whole run")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        return launch(
            [sys.executable, args.script, *args.args],
            args.num_processes,
            args.devices_per_process,
            timeout=args.timeout,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
