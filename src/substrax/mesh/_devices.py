"""DeviceMeshManager: named device meshes over the visible devices, Auto axes by default."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, AxisType, Mesh

MeshShape = Mapping[str, int] | Sequence[tuple[str, int]]

__all__ = ["DeviceMeshManager", "simulate_hint"]


def simulate_hint(needed: int, devices: Sequence[Any]) -> str:
    """How to get ``needed`` devices on CPU, when ``devices`` are too few CPU devices; else "".

    Args:
      needed: The devices a mesh needs.
      devices: The devices there are.

    Returns:
      A sentence to append to an error.
    """
    if len(devices) >= needed or any(d.platform != "cpu" for d in devices):
        return ""
    return (
        f" On CPU, simulate {needed} devices before jax first touches a device: "
        f'jax.config.update("jax_num_cpu_devices", {needed}) at the top of the script '
        f"(or XLA_FLAGS=--xla_force_host_platform_device_count={needed})."
    )


def _normalize_shape(mesh_shape: MeshShape) -> list[tuple[str, int]]:
    """Turns a dict or a list of ``(name, size)`` pairs into a validated list of pairs."""
    if isinstance(mesh_shape, Mapping):
        pairs = list(mesh_shape.items())
    elif isinstance(mesh_shape, Sequence) and not isinstance(mesh_shape, str):
        pairs = list(mesh_shape)
        for pair in pairs:
            if not (isinstance(pair, Sequence) and not isinstance(pair, str) and len(pair) == 2):
                raise ValueError(
                    f"mesh_shape entries must be (name, size) pairs, got {pair!r} "
                    f"in {mesh_shape!r}."
                )
        pairs = [tuple(pair) for pair in pairs]
    else:
        raise ValueError(
            "mesh_shape must be a dict {name: size} or a list of (name, size) pairs, "
            f"got {mesh_shape!r}."
        )
    if not pairs:
        raise ValueError("mesh_shape is empty: name at least one axis, e.g. {'data': -1}.")
    _check_names([name for name, _ in pairs], mesh_shape)
    _check_sizes(pairs, mesh_shape)
    return pairs


def _check_names(names: list[Any], mesh_shape: MeshShape) -> None:
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"Mesh axis names must be non-empty strings, got {name!r} in {mesh_shape!r}."
            )
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(
            f"Mesh axis names must be unique, got {duplicates} more than once in {mesh_shape!r}."
        )


def _check_sizes(pairs: list[tuple[str, Any]], mesh_shape: MeshShape) -> None:
    for name, size in pairs:
        valid = isinstance(size, numbers.Integral) and not isinstance(size, bool)
        if not valid or (size < 1 and size != -1):
            raise ValueError(
                f"Mesh axis {name!r} has size {size!r}; sizes must be positive integers, "
                f"or -1 for 'all remaining devices' (in {mesh_shape!r})."
            )
    inferred = [name for name, size in pairs if size == -1]
    if len(inferred) > 1:
        raise ValueError(
            f"At most one mesh axis may have size -1, got {inferred} in {mesh_shape!r}."
        )


def _resolve_inferred(pairs: list[tuple[str, int]], num_devices: int) -> list[tuple[str, int]]:
    """Replaces a ``-1`` size by the number of devices that the other axes leave."""
    known = math.prod(size for _, size in pairs if size != -1)
    if all(size != -1 for _, size in pairs):
        return pairs
    if num_devices % known:
        raise ValueError(
            f"Cannot infer the -1 axis of {dict(pairs)}: the other axes multiply to {known}, "
            f"which does not divide the {num_devices} devices."
        )
    return [(name, num_devices // known if size == -1 else size) for name, size in pairs]


def _check_axis_types(axis_types: Sequence[AxisType] | None, names: list[str]) -> tuple:
    if axis_types is None:
        return (AxisType.Auto,) * len(names)
    axis_types = tuple(axis_types)
    if len(axis_types) != len(names):
        raise ValueError(
            f"axis_types must name one type per axis: got {len(axis_types)} "
            f"({axis_types}) for the {len(names)} axes {tuple(names)}."
        )
    for axis_type in axis_types:
        if not isinstance(axis_type, AxisType):
            raise ValueError(
                f"axis_types entries must be jax.sharding.AxisType values "
                f"({', '.join(t.name for t in AxisType)}), got {axis_type!r}."
            )
    return axis_types


def _check_devices(devices: Any) -> list[Any]:
    """``devices`` as a list of distinct jax devices.

    Raises:
      TypeError: If it is not a sequence of ``jax.Device``.
      ValueError: If it is empty or holds a device twice.
    """
    if isinstance(devices, (str, bytes, Mapping)) or not isinstance(devices, Iterable):
        raise TypeError(
            f"devices must be a sequence of jax devices such as jax.devices()[:8], got "
            f"{type(devices).__name__} {devices!r}."
        )
    devices = list(devices)
    if not devices:
        raise ValueError("devices is empty: pass at least one device, or None for all.")
    for index, device in enumerate(devices):
        if not isinstance(device, jax.Device):
            raise TypeError(
                f"devices[{index}] is {device!r} ({type(device).__name__}), not a jax device: "
                "pass devices such as jax.devices()[:8], not device ids."
            )
    seen: dict[Any, int] = {}
    for index, device in enumerate(devices):
        if device in seen:
            raise ValueError(
                f"devices holds {device} twice (at {seen[device]} and {index}); each device may "
                "appear once in a mesh."
            )
        seen[device] = index
    return devices


def check_mesh(mesh: Any, *, argument: str = "mesh") -> Mesh:
    """``mesh`` itself if it is a ``jax.sharding.Mesh`` (or ``AbstractMesh``); else a clear error.

    Args:
      mesh: The value passed as a mesh.
      argument: The argument's name, for the message.

    Returns:
      The mesh.

    Raises:
      TypeError: If ``mesh`` is not a ``jax.sharding.Mesh`` (a dict of axis sizes, say).
    """
    if isinstance(mesh, (Mesh, AbstractMesh)):
        return mesh
    hint = (
        f" Build one with DeviceMeshManager.create_device_mesh({mesh!r})."
        if isinstance(mesh, Mapping)
        else " Build one with DeviceMeshManager.create_device_mesh({'data': -1})."
    )
    raise TypeError(f"{argument} must be a jax.sharding.Mesh, got {type(mesh).__name__}.{hint}")


def _take_devices(num_devices: int | None, what: str) -> list[Any]:
    """The first ``num_devices`` visible devices (all when None), validated."""
    available = jax.devices()
    if num_devices is None:
        return list(available)
    valid = isinstance(num_devices, numbers.Integral) and not isinstance(num_devices, bool)
    if not valid or num_devices < 1:
        raise ValueError(f"{what} must be a positive integer, got {num_devices!r}.")
    if num_devices > len(available):
        raise ValueError(
            f"{what}={num_devices} asks for more devices than the {len(available)} available "
            f"({available[0].platform})."
        )
    return list(available[:num_devices])


class DeviceMeshManager:
    """Manager for creating and configuring JAX device meshes.

    This class provides utilities for creating device meshes for different distributed training
    configurations, including data-parallel, model-parallel, and hybrid approaches.

    Every mesh it creates has ``AxisType.Auto`` axes unless told otherwise, whatever the default
    of :func:`jax.make_mesh` is, so that XLA infers the shardings that the parameters and inputs
    do not fix (for example the gradient all-reduce of a batch-sharded step).
    """

    @staticmethod
    def create_device_mesh(
        mesh_shape: MeshShape,
        devices: Sequence[Any] | None = None,
        *,
        axis_types: Sequence[AxisType] | None = None,
    ) -> Mesh:
        """Create a JAX device mesh with the specified shape.

        Every axis is ``AxisType.Auto`` unless ``axis_types`` says otherwise: the data-parallel
        helpers in :mod:`substrax.spmd` leave sharding inference to XLA. ``jax.make_mesh``
        defaults to Explicit axes in recent jax, under which a contraction over a sharded batch
        axis raises unless every such op names its ``out_sharding``.

        One axis size may be ``-1``, meaning "all the devices the other axes leave".

        Args:
          mesh_shape: The shape of the mesh, either a dict mapping axis names to sizes or a list
            of ``(name, size)`` tuples. The order is the order of the mesh axes.
          devices: The devices to use, such as a slice of ``jax.devices()``. If None, uses all
            available devices.
          axis_types: One ``AxisType`` per axis; ``Auto`` for every axis when None.

        Returns:
          A JAX device mesh.

        Raises:
          ValueError: If the mesh shape is incompatible with the number of devices, a size or
            name is invalid, ``axis_types`` does not name one type per axis, ``devices`` is
            empty or holds a device twice.
          TypeError: If ``devices`` holds something other than jax devices.
        """
        pairs = _normalize_shape(mesh_shape)
        names = [name for name, _ in pairs]
        types = _check_axis_types(axis_types, names)
        devices = _check_devices(jax.devices() if devices is None else devices)
        pairs = _resolve_inferred(pairs, len(devices))
        sizes = tuple(size for _, size in pairs)
        if math.prod(sizes) != len(devices):
            raise ValueError(
                f"mesh_shape {dict(pairs)} needs {math.prod(sizes)} devices, but "
                f"{len(devices)} were given. Use sizes whose product is {len(devices)}"
                + (
                    f", a -1 axis, or devices=jax.devices()[:{math.prod(sizes)}]."
                    if math.prod(sizes) < len(devices)
                    else f" or a -1 axis.{simulate_hint(math.prod(sizes), devices)}"
                )
            )
        return jax.make_mesh(sizes, tuple(names), axis_types=types, devices=devices)

    @staticmethod
    def create_data_parallel_mesh(num_devices: int | None = None) -> Mesh:
        """Create a data-parallel device mesh.

        The mesh has one axis, ``"data"``, over the first ``num_devices`` devices.

        Args:
          num_devices: Optional number of devices to use. If None, uses all available devices.

        Returns:
          A JAX device mesh configured for data-parallel training.

        Raises:
          ValueError: If ``num_devices`` is not positive or exceeds the available devices.
        """
        devices = _take_devices(num_devices, "num_devices")
        return DeviceMeshManager.create_device_mesh({"data": len(devices)}, devices)

    @staticmethod
    def create_model_parallel_mesh(num_devices: int) -> Mesh:
        """Create a model-parallel device mesh.

        The mesh has one axis, ``"model"``, over the first ``num_devices`` devices.

        Args:
          num_devices: Number of devices to use for model parallelism.

        Returns:
          A JAX device mesh configured for model-parallel training.

        Raises:
          ValueError: If there aren't enough devices available.
        """
        devices = _take_devices(num_devices, "num_devices")
        return DeviceMeshManager.create_device_mesh({"model": len(devices)}, devices)

    @staticmethod
    def create_hybrid_mesh(data_parallel_size: int, model_parallel_size: int) -> Mesh:
        """Create a hybrid data-parallel and model-parallel device mesh.

        The mesh has axes ``("data", "model")`` over the first
        ``data_parallel_size * model_parallel_size`` devices; ``"model"`` varies fastest, so
        model-parallel groups are neighbouring devices.

        Args:
          data_parallel_size: Number of devices to use for data parallelism.
          model_parallel_size: Number of devices to use for model parallelism.

        Returns:
          A JAX device mesh configured for hybrid parallel training.

        Raises:
          ValueError: If there aren't enough devices available.
        """
        shape = {"data": data_parallel_size, "model": model_parallel_size}
        _normalize_shape(shape)
        if -1 in shape.values():
            raise ValueError(f"create_hybrid_mesh needs explicit positive sizes, got {shape}.")
        devices = _take_devices(data_parallel_size * model_parallel_size, "total devices")
        return DeviceMeshManager.create_device_mesh(shape, devices)

    @staticmethod
    def create_multihost_mesh(
        inter_host: MeshShape,
        intra_host: MeshShape,
        *,
        axis_types: Sequence[AxisType] | None = None,
    ) -> Mesh:
        """Create a mesh whose process (host) dimension is outermost.

        ``inter_host`` axes span processes (slow links: data parallelism), ``intra_host`` axes
        span the devices of one process (fast links: model parallelism). An axis named in both
        has the product of the two sizes, the process part outermost. Each may use one ``-1``
        size. Works for any process count, including one.

        Args:
          inter_host: Axis sizes across processes; they multiply to ``jax.process_count()``.
          intra_host: Axis sizes within a process; they multiply to
            ``jax.local_device_count()``.
          axis_types: One ``AxisType`` per axis of the result (inter-host axes first, then
            new intra-host axes); Auto for every axis when None.

        Returns:
          A JAX device mesh in which each process owns whole rows of the inter-host axes.

        Raises:
          ValueError: If a shape does not match the process or local device count, or a size
            or name is invalid.
        """
        inter = _resolve_inferred(_normalize_shape(inter_host), jax.process_count())
        intra = _resolve_inferred(_normalize_shape(intra_host), jax.local_device_count())
        for what, pairs, count in (
            ("inter_host", inter, jax.process_count()),
            ("intra_host", intra, jax.local_device_count()),
        ):
            if math.prod(size for _, size in pairs) != count:
                raise ValueError(
                    f"{what} {dict(pairs)} multiplies to {math.prod(s for _, s in pairs)}, "
                    f"but there are {count} "
                    f"{'processes' if what == 'inter_host' else 'devices per process'}."
                )
        names = list(dict.fromkeys([n for n, _ in inter] + [n for n, _ in intra]))
        types = _check_axis_types(axis_types, names)
        dcn = [dict(inter).get(name, 1) for name in names]
        ici = [dict(intra).get(name, 1) for name in names]
        devices = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, jax.devices(), process_is_granule=True
        )
        return Mesh(devices, tuple(names), axis_types=types)

    @staticmethod
    def get_mesh_info(mesh: Mesh) -> dict[str, int | dict[str, int]]:
        """Get information about a device mesh.

        Args:
          mesh: The device mesh to inspect.

        Returns:
          A dictionary containing information about the mesh, including the number of devices
          and the size of each axis: ``num_devices``, ``num_axes``, ``axis_sizes`` (axis name to
          size, in mesh order), ``num_processes`` (how many processes own its devices),
          ``process_index`` (this process) and ``num_local_devices`` (its devices in the mesh).

        Raises:
          TypeError: If ``mesh`` is not a ``jax.sharding.Mesh``.
        """
        if not isinstance(mesh, Mesh):
            raise TypeError(
                f"get_mesh_info expects a jax.sharding.Mesh, got {type(mesh).__name__}."
            )
        processes = {device.process_index for device in mesh.devices.flat}
        return {
            "num_devices": int(mesh.devices.size),
            "num_axes": len(mesh.axis_names),
            "axis_sizes": {name: int(size) for name, size in mesh.shape.items()},
            "num_processes": len(processes),
            "process_index": jax.process_index(),
            "num_local_devices": sum(
                d.process_index == jax.process_index() for d in mesh.devices.flat
            ),
        }
