"""The non-finite guard of the train steps: a NaN or inf never reaches the weights silently.

Inside the jitted step, :func:`all_finite` checks the loss and every gradient, and the step
runs its optimizer update inside ``lax.cond`` on that flag
(:func:`substrax_flax._jitted.guarded_update`): a skipped step leaves the model and optimizer
state as they were, and the taken branch still updates the donated buffers in place (measured:
the same temporary memory as an unguarded step). Outside, :class:`Guard` reads the flag
without stalling the pipeline of dispatched steps, and warns or raises naming the step.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any, Literal

import jax
import jax.numpy as jnp

from substrax import warn_user

__all__ = [
    "NONFINITE",
    "Guard",
    "NonFinite",
    "NonFiniteWarning",
    "all_finite",
    "check_policy",
    "guard_decision",
]

NonFinite = Literal["skip", "raise", "apply"]
NONFINITE = ("skip", "raise", "apply")


class NonFiniteWarning(RuntimeWarning):
    """A training step saw a non-finite loss or gradient (and skipped its update)."""


def all_finite(*trees: Any, together: bool = True) -> jax.Array:
    """A scalar: whether every floating-point value in ``trees`` is finite.

    Arrays of one shape and one sharding type are checked together (``isfinite(a) &
    isfinite(b) & ...``, one reduction), so the compiled check is one kernel per distinct
    shape, not one per array: a kernel costs a launch on every device whatever its size (on
    XLA:CPU, ``benchmarks/step_variants.py`` counts them), and fused, each group's producers
    (the update computed for the check) run in that one kernel. Explicit mesh axes keep
    arrays sharded differently apart, as ``&`` on them would be a sharding error.

    With ``together=False`` each array is checked on its own: for a flag nothing waits on
    (the unguarded step's metric), so that no array is kept until the last of its shape is
    computed (XLA:TPU kept the gradients so: ``test_compile_tpu.py``,
    ``test_the_unguarded_steps_finite_flag_is_checked_array_by_array``).
    """
    leaves = [x for x in jax.tree.leaves(trees) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not leaves:
        return jnp.array(True)
    groups: dict[Any, jax.Array] = {}
    for i, x in enumerate(leaves):
        key, finite = (x.shape, jax.typeof(x).sharding) if together else i, jnp.isfinite(x)
        groups[key] = finite if key not in groups else groups[key] & finite
    return jnp.all(jnp.stack([jnp.all(group) for group in groups.values()]))


def guard_decision(states: Any, on_nonfinite: NonFinite) -> tuple[bool, str, str]:
    """Whether the guard also checks the updated state, and the step plan's line saying so.

    An update can overflow by itself, with a finite loss and finite gradients: adam's second
    moment squares each gradient (a float32 gradient past 1.8e19 overflows it, a float16 one
    past 256), and a large step can push bfloat16 or float16 weights past their range. So
    under ``"skip"`` and ``"raise"`` the guard checks the state the update would write, in
    every dtype, computing the update a second time (elementwise, fused into the check; the
    commit takes its scalars from it) so that nothing is committed that is not finite. Its
    cost is measured in ``benchmarks/results/step.md`` ("non-finite guard");
    ``on_nonfinite="apply"`` turns the guard off.

    Args:
      states: The differentiated parameters and the optimizer's state.
      on_nonfinite: The policy.

    Returns:
      ``(check the state, value, reason)``.
    """
    if on_nonfinite == "apply":
        return False, "none", "on_nonfinite='apply': every update is applied"
    dtypes = sorted({
        str(leaf.dtype) for leaf in jax.tree.leaves(states)
        if jnp.issubdtype(getattr(leaf, "dtype", jnp.int32), jnp.inexact)
    })  # fmt: skip
    return (
        True,
        "loss, gradients and the updated state",
        (
            f"an update can overflow by itself ({', '.join(dtypes) or 'no floating'} state); "
            "it is computed once more for the check (elementwise, its scalars shared; cost "
            "in benchmarks/results/step.md)"
        ),
    )


def check_policy(on_nonfinite: str) -> None:
    """Raises ValueError for a policy other than ``NONFINITE``'s."""
    if on_nonfinite not in NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {NONFINITE}, got {on_nonfinite!r}.")


_GUARDS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _flush_all() -> None:
    """At exit, reports the last call of every step that has not been reported yet."""
    for guard in list(_GUARDS):
        guard.flush()


class Guard:
    """Counts a step's calls and reports the ones whose update was skipped.

    With ``"raise"`` each call waits for its own flag and raises ``FloatingPointError``. With
    ``"skip"`` a call's flag is read when it is ready, at the latest during the next call,
    after that call has been dispatched, so the host never stalls the device for it; the last
    call of a run is reported at exit (:meth:`flush`) if nothing read it before.
    """

    def __init__(self, on_nonfinite: NonFinite):
        check_policy(on_nonfinite)
        self.on_nonfinite = on_nonfinite
        self.calls = 0
        self.state_checked = False  # set by the step that checks the updated state too
        self._pending: tuple[int, dict] | None = None
        _GUARDS.add(self)

    def flush(self) -> None:
        """Reports the call still pending (its flag is waited for)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._report(pending)

    def after(self, metrics: dict) -> None:
        """Notes one call's metrics; reports any finished call that skipped its update.

        Raises:
          FloatingPointError: With ``"raise"``, when this call's loss or gradients were not
            finite (the model and optimizer are unchanged).
        """
        self.calls += 1
        current = (self.calls, metrics)
        if self.on_nonfinite == "raise":
            self._report(current)
            return
        previous, self._pending = self._pending, current
        if previous is not None:
            self._report(previous)
        if metrics["finite"].is_ready():
            self._pending = None
            self._report(current)

    def _report(self, call: tuple[int, dict]) -> None:
        number, metrics = call
        if bool(metrics["finite"]):
            return
        loss = float(metrics["loss"])
        if not jnp.isfinite(loss):
            what = f"loss ({loss})"
        elif self.state_checked:
            what = "gradient or updated state (the loss was finite; the update overflowed "
            what += "or a gradient was not finite)"
        else:
            what = "gradient (the loss was finite)"
        done = (
            "it was applied (on_nonfinite='apply')"
            if self.on_nonfinite == "apply"
            else "its update was skipped, the model and optimizer state are unchanged"
        )
        message = (
            f"Step {number} (call {number} of this train step) has a non-finite {what}: {done}."
        )
        if self.on_nonfinite == "raise":
            raise FloatingPointError(message)
        warn_user(message, NonFiniteWarning)
