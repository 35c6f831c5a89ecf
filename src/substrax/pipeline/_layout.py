"""Where each layer of a stack lives in a pipeline: stage, round, slot, and its FSDP dimension."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from substrax.mesh import PipelineParallelStrategy
from substrax.mesh._resolve import resolve_axes
from substrax.mesh._strategies import balanced_counts

__all__ = ["StageLayout"]


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """A layer stack laid out as ``[stages, rounds, slots, ...]`` over the stage axis.

    Attributes:
      mesh: The mesh.
      strategy: Names the stage axis and the number of stages.
      repeats: Rounds of the ring (circular schedules; 1 otherwise).
      fsdp_axis: A mesh axis over which each layer's parameters are also sharded, or None.
      fsdp_dims: ``(layer_shape, dim)`` pairs: where a model's plan put the FSDP axis (dim
        None: kept whole), so the pipeline gathers each parameter as it is stored. Shapes not
        listed take the first dimension the axis divides.
    """

    mesh: Mesh
    strategy: PipelineParallelStrategy
    repeats: int = 1
    fsdp_axis: str | None = None
    fsdp_dims: tuple[tuple[tuple[int, ...], int | None], ...] = ()

    @property
    def stage_axis(self) -> str:
        """The mesh axis of the stages."""
        return self.strategy.axis_name

    @property
    def num_stages(self) -> int:
        """The number of stages."""
        return self.strategy.num_stages

    def layer_counts(self, num_layers: int) -> list[list[int]]:
        """Layers per stage and repeat: ``counts[stage][repeat]`` (see ``Pipeline``)."""
        chunks = self.num_stages * self.repeats
        if self.repeats == 1:
            counts = self.strategy.assign_layers_to_stages(num_layers)
        elif num_layers < chunks:
            raise ValueError(
                f"Cannot split {num_layers} layers into {chunks} chunks ({self.num_stages} "
                f"stages x {self.repeats} repeats): every chunk needs a layer."
            )
        else:
            counts = balanced_counts(num_layers, chunks)
        return [[counts[r * self.num_stages + s] for r in range(self.repeats)]
                for s in range(self.num_stages)]  # fmt: skip

    def slots(self, num_layers: int) -> tuple[np.ndarray, np.ndarray]:
        """Layer index of every padded slot ``[S, R, Lc]`` (padding: 0) and its mask."""
        counts = self.layer_counts(num_layers)
        width = max(c for stage in counts for c in stage)
        index = np.zeros((self.num_stages, self.repeats, width), np.int32)
        mask = np.zeros((self.num_stages, self.repeats, width), bool)
        start = 0
        for r in range(self.repeats):
            for s in range(self.num_stages):
                count = counts[s][r]
                index[s, r, :count] = np.arange(start, start + count)
                mask[s, r, :count] = True
                start += count
        return index, mask

    def num_slots(self, num_layers: int) -> int:
        """Slots of the padded stack: ``stages x repeats x`` the widest chunk's layers."""
        index, _ = self.slots(num_layers)
        return index.size

    def stack(self, params: Any, num_layers: int | None = None) -> tuple[Any, jax.Array]:
        """Pads and places a layer stack (see ``Pipeline.stack``)."""
        counts = {leaf.shape[0] for leaf in jax.tree.leaves(params)}
        if len(counts) != 1:
            raise ValueError(f"Every parameter needs the same leading layer axis, got {counts}.")
        stored = counts.pop()
        real = stored if num_layers is None else num_layers
        index, mask = self.slots(real)
        in_order = np.array_equal(index.reshape(-1), np.arange(index.size))
        if stored == index.size and (stored != real or in_order):  # the slots, in order
            take = lambda a: jnp.reshape(a, (*index.shape, *a.shape[1:]))  # noqa: E731
        elif stored == real:  # padding, or a circular order: a gather
            take = lambda a: jnp.asarray(a)[index]  # noqa: E731
        else:
            raise ValueError(
                f"A stack of {stored} layers is neither the {real} layers of num_layers nor "
                f"their {index.size} padded slots ({self.num_stages} stages x {self.repeats} "
                f"repeats x {index.shape[-1]})."
            )
        sharding = NamedSharding(self.mesh, PartitionSpec(self.stage_axis))
        padded = jax.tree.map(
            lambda a: jax.device_put(
                take(a), NamedSharding(self.mesh, self.param_spec(a.shape[1:]))
            ),
            params,
        )
        return padded, jax.device_put(jnp.asarray(mask), sharding)

    def unstack(self, padded: Any, num_layers: int, keep_padding: bool = False) -> Any:
        """``[S, R, Lc, ...]`` back to ``[L, ...]`` (or to the padded slots in slot order)."""
        flat = jax.tree.map(lambda a: a.reshape(-1, *a.shape[3:]), padded)
        if keep_padding:
            return flat
        index, mask = self.slots(num_layers)
        order = np.argsort(np.where(mask, index, num_layers).reshape(-1), kind="stable")
        keep = order[:num_layers]
        if np.array_equal(keep, np.arange(num_layers)):  # a slice, not a gather XLA may move
            return jax.tree.map(lambda a: a[:num_layers], flat)
        return jax.tree.map(lambda a: a[keep], flat)

    def fsdp_dim(self, layer_shape: Sequence[int]) -> int | None:
        """The per-layer dimension FSDP shards: the first the ``fsdp_axis`` divides, or None.

        This is substrax's one resolver asked to put the FSDP axis on every dimension: the
        first dimension that it divides keeps it.
        """
        if self.fsdp_axis is None or not layer_shape:
            return None
        given = dict(self.fsdp_dims)
        if tuple(layer_shape) in given:
            return given[tuple(layer_shape)]
        proposal = [(self.fsdp_axis,)] * len(layer_shape)
        spec = resolve_axes(proposal, tuple(layer_shape), self.mesh).spec
        return next((d for d, entry in enumerate(spec) if entry is not None), None)

    def param_spec(self, layer_shape: Sequence[int]) -> PartitionSpec:
        """The spec of a padded ``[S, R, Lc, *layer_shape]`` parameter."""
        dim = self.fsdp_dim(layer_shape)
        if dim is None:
            return PartitionSpec(self.stage_axis)
        return PartitionSpec(self.stage_axis, None, None, *([None] * dim), self.fsdp_axis)
