"""Data-parallel, FSDP, tensor-parallel and pipeline-parallel strategies.

Dimension-name conventions used by :meth:`get_partition_spec`:

* ``"batch"``: the batch dimension of activations and inputs.
* ``"in_features"`` / ``"out_features"``: the two dimensions of an ``nnx.Linear`` kernel
  ``(in_features, out_features)``; a bias is ``("out_features",)``.
* ``"heads"``: the heads dimension of attention kernels, ``(in_features, "heads", head_dim)``
  for query/key/value and ``("heads", head_dim, out_features)`` for the output projection.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING

from substrax.mesh._resolve import partition_spec
from substrax.mesh._strategy import ShardDims, ShardingStrategy

if TYPE_CHECKING:  # imported where a spec or an array is made: the planner runs without jax
    import jax
    from jax.sharding import Mesh, PartitionSpec

__all__ = [
    "DataParallelStrategy",
    "FSDPStrategy",
    "PipelineParallelStrategy",
    "TensorParallelStrategy",
]

_SHARD_DIMENSIONS = ("in_features", "out_features")
_FSDP_SHARD = ("first", "largest")

#: Flax layers tensor parallelism knows by class name (``TensorParallelStrategy`` layouts).
_LAYER_KINDS = {
    **{name: "dense" for name in ("Linear", "Conv", "ConvTranspose")},
    "Embed": "embed",
    **{name: "norm" for name in ("LayerNorm", "RMSNorm", "BatchNorm", "GroupNorm", "InstanceNorm")},
}


def _spec_on(names: tuple[str, ...], index: int | None, axis_name: str) -> PartitionSpec:
    return partition_spec(*(axis_name if i == index else None for i in range(len(names))))


def balanced_counts(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` counts that differ by at most one, the earlier larger.

    The one rule for spreading layers over pipeline stages (and, for circular schedules, over
    stage x repeat chunks): 10 layers in 4 parts are ``[3, 3, 2, 2]``.
    """
    base, extra = divmod(total, parts)
    return [base + (1 if part < extra else 0) for part in range(parts)]


def _positive_int(value: object, what: str) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}.")
    return int(value)


class DataParallelStrategy(ShardingStrategy):
    """Data parallel sharding strategy.

    Shards the batch dimension across devices while replicating model parameters and
    computation. Parameters (:meth:`resolve`) are replicated; :meth:`apply_sharding`
    treats its array as a batch and shards its leading dimension.
    """

    def get_partition_spec(self, tensor_shape: tuple[str, ...]) -> PartitionSpec:
        """Get partition spec for data parallel sharding.

        Only shards the batch dimension (the one named ``"batch"``), leaves others replicated.

        Args:
          tensor_shape: Dimension names of the tensor.

        Returns:
          A PartitionSpec with ``axis_name`` on the ``"batch"`` dimension, if any.
        """
        names = tuple(tensor_shape)
        return _spec_on(names, names.index("batch") if "batch" in names else None, self.axis_name)

    def _shard_dims(
        self, shape: tuple[int, ...], name: str | None, size: int, layer: str | None = None
    ) -> ShardDims:
        reason = self._reason("by_design", "data parallelism replicates parameters")
        return (), reason if shape else None

    def apply_sharding(self, array: jax.Array, mesh: Mesh) -> jax.Array:
        """Apply data parallel sharding to array.

        The array is a batch: its leading dimension is sharded over ``axis_name``. A scalar is
        replicated.

        Args:
          array: A batch whose leading dimension is the batch dimension.
          mesh: The mesh that has ``axis_name``.

        Returns:
          The array, sharded along its leading dimension.

        Raises:
          ValueError: If the batch dimension does not divide the data axis size.
        """
        size = self._check_mesh(mesh)
        if array.ndim == 0:
            return self._place(array, mesh, partition_spec())
        if array.shape[0] % size:
            raise ValueError(
                f"Batch dimension of size {array.shape[0]} (shape {array.shape}) does not divide "
                f"mesh axis {self.axis_name!r} of size {size}; use a batch size that is a "
                f"multiple of {size}."
            )
        return self._place(array, mesh, partition_spec(self.axis_name))


