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

__all__ = [
    "ENV_COORDINATOR",
    "ENV_CPU_DEVICES",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "initialize",
]


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

    In a multi-process run, an uncaught exception then ends this process at once with status 1
    (jax would otherwise keep it at its exit barrier, waiting for peers blocked in a collective
    with it, and its status would be lost). Under :mod:`substrax.launch` the process also sends
    heartbeats and says when it starts to exit, so the launcher can stop the run and name it.

    Returns:
      The number of processes.

    Raises:
      RuntimeError: If the launcher variables are incomplete, or jax was already started.
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
    return jax.process_count()
