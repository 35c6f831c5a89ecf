"""Starting jax's multi-controller runtime: one process per host, from any launcher.

Call :func:`initialize` before anything touches a device. Under ``python -m substrax.launch``
it reads the launcher's variables (coordinator, process id, CPU devices, gloo collectives); on
a cluster (SLURM, Kubernetes, TPU pods, ...) ``jax.distributed.initialize`` detects the
cluster itself; alone, it sets up nothing but the simulated CPU device count, if given.
"""

from __future__ import annotations

import os

import jax

from substrax import _worker
from substrax._worker import ENV_COORDINATOR as ENV_COORDINATOR
from substrax._worker import ENV_CPU_DEVICES as ENV_CPU_DEVICES
from substrax._worker import ENV_NUM_PROCESSES as ENV_NUM_PROCESSES
from substrax._worker import ENV_PROCESS_ID as ENV_PROCESS_ID
from substrax._worker import progress as progress

__all__ = [
    "ENV_COORDINATOR",
    "ENV_CPU_DEVICES",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "agree",
    "initialize",
    "progress",
]

#: Seconds :func:`agree` waits for every process's value by default.
AGREE_TIMEOUT = 120.0


def initialize(
    cpu_devices: int | None = None,
    *,
    cluster: bool = False,
    heartbeat_timeout_seconds: int = 30,
) -> int:
    """Initialises the multi-process runtime where one is asked for; a no-op otherwise.

    Args:
      cpu_devices: Simulated CPU devices for this process when there is no accelerator;
        ``SUBSTRAX_CPU_DEVICES`` overrides it. None leaves jax's default.
      cluster: Also call ``jax.distributed.initialize()`` with its cluster auto-detection
        when no launcher variables are set (for SLURM, Kubernetes, TPU pods, ...).
      heartbeat_timeout_seconds: How long the coordination service waits for a silent
        process before the others fail, so a dead process stops the run in bounded time.
        Under :mod:`substrax.launch` at least twice the launcher's ``--heartbeat-timeout``
        (plus 10 s), so the launcher names a frozen process before jax aborts the others.

    In a multi-process run, an uncaught exception then ends this process at once with status 1
    (jax would otherwise keep it at its exit barrier, waiting for peers blocked in a collective
    with it, and its status would be lost). Under :mod:`substrax.launch` the process also sends
    heartbeats and says when it starts to exit, so the launcher can stop the run and name it.

    Returns:
      The number of processes.

    Raises:
      RuntimeError: If the launcher variables are incomplete, jax was already started, or
        the processes hold different numbers or kinds of devices (naming both).
    """
    devices = os.environ.get(ENV_CPU_DEVICES) or cpu_devices
    if devices is not None:
        jax.config.update("jax_num_cpu_devices", int(devices))
    launched = [
        os.environ.get(name) for name in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    ]
    if any(launched) and not all(launched):
        raise RuntimeError(
            f"Incomplete launcher environment: {ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and "
            f"{ENV_PROCESS_ID} must all be set, got {launched}."
        )
    if all(launched):
        coordinator, num_processes, process_id = launched
        # jax's coordination service aborts the processes of a silent peer; it waits longer
        # than the launcher, which names the frozen process first (jax would blame another)
        heartbeat_timeout_seconds = _jax_heartbeat(heartbeat_timeout_seconds)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=int(num_processes),
            process_id=int(process_id),
            heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        )
    elif cluster:
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_seconds)
    if all(launched) or cluster:
        _worker.guard(jax.process_index())
        # different device counts would fail in the first collective, far from the cause
        local = jax.local_devices()
        agree("devices of each process", f"{len(local)} {local[0].device_kind} device(s)")
    return jax.process_count()


def _jax_heartbeat(asked: int) -> int:
    """The heartbeat timeout for jax: ``asked``, and at least twice the launcher's plus 10 s."""
    launcher = float(os.environ.get(_worker.ENV_HEARTBEAT_TIMEOUT, 0))
    return max(asked, int(2 * launcher + 10))


def _client():
    """The coordination-service client of jax (None outside a multi-process run)."""
    from jax._src import distributed

    return distributed.global_state.client


def agree(name: str, value: str, *, timeout: float = AGREE_TIMEOUT) -> None:
    """Checks that every process of the run holds the same ``value``, before it computes.

    Each process publishes ``value`` under ``name`` in jax's coordination service (no
    collective: processes that disagree on the program cannot run one) and reads the others';
    a process whose value differs stops every process with the first line that differs. A
    no-op with one process.

    Args:
      name: What is compared, the same on every process (``"train step 1"``).
      value: This process's text of it (a step's plan, mesh and shapes).
      timeout: Seconds to wait for the other processes to publish theirs.

    Raises:
      RuntimeError: If a process's value differs (naming it and the first differing line),
        or a process has not published within ``timeout`` (naming it).
    """
    if jax.process_count() == 1:
        return
    client, me = _client(), jax.process_index()
    key = f"substrax/agree/{name}"
    client.key_value_set(f"{key}/{me}", value)
    for other in range(jax.process_count()):
        if other == me:
            continue
        try:
            theirs = client.blocking_key_value_get(f"{key}/{other}", int(timeout * 1000))
        except Exception as error:  # the service's deadline error
            raise RuntimeError(
                f"Process {other} did not reach {name!r} within {timeout:.0f} s (process {me} "
                f"did): it is slower, stuck or on another code path ({type(error).__name__})."
            ) from None
        if theirs != value:
            raise RuntimeError(
                f"Process {other}'s {name} differs from process {me}'s, so their programs "
                "would not match (a run would hang in a collective): "
                f"{_first_difference(value, theirs, me, other)}. Start every process with the "
                "same arguments."
            )


def _first_difference(mine: str, theirs: str, me: int, other: int) -> str:
    """The first differing line of two texts, both sides named."""
    ours, others = mine.splitlines(), theirs.splitlines()
    for k in range(max(len(ours), len(others))):
        left = ours[k].strip() if k < len(ours) else "(nothing)"
        right = others[k].strip() if k < len(others) else "(nothing)"
        if left != right:
            return f"line {k + 1}: process {me} has {left!r}, process {other} has {right!r}"
    return "their texts differ"