class FSDPStrategy(ShardingStrategy):
    """Fully Sharded Data Parallel strategy.

    Shards model parameters across devices to reduce memory usage while maintaining training
    efficiency. By default (``shard="first"``, the reference behaviour) a parameter is sharded
    along its first dimension when that dimension is at least ``min_weight_size`` and divides
    the axis size; otherwise it is replicated. With ``shard="largest"`` (opt-in) it is sharded
    along its largest dimension that the axis size divides (the first of equals): real layers
    put their big dimension anywhere (an attention output ``(heads, head_dim, d_model)``, a conv
    kernel ``(kh, kw, in, out)``), and the first dimension is often the small one; such a
    strategy usually sets ``min_weight_size=0`` and counts ``min_elements`` instead. Both
    thresholds mean the same in either mode. Batches are sharded along ``"batch"`` over the
    same axis.
    """

    def __init__(
        self,
        axis_name: str,
        mesh_axis: int,
        min_weight_size: int = 1024,
        *,
        shard: str = "first",
        min_elements: int = 0,
    ):
        """Initialize FSDP strategy.

        Args:
          axis_name: Name of the mesh axis.
          mesh_axis: Index of the mesh axis.
          min_weight_size: Minimum first dimension size to enable sharding (whichever
            dimension ``shard`` then picks), as ``ShardingConfig.fsdp_min_weight_size``.
          shard: ``"first"`` (the first dimension) or ``"largest"`` (the largest dimension the
            axis divides).
          min_elements: The fewest elements a weight needs to be sharded (0: any), as
            ``Layout.fsdp_min_elements``: a layout's FSDP axes shard unannotated variables
            this way, keeping norm scales and biases whole.

        Raises:
          ValueError: If ``min_weight_size`` or ``min_elements`` is negative, ``shard`` is not
            one of the two, or an argument is malformed.
        """
        super().__init__(axis_name, mesh_axis)
        if shard not in _FSDP_SHARD:
            raise ValueError(f"shard must be one of {_FSDP_SHARD}, got {shard!r}.")
        self.shard = shard
        if (
            not isinstance(min_weight_size, numbers.Integral)
            or isinstance(min_weight_size, bool)
            or min_weight_size < 0
        ):
            raise ValueError(
                f"min_weight_size must be a non-negative integer, got {min_weight_size!r}."
            )
        self.min_weight_size = int(min_weight_size)
        if (
            not isinstance(min_elements, numbers.Integral)
            or isinstance(min_elements, bool)
            or (min_elements < 0)
        ):
            raise ValueError(f"min_elements must be a non-negative integer, got {min_elements!r}.")
        self.min_elements = int(min_elements)

    def should_shard_weight(self, weight: jax.Array) -> bool:
        """Determine if a weight should be sharded based on its size.

        Args:
          weight: Weight array to check (anything with a ``shape``, such as a
            ``jax.ShapeDtypeStruct``).

        Returns:
          True if weight should be sharded, False otherwise: it has at least one dimension,
          its first dimension is at least ``min_weight_size`` and it has at least
          ``min_elements`` elements.
        """
        shape = tuple(weight.shape)
        big = math.prod(shape) >= self.min_elements
        return bool(shape) and shape[0] >= self.min_weight_size and big

    def get_partition_spec(self, tensor_shape: tuple[str, ...]) -> PartitionSpec:
        """Get partition spec for FSDP sharding.

        Shards along the first dimension of weight tensors; a tensor with a ``"batch"``
        dimension is an activation and is sharded along ``"batch"`` instead.

        Args:
          tensor_shape: Dimension names of the tensor.

        Returns:
          A PartitionSpec with ``axis_name`` on one dimension (none for a scalar).
        """
        names = tuple(tensor_shape)
        if "batch" in names:
            return _spec_on(names, names.index("batch"), self.axis_name)
        return _spec_on(names, 0 if names else None, self.axis_name)

    def get_gradient_partition_spec(self, tensor_shape: tuple[str, ...]) -> PartitionSpec:
        """Get partition spec for gradient sharding (same as weights).

        Args:
          tensor_shape: Dimension names of the tensor.

        Returns:
          The same PartitionSpec as :meth:`get_partition_spec`.
        """
        return self.get_partition_spec(tensor_shape)

    def _shard_dims(
        self, shape: tuple[int, ...], name: str | None, size: int, layer: str | None = None
    ) -> ShardDims:
        if not shape:
            return (), None
        if shape[0] < self.min_weight_size:
            detail = f"first dimension {shape[0]} is below min_weight_size {self.min_weight_size}"
            return (), self._reason("below_threshold", detail)
        if math.prod(shape) < self.min_elements:
            detail = f"{math.prod(shape)} elements are below min_elements {self.min_elements}"
            return (), self._reason("below_threshold", detail)
        if self.shard == "largest":
            return self._largest(shape, size)
        return (0,), None

    def _largest(self, shape: tuple[int, ...], size: int) -> ShardDims:
        # The size is checked by the resolver; here: the largest dimension the axis divides.
        order = sorted(range(len(shape)), key=lambda d: -shape[d])
        dim = next((d for d in order if shape[d] % size == 0), order[0])
        return (dim,), None

    def apply_sharding(self, array: jax.Array, mesh: Mesh) -> jax.Array:
        """Apply FSDP sharding to array.

        Args:
          array: A parameter.
          mesh: The mesh that has ``axis_name``.

        Returns:
          The array sharded along its first dimension, or replicated when
          :meth:`should_shard_weight` is false or the dimension does not divide the axis size
          (the latter with a warning).
        """
        return self._place_param(array, mesh)


