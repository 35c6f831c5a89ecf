"""What changes when each device computes its own rows, and what cannot.

Inside the manual data-parallel region (:mod:`substrax_flax._manual`) each device sees its own
rows. ``nnx.BatchNorm`` layers reduce their moments over the batch axes
(:func:`sync_batch_norms`), so they are the whole batch's; batch statistics of the model's own
cannot be made the whole batch's (:func:`batch_stat_obstacle`). Random draws are one device's
(:mod:`substrax_flax._streams`).
"""

from __future__ import annotations

from flax import nnx

from substrax_flax._experts import MixtureOfExperts
from substrax_flax._state import variables

__all__ = ["batch_stat_obstacle", "sync_batch_norms", "synced_stats"]


def batch_stat_obstacle(model: nnx.Module) -> str | None:
    """The first batch statistic outside an ``nnx.BatchNorm`` substrax can sync, or None.

    Such statistics would be computed from each device's rows in a manual region, so they
    would differ from one device's.
    """
    synced = synced_stats(model)
    for path, variable in variables(nnx.state(model)):
        if isinstance(variable, nnx.BatchStat) and path not in synced:
            return (
                f"the model has batch statistics ({path}, an nnx.BatchStat) outside an "
                "nnx.BatchNorm whose axis_name substrax can set, so the step would not match "
                "one device's"
            )
    return None


def synced_stats(model: nnx.Module) -> set[str]:
    """Paths of the batch statistics the manual step reduces over the batch axes.

    Those of every ``nnx.BatchNorm`` without an ``axis_name`` of its own: inside the manual
    region :func:`sync_batch_norms` gives it the batch axes, so its moments are the whole
    batch's (``lax.pmean`` over the devices, each holding as many rows) and its running
    averages are the same on every device, as on one device. Also the router bias of a
    :class:`~substrax_flax.MixtureOfExperts`, updated from whole-batch routing counts.
    """
    synced = set()
    for path, module in nnx.iter_modules(model):
        prefix = "/".join(map(str, path))
        if isinstance(module, nnx.BatchNorm) and module.axis_name is None:
            synced.update(f"{prefix}/{name}" if prefix else name for name in ("mean", "var"))
        if isinstance(module, MixtureOfExperts) and hasattr(module, "router_bias"):
            # its update reads the routing counts, summed over the batch axes by experts()
            synced.add(f"{prefix}/router_bias" if prefix else "router_bias")
    return synced


def sync_batch_norms(model: nnx.Module, batch_axes: tuple[str, ...]) -> None:
    """Gives every ``nnx.BatchNorm`` of ``model`` without an ``axis_name`` the batch axes.

    Call on the model merged inside the manual region (its moments are then reduced over the
    devices); the stored model is not changed.
    """
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm) and module.axis_name is None:
            module.axis_name = batch_axes
