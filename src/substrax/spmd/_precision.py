"""Mixed precision: which dtype parameters are stored, moved, computed and reduced in.

Named as its peers name it (PyTorch FSDP2's ``MixedPrecisionPolicy``, DeepMind's ``jmp.Policy``):
master parameters and the optimizer state stay in their stored dtype (``param_dtype``); the
step gathers parameters in ``gather_dtype``, computes in ``compute_dtype``, reduces gradients in
``reduce_dtype`` and returns the loss and metrics in ``output_dtype``. The gradient the
optimizer sees is cast back to the stored dtype, so f32 master weights are updated in f32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["PRECISIONS", "MixedPrecision", "as_precision"]

PRECISIONS = ("f32", "mixed", "bf16")
"""The named policies, one vocabulary for the step (:func:`as_precision`) and the planner.

``"f32"``: everything float32. ``"mixed"`` (:meth:`MixedPrecision.mixed`): float32 master
weights and optimizer state, bfloat16 gathers, compute and gradient reductions.
``"bf16"`` (:meth:`MixedPrecision.bf16`): parameters stored in bfloat16 too.
"""


def _dtype(value: Any, field: str) -> np.dtype | None:
    if value is None:
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError as error:
        raise ValueError(f"MixedPrecision {field} must be a dtype, got {value!r}.") from error
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"MixedPrecision {field} must be a floating-point dtype, got {dtype.name}."
        )
    return dtype


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """A mixed-precision policy for a training step. None everywhere is full precision.

    Attributes:
      param_dtype: The dtype the parameters (and the optimizer state) are stored in: None
        accepts whatever they are; a dtype is checked when the step is built.
      compute_dtype: Parameters and floating-point batch leaves are cast to it at the point of
        use (None: used as stored).
      gather_dtype: The dtype on the wire when sharded parameters are gathered (None: the
        compute dtype, as FSDP2 does).
      reduce_dtype: The dtype gradients are reduced across devices in (None: the gather
        dtype).
      output_dtype: The dtype of the loss and floating-point metrics (None: as computed).
    """

    param_dtype: Any = None
    compute_dtype: Any = None
    gather_dtype: Any = None
    reduce_dtype: Any = None
    output_dtype: Any = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name, _dtype(getattr(self, field.name), field.name))

    @classmethod
    def mixed(cls) -> MixedPrecision:
        """bfloat16 gathers, compute and reductions; float32 master weights and outputs.

        Returns:
          ``MixedPrecision(param_dtype=float32, compute_dtype=bfloat16,
          output_dtype=float32)``.
        """
        return cls(param_dtype=jnp.float32, compute_dtype=jnp.bfloat16, output_dtype=jnp.float32)

    @classmethod
    def bf16(cls) -> MixedPrecision:
        """Parameters stored, gathered, computed and reduced in bfloat16; float32 outputs.

        The model must be created with ``param_dtype=jnp.bfloat16`` (the step checks it).

        Returns:
          ``MixedPrecision(param_dtype=bfloat16, compute_dtype=bfloat16,
          output_dtype=float32)``.
        """
        return cls(param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16, output_dtype=jnp.float32)

    @property
    def gather(self) -> np.dtype | None:
        """The dtype parameters are gathered in (None: as stored)."""
        return self.gather_dtype or self.compute_dtype

    @property
    def reduce(self) -> np.dtype | None:
        """The dtype gradients are reduced in (None: the gradient's own)."""
        return self.reduce_dtype or self.gather

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts the floating-point leaves of ``tree`` to the compute dtype.

        Args:
          tree: A pytree of arrays (parameters, a batch).

        Returns:
          The tree, floating-point leaves cast (integers and the rest untouched; all of it
          when there is no compute dtype).
        """
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Casts the floating-point leaves of ``tree`` to the output dtype.

        Args:
          tree: A pytree of arrays (the loss and metrics).

        Returns:
          The tree, floating-point leaves cast (untouched without an output dtype).
        """
        return _cast_floating(tree, self.output_dtype)


def _cast_floating(tree: Any, dtype: np.dtype | None) -> Any:
    if dtype is None:
        return tree

    def cast(x):
        if isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


def as_precision(value: MixedPrecision | str | None) -> MixedPrecision:
    """A :class:`MixedPrecision` from a policy, a name in :data:`PRECISIONS`, or None.

    Args:
      value: ``"f32"`` or None (full precision), ``"mixed"`` (:meth:`MixedPrecision.mixed`),
        ``"bf16"`` (:meth:`MixedPrecision.bf16`), or a policy.

    Returns:
      The policy.

    Raises:
      ValueError: If ``value`` is another string or type.
    """
    if isinstance(value, MixedPrecision):
        return value
    named = {"f32": MixedPrecision, "mixed": MixedPrecision.mixed, "bf16": MixedPrecision.bf16}
    if value is None:
        return MixedPrecision()
    if isinstance(value, str) and value in named:
        return named[value]()
    raise ValueError(f"precision must be a MixedPrecision or one of {PRECISIONS}, got {value!r}.")
