"""ShardingConfig and ParallelismConfig: how many devices each kind of parallelism gets."""

from __future__ import annotations

import dataclasses
import math
import numbers

__all__ = ["ParallelismConfig", "ShardingConfig"]

#: Mesh axis names used by :meth:`ParallelismConfig.from_sharding_config`, outermost first.
PIPE_AXIS, DATA_AXIS, MODEL_AXIS = "pipe", "data", "model"

_MAX_TENSOR_PARALLEL = 8


def _check_int(value: object, what: str, minimum: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{what} must be an integer >= {minimum}, got {value!r}.")
    return int(value)


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """Configuration for multi-dimensional parallelism setup.

    Defines the parallelism dimensions and FSDP settings for a model. FSDP, when enabled, shards
    parameters over the data-parallel devices (ZeRO-3 style), so it adds no devices of its own.

    Attributes:
      data_parallel_size: Devices the batch is split over.
      tensor_parallel_size: Devices each layer's weights are split over.
      pipeline_parallel_size: Pipeline stages.
      fsdp_enabled: Whether parameters are also sharded over the data-parallel devices.
      fsdp_min_weight_size: Smallest first dimension that FSDP shards.
    """

    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    fsdp_enabled: bool = False
    fsdp_min_weight_size: int = 1024

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "tensor_parallel_size", "pipeline_parallel_size"):
            object.__setattr__(self, name, _check_int(getattr(self, name), name, 1))
        min_size = _check_int(self.fsdp_min_weight_size, "fsdp_min_weight_size", 0)
        object.__setattr__(self, "fsdp_min_weight_size", min_size)
        if not isinstance(self.fsdp_enabled, bool):
            raise ValueError(f"fsdp_enabled must be a bool, got {self.fsdp_enabled!r}.")

    def get_total_device_count(self) -> int:
        """Calculate total devices needed for this configuration.

        Returns:
          ``data_parallel_size * tensor_parallel_size * pipeline_parallel_size``.
        """
        return self.data_parallel_size * self.tensor_parallel_size * self.pipeline_parallel_size

    @classmethod
    def from_device_count(cls, device_count: int) -> ShardingConfig:
        """Create optimal sharding config for given device count.

        Uses heuristics to balance different parallelism dimensions. For a config chosen by
        model size and device memory, ask the planner instead:
        ``substrax.planner.plan(model, n, hardware, workload).best.layout.sharding_config()``
        (the planner sits above :mod:`substrax.mesh`, so this method does not call it).
        Tensor parallelism gets
        the largest divisor ``t`` of ``device_count`` with ``t <= 8`` and ``t * t <=
        device_count`` (tensor parallelism wants the fast links within a host, and should not
        outgrow data parallelism); data parallelism gets the rest; FSDP is enabled whenever
        data parallelism spans more than one device. Pipeline parallelism stays at 1: it needs
        a model whose layers split into stages, so it is never chosen from a count alone. The
        product of the sizes is always ``device_count``.

        Args:
          device_count: The number of devices, at least 1.

        Returns:
          A :class:`ShardingConfig` whose total device count is ``device_count``.

        Raises:
          ValueError: If ``device_count`` is not a positive integer.
        """
        count = _check_int(device_count, "device_count", 1)
        tensor = max(
            t for t in range(1, _MAX_TENSOR_PARALLEL + 1) if count % t == 0 and t * t <= count
        )
        data = count // tensor
        return cls(data_parallel_size=data, tensor_parallel_size=tensor, fsdp_enabled=data > 1)


@dataclasses.dataclass(frozen=True)
class ParallelismConfig:
    """Complete parallelism configuration including mesh topology.

    Combines sharding configuration with device mesh setup.

    Attributes:
      mesh_shape: Size of each mesh axis.
      mesh_axis_names: Name of each mesh axis, in the same order.
      sharding_config: The sharding configuration the mesh realises.
    """

    mesh_shape: tuple[int, ...]
    mesh_axis_names: tuple[str, ...]
    sharding_config: ShardingConfig

    def __post_init__(self) -> None:
        shape, names = self.mesh_shape, self.mesh_axis_names
        if isinstance(shape, (str, bytes)) or not isinstance(shape, (tuple, list)):
            raise ValueError(
                f"mesh_shape must be a tuple of axis sizes such as (2, 4), got "
                f"{type(shape).__name__} {shape!r}."
            )
        if isinstance(names, str) or not isinstance(names, (tuple, list)):
            raise ValueError(
                f"mesh_axis_names must be a tuple of names such as ('data', 'model'), got "
                f"{type(names).__name__} {names!r}."
            )
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
            raise ValueError(f"mesh_shape must hold integer sizes, got {tuple(shape)!r}.")
        if len(shape) != len(names):
            raise ValueError(
                f"mesh_shape {tuple(shape)} has {len(shape)} axes but mesh_axis_names "
                f"{tuple(names)} names {len(names)}: give one name per axis."
            )
        object.__setattr__(self, "mesh_shape", tuple(shape))
        object.__setattr__(self, "mesh_axis_names", tuple(names))
        if not isinstance(self.sharding_config, ShardingConfig):
            raise ValueError(
                f"sharding_config must be a ShardingConfig, got {type(self.sharding_config)}."
            )

    @property
    def axis_sizes(self) -> dict[str, int]:
        """``{axis_name: size}`` in mesh order, ready for ``create_device_mesh``."""
        return dict(zip(self.mesh_axis_names, self.mesh_shape, strict=False))

    def is_valid(self) -> bool:
        """Validate that mesh shape matches sharding configuration.

        Valid means: one distinct, non-empty name per positive size; the sizes multiply to the
        configuration's total device count; and the axes named ``"pipe"``, ``"data"`` and
        ``"model"``, where present, have the pipeline, data and tensor parallel sizes.

        Returns:
          True if the mesh realises the configuration, False otherwise.
        """
        names, sizes = self.mesh_axis_names, self.mesh_shape
        if len(names) != len(sizes) or len(set(names)) != len(names):
            return False
        if not all(isinstance(n, str) and n for n in names):
            return False
        if not all(isinstance(s, numbers.Integral) and s >= 1 for s in sizes):
            return False
        config = self.sharding_config
        if math.prod(sizes) != config.get_total_device_count():
            return False
        expected = {
            PIPE_AXIS: config.pipeline_parallel_size,
            DATA_AXIS: config.data_parallel_size,
            MODEL_AXIS: config.tensor_parallel_size,
        }
        return all(self.axis_sizes[n] == size for n, size in expected.items() if n in names)

    @classmethod
    def from_sharding_config(cls, config: ShardingConfig) -> ParallelismConfig:
        """Create parallelism config from sharding configuration.

        The mesh has three axes, outermost first: ``"pipe"`` (pipeline stages), ``"data"``
        (data parallelism, and FSDP when enabled) and ``"model"`` (tensor parallelism, the
        innermost so that its devices are neighbours). Axes of size 1 are kept so that the
        names are always the same.

        Args:
          config: The sharding configuration.

        Returns:
          A valid :class:`ParallelismConfig`; pass its ``axis_sizes`` to
          ``DeviceMeshManager.create_device_mesh``.
        """
        shape = (
            config.pipeline_parallel_size,
            config.data_parallel_size,
            config.tensor_parallel_size,
        )
        return cls(shape, (PIPE_AXIS, DATA_AXIS, MODEL_AXIS), config)
