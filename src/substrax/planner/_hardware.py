"""Named accelerators for the planner: memory, peak FLOP/s and link bandwidths per device.

Figures are the vendors' published numbers; bandwidths are per device and per direction
(half the bidirectional figure a datasheet quotes):

- H100 SXM (NVIDIA H100 Tensor Core GPU datasheet): 80 GB HBM3; 989 TFLOP/s dense BF16
  (1,979 with sparsity); NVLink 900 GB/s bidirectional -> 450 GB/s; 8 GPUs per NVLink domain;
  across hosts one 400 Gb/s NDR InfiniBand port per GPU -> 50 GB/s; to the host's memory
  PCIe Gen5 x16, 128 GB/s bidirectional -> 64 GB/s, and the host's memory (NVIDIA DGX H100
  datasheet: 2 TB of system memory for 8 GPUs) -> 250 GB per GPU (remat ``"offload"``).
- H200 SXM (NVIDIA H200 Tensor Core GPU datasheet): 141 GB HBM3e; the H100's 989 TFLOP/s
  dense BF16 and 900 GB/s NVLink; 400 Gb/s per GPU across hosts.
- TPU v5p (Google Cloud TPU v5p documentation): 95 GB HBM2e; 459 TFLOP/s BF16; inter-chip
  interconnect 4,800 Gb/s per chip -> 300 GB/s per direction, between hosts of a pod too; 4
  chips per host.
- TPU v4 (Cloud TPU v4 documentation): 32 GiB HBM2; 275 TFLOP/s BF16; inter-chip interconnect
  2,400 Gb/s per chip -> 150 GB/s per direction; 4 chips per host.
- TPU v5e (Cloud TPU v5e documentation): 16 GB HBM2; 197 TFLOP/s BF16; inter-chip interconnect
  1,600 Gb/s per chip -> 100 GB/s per direction; 4 chips per host in multi-host slices.
- TPU v6e (Cloud TPU v6e documentation): 32 GB HBM; 918 TFLOP/s BF16; inter-chip interconnect
  3,200 Gb/s per chip -> 200 GB/s per direction; 4 chips per host in multi-host slices.

Each profile runs attention as a flash kernel and carries the calibrated efficiencies
(:data:`substrax.planner._efficiency.CALIBRATED`, fitted on H100 runs). The TPU profiles leave
the host link's bandwidth unknown (no figure in those documents), so :func:`~substrax.planner.plan`
does not search remat ``"offload"`` on them; ``--host-bandwidth`` sets one.
"""

from __future__ import annotations

import dataclasses

from substrax.planner._efficiency import CALIBRATED
from substrax.planner._estimate import Hardware

__all__ = ["HARDWARE", "profile_of"]

_H100 = Hardware(
    memory_bytes=80 * 10**9,
    devices_per_host=8,
    flops=989e12,
    intra_host_bandwidth=450e9,
    inter_host_bandwidth=50e9,
    efficiency=CALIBRATED,
    flash_attention=True,
    host_bandwidth=64e9,
    host_memory_bytes=250 * 10**9,
)

HARDWARE: dict[str, Hardware] = {
    "h100": _H100,
    "h200": dataclasses.replace(_H100, memory_bytes=141 * 10**9),  # an H100 with more HBM
    "tpu-v5p": Hardware(
        memory_bytes=95 * 10**9,
        devices_per_host=4,
        flops=459e12,
        intra_host_bandwidth=300e9,
        inter_host_bandwidth=300e9,
        efficiency=CALIBRATED,
        flash_attention=True,
    ),
    "tpu-v4": Hardware(
        memory_bytes=32 * 2**30,
        devices_per_host=4,
        flops=275e12,
        intra_host_bandwidth=150e9,
        inter_host_bandwidth=150e9,
        efficiency=CALIBRATED,
        flash_attention=True,
    ),
    "tpu-v5e": Hardware(
        memory_bytes=16 * 10**9,
        devices_per_host=4,
        flops=197e12,
        intra_host_bandwidth=100e9,
        inter_host_bandwidth=100e9,
        efficiency=CALIBRATED,
        flash_attention=True,
    ),
    "tpu-v6e": Hardware(
        memory_bytes=32 * 10**9,
        devices_per_host=4,
        flops=918e12,
        intra_host_bandwidth=200e9,
        inter_host_bandwidth=200e9,
        efficiency=CALIBRATED,
        flash_attention=True,
    ),
}
"""Named hardware profiles: ``--hardware h100`` on the command line."""


#: ``device_kind`` fragments and their profiles, first match wins: jax names a TPU v5p
#: ``"TPU v5"`` and a v5e ``"TPU v5 lite"`` (197 TFLOP/s, not 459).
_KINDS = (
    ("h200", "h200"), ("h100", "h100"), ("tpu v5 lite", "tpu-v5e"), ("tpu v5e", "tpu-v5e"),
    ("tpu v5p", "tpu-v5p"), ("tpu v5", "tpu-v5p"), ("tpu v6 lite", "tpu-v6e"),
    ("tpu v6e", "tpu-v6e"), ("tpu v4", "tpu-v4"),
)  # fmt: skip


def profile_of(device_kind: str) -> str | None:
    """The :data:`HARDWARE` profile of a device, from its ``device_kind``.

    Args:
      device_kind: ``jax.devices()[0].device_kind``, such as ``"NVIDIA H100 80GB HBM3"``.

    Returns:
      The profile's name (``"h100"``), or None for a device without one (CPUs included).
    """
    kind = device_kind.lower()
    return next((name for key, name in _KINDS if key in kind), None)