class TensorParallelStrategy(ShardingStrategy):
    """Tensor parallel sharding strategy.

    Shards model computation across devices by splitting tensors along specific dimensions
    (typically features), in Flax layouts: an ``nnx.Linear`` kernel is
    ``(in_features, out_features)``; ``nnx.MultiHeadAttention`` query/key/value kernels are
    ``(in_features, heads, head_dim)`` and its output kernel ``(heads, head_dim, out_features)``.

    By shape (:meth:`resolve`, :meth:`apply_sharding`): a 2-D array is a Linear kernel,
    a 1-D array its bias (sharded when column-parallel), a 3-D array an attention kernel,
    query/key/value unless its path's layer is named ``out``; a 2-D ``bias`` is an attention
    bias ``(heads, head_dim)``; a 4-D array is a conv kernel ``(kh, kw, in, out)`` (output
    channels when column-parallel, input channels when row-parallel). Normalisation
    parameters (a path through a ``*norm*`` layer, or named ``scale``) and ``(1, T, D)``
    position embeddings are replicated. Other ranks are replicated.

    When the caller knows the layer (``resolve(..., layer=...)``; the Flax adapter passes the
    module class), the layer decides before the shape: ``Linear`` and ``Conv`` kernels split
    their output features (column) or input features (row), their biases follow the output;
    ``Embed`` tables split the vocabulary; ``MultiHeadAttention`` query/key/value kernels split
    their heads and its output kernel its heads (its bias stays whole); norms are replicated.
    """

    def __init__(self, axis_name: str, mesh_axis: int, shard_dimension: str | None = None):
        """Initialize tensor parallel strategy.

        Args:
          axis_name: Name of the mesh axis.
          mesh_axis: Index of the mesh axis.
          shard_dimension: Preferred dimension to shard (``'in_features'``, row-parallel, or
            ``'out_features'``, column-parallel). None means ``'out_features'``.

        Raises:
          ValueError: If ``shard_dimension`` is not one of the above.
        """
        super().__init__(axis_name, mesh_axis)
        if shard_dimension is not None and shard_dimension not in _SHARD_DIMENSIONS:
            raise ValueError(
                f"shard_dimension must be one of {_SHARD_DIMENSIONS} or None, "
                f"got {shard_dimension!r}."
            )
        self.shard_dimension = shard_dimension or "out_features"

    def get_partition_spec(self, tensor_shape: tuple[str, ...]) -> PartitionSpec:
        """Get partition spec for tensor parallel sharding.

        Shards the ``"heads"`` dimension when there is one, else the ``shard_dimension``
        dimension when there is one; other tensors are replicated.

        Args:
          tensor_shape: Dimension names of the tensor.

        Returns:
          A PartitionSpec with ``axis_name`` on at most one dimension.
        """
        names = tuple(tensor_shape)
        for wanted in ("heads", self.shard_dimension):
            if wanted in names:
                return _spec_on(names, names.index(wanted), self.axis_name)
        return _spec_on(names, None, self.axis_name)

    def get_linear_weight_spec(self) -> PartitionSpec:
        """Get partition spec for linear layer weights.

        Returns:
          ``P(None, axis)`` when column-parallel, ``P(axis, None)`` when row-parallel.
        """
        return self.get_partition_spec(_SHARD_DIMENSIONS)

    def get_attention_qkv_spec(self) -> PartitionSpec:
        """Get partition spec for attention QKV projections.

        Returns:
          ``P(None, axis, None)``: the heads of an ``(in, heads, head_dim)`` kernel.
        """
        return self.get_partition_spec(("in_features", "heads", "head_dim"))

    def get_attention_output_spec(self) -> PartitionSpec:
        """Get partition spec for attention output projection.

        Returns:
          ``P(axis, None, None)``: the heads of a ``(heads, head_dim, out)`` kernel.
        """
        return self.get_partition_spec(("heads", "head_dim", "out_features"))

    def _shard_dims(
        self, shape: tuple[int, ...], name: str | None, size: int, layer: str | None = None
    ) -> ShardDims:
        parts = name.split("/") if name else []
        column = self.shard_dimension == "out_features"
        by_layer = self._by_layer(shape, parts[-1:], layer, column)
        if by_layer is not None:
            return by_layer
        if any("norm" in part for part in parts[:-1]) or parts[-1:] == ["scale"]:
            return (), self._reason("by_design", "normalisation parameters are replicated")
        if len(shape) == 3 and shape[0] == 1:
            detail = f"a {shape} array is an embedding (1, T, D), not an attention kernel"
            return (), self._reason("by_design", detail)
        if len(shape) == 4:  # a conv kernel (kh, kw, in, out): output or input channels
            return ((3,) if column else (2,)), None
        if len(shape) == 3:
            return ((0,) if "out" in parts[-2:-1] else (1,)), None
        if len(shape) == 2:
            if parts[-1:] == ["bias"]:
                return (0,), None
            return ((1,) if column else (0,)), None
        if len(shape) == 1:
            if column:
                return (0,), None
            return (), self._reason("by_design", "row-parallel bias is replicated")
        if not shape:
            return (), None
        detail = f"tensor parallelism shards only 1-3 dimensional weights, not shape {shape}"
        return (), self._reason("by_design", detail)

    def _by_layer(
        self, shape: tuple[int, ...], leaf: list[str], layer: str | None, column: bool
    ) -> ShardDims | None:
        """The decision from the kind of layer, or None to fall back on the shape."""
        kind = _LAYER_KINDS.get(layer or "", "attention" if (layer or "").startswith(
            "MultiHeadAttention.") else None)  # fmt: skip
        if kind is None or not shape:
            return None
        bias = leaf == ["bias"]
        if kind == "norm":
            return (), self._reason("by_design", f"{layer} parameters are replicated")
        if kind == "embed":  # (vocab, features): vocab-parallel
            return (0,), None
        if kind == "attention":
            output = layer.endswith(".out")
            if bias:
                return ((), self._reason("by_design", "the output bias is replicated")) if output \
                    else ((0,), None)  # fmt: skip
            return ((0,) if output else (1,)), None
        if bias:  # Linear, Conv: the output features
            if column:
                return (len(shape) - 1,), None
            return (), self._reason("by_design", "row-parallel bias is replicated")
        return ((len(shape) - 1,) if column else (len(shape) - 2,)), None

    def apply_sharding(self, array: jax.Array, mesh: Mesh) -> jax.Array:
        """Apply tensor parallel sharding to array.

        Args:
          array: A weight, interpreted by its rank as described in the class docstring.
          mesh: The mesh that has ``axis_name``.

        Returns:
          The sharded array (replicated, with a warning, where the dimension does not divide).
        """
        return self._place_param(array, mesh)


class PipelineParallelStrategy(ShardingStrategy):
    """Pipeline parallel sharding strategy.

    Distributes model layers across devices to enable pipeline parallelism for very large
    models that don't fit on single devices. Tensors themselves are replicated by this
    strategy; stage ``s`` sends activations to stage ``s + 1`` in the forward pass.
    """

    def __init__(self, axis_name: str, mesh_axis: int, num_stages: int):
        """Initialize pipeline parallel strategy.

        Args:
          axis_name: Name of the mesh axis.
          mesh_axis: Index of the mesh axis.
          num_stages: Number of pipeline stages.

        Raises:
          ValueError: If ``num_stages`` is not a positive integer.
        """
        super().__init__(axis_name, mesh_axis)
        self.num_stages = _positive_int(num_stages, "num_stages")

    def assign_layers_to_stages(self, num_layers: int) -> list[int]:
        """Assign layers to pipeline stages.

        Layers are spread as evenly as possible: counts differ by at most one, and the earlier
        stages take the extra layers (10 layers on 4 stages: ``[3, 3, 2, 2]``).

        Args:
          num_layers: Total number of layers in the model.

        Returns:
          list of layer counts per stage

        Raises:
          ValueError: If ``num_layers`` is smaller than the number of stages.
        """
        num_layers = _positive_int(num_layers, "num_layers")
        if num_layers < self.num_stages:
            raise ValueError(
                f"Cannot assign {num_layers} layers to {self.num_stages} pipeline stages: every "
                f"stage needs at least one layer (use at most {num_layers} stages)."
            )
        return balanced_counts(num_layers, self.num_stages)

    def get_partition_spec(self, tensor_shape: tuple[str, ...]) -> PartitionSpec:
        """Get partition spec for pipeline parallel sharding.

        Pipeline parallelism doesn't shard individual tensors, but rather assigns entire layers
        to different devices.

        Args:
          tensor_shape: Dimension names of the tensor.

        Returns:
          A fully replicated PartitionSpec of the tensor's rank.
        """
        return partition_spec(*(None for _ in tensor_shape))

    def get_forward_communication_pattern(self) -> list[tuple[int, int]]:
        """Get communication pattern for forward pass.

        Returns:
          list of (source_stage, dest_stage) pairs: ``[(0, 1), (1, 2), ...]``.
        """
        return [(stage, stage + 1) for stage in range(self.num_stages - 1)]

    def get_backward_communication_pattern(self) -> list[tuple[int, int]]:
        """Get communication pattern for backward pass.

        Returns:
          list of (source_stage, dest_stage) pairs: the forward pattern reversed, in reverse
          order (``[..., (2, 1), (1, 0)]``).
        """
        return [(dest, src) for src, dest in reversed(self.get_forward_communication_pattern())]

    def apply_sharding(self, array: jax.Array, mesh: Mesh) -> jax.Array:
        """Apply pipeline parallel sharding to array.

        Pipeline parallelism handles layer assignment rather than tensor sharding.

        Args:
          array: Any array.
          mesh: The mesh that has ``axis_name``.

        Returns:
          The array, replicated over the mesh.

        Raises:
          ValueError: If the mesh's stage axis size differs from ``num_stages``.
        """
        size = self._check_mesh(mesh)
        if size != self.num_stages:
            raise ValueError(
                f"Mesh axis {self.axis_name!r} has size {size}, but the strategy has "
                f"{self.num_stages} stages; they must match."
            )
        return self._place(array, mesh, partition_spec())
