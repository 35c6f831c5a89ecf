"""Compile targets: TPU slices whose real compiler runs here, without their devices.

With ``libtpu`` installed (``pip install "libtpu==0.0.42.*"`` beside jax 0.10.2; the dev
requirements pin it), XLA's TPU compiler runs on a machine that has no TPU:
``jax.experimental.topologies`` describes a slice's chips, a mesh is laid over them, and
``jax.jit(...).lower(abstract inputs).compile()`` gives the program that slice would run,
with the compiler's own memory, collectives and FLOPs. No array can live on those devices, so
everything compiled for a :class:`CompileTarget` is abstract (``jax.ShapeDtypeStruct``).

Names follow Google Cloud's: ``"v5p:4x4x4"`` gives the chip grid, ``"v5p-128"`` the slice size
as Cloud names it, which counts TensorCores on v4 and v5p (two per chip: ``v5p-128`` is 64
chips, ``4x4x4``) and chips on v5e and v6e (``v5e-16`` is ``4x4``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["GENERATIONS", "CompileTarget"]


@dataclasses.dataclass(frozen=True)
class _Generation:
    """What a TPU generation's names and chips are: dimensions, cores per chip, profile."""

    dims: int
    cores_per_chip: int
    hardware: str


#: TPU generations that compile here, each with its planner profile
#: (:data:`substrax.planner.HARDWARE`).
GENERATIONS: dict[str, _Generation] = {
    "v4": _Generation(3, 2, "tpu-v4"),
    "v5p": _Generation(3, 2, "tpu-v5p"),
    "v5e": _Generation(2, 1, "tpu-v5e"),
    "v6e": _Generation(2, 1, "tpu-v6e"),
}

#: Chip grids of the slices Cloud sells, by chip count (3-D: v4, v5p; 2-D: v5e, v6e).
_GRIDS = {
    3: {8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4), 128: (4, 4, 8),
        256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16)},
    2: {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16),
        256: (16, 16)},
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CompileTarget:
    """A TPU slice to compile for: its generation and chip grid.

    Build one with :meth:`parse`. Its :meth:`devices` are the compiler's description of the
    slice's chips (no arrays can be placed on them); :meth:`make_mesh` lays a mesh over them.

    Attributes:
      generation: ``"v4"``, ``"v5p"``, ``"v5e"`` or ``"v6e"`` (:data:`GENERATIONS`).
      grid: The chips along each dimension of the slice (``(4, 4, 4)``).
    """

    generation: str
    grid: tuple[int, ...]

    @classmethod
    def parse(cls, name: str | CompileTarget) -> CompileTarget:
        """A target from its name: ``"v5p:4x4x4"`` (chip grid) or ``"v5p-128"`` (Cloud's size).

        Args:
          name: The name, or a target (returned as it is).

        Returns:
          The target.

        Raises:
          ValueError: For an unknown generation, a grid of the wrong rank, or a size Cloud
            does not sell, naming what would be valid.
        """
        if isinstance(name, CompileTarget):
            return name
        match = re.fullmatch(r"\s*(v\d+[a-z]*)\s*([:-])\s*([0-9x]+)\s*", str(name))
        if match is None or match.group(1) not in GENERATIONS:
            raise ValueError(
                f"Unknown target {name!r}: name a TPU slice as GENERATION:GRID "
                f"('v5p:4x4x4') or GENERATION-SIZE ('v5p-128'), GENERATION one of "
                f"{', '.join(GENERATIONS)}."
            )
        generation, kind, rest = match.groups()
        spec = GENERATIONS[generation]
        if kind == ":":
            grid = tuple(int(d) for d in rest.split("x") if d)
            if len(grid) != spec.dims or any(d < 1 for d in grid):
                raise ValueError(
                    f"CompileTarget {name!r}: a {generation} slice has {spec.dims} grid dimensions "
                    f"({'x'.join(['2'] * spec.dims)}), got {rest!r}."
                )
            return cls(generation, grid)
        size = int(rest)
        chips, left = divmod(size, spec.cores_per_chip)
        grids = _GRIDS[spec.dims]
        if left or chips not in grids:
            sizes = ", ".join(f"{generation}-{c * spec.cores_per_chip}" for c in grids)
            raise ValueError(
                f"CompileTarget {name!r} is not a {generation} slice Cloud names; choose one of "
                f"{sizes}, or give the chip grid ('{generation}:{'x'.join(map(str, grids[8]))}')."
            )
        return cls(generation, grids[chips])

    @property
    def name(self) -> str:
        """The grid name, ``"v5p:4x4x4"`` (what ``get_topology_desc`` takes)."""
        return f"{self.generation}:{'x'.join(map(str, self.grid))}"

    @property
    def chips(self) -> int:
        """The slice's chips: its devices, one per chip (megacore on v4 and v5p)."""
        return math.prod(self.grid)

    @property
    def platform(self) -> str:
        """The platform jax names these devices by: ``"tpu"``."""
        return "tpu"

    @property
    def hardware(self) -> Any:
        """The chip's :class:`substrax.planner.Hardware` profile (HBM, peak FLOP/s, links)."""
        from substrax.planner import HARDWARE

        return HARDWARE[GENERATIONS[self.generation].hardware]

    @property
    def memory_bytes(self) -> int:
        """HBM per chip, in bytes (the vendor's figure)."""
        return self.hardware.memory_bytes

    def devices(self) -> list[Any]:
        """The compiler's description of the slice's chips, in the topology's order.

        Returns:
          One device per chip, platform ``"tpu"``; they compile programs but hold no arrays.

        Raises:
          RuntimeError: Where the TPU compiler is not installed, saying how to install it.
        """
        return list(_topology(self.name).devices)

    def make_mesh(self, axis_sizes: Mapping[str, int]) -> Any:
        """A mesh of this slice's chips, laid out along the physical grid (Auto axes).

        Args:
          axis_sizes: ``{axis_name: size}``, outermost first; the sizes multiply to
            :attr:`chips`.

        Returns:
          The ``jax.sharding.Mesh``.

        Raises:
          ValueError: If the sizes do not multiply to the slice's chips.
        """
        sizes = {str(k): int(v) for k, v in dict(axis_sizes).items()}
        if math.prod(sizes.values()) != self.chips:
            raise ValueError(
                f"A mesh {sizes} has {math.prod(sizes.values())} devices; target {self.name} "
                f"has {self.chips} chips. Give axis sizes that multiply to {self.chips}."
            )
        import jax
        from jax.experimental import mesh_utils

        # Each mesh axis along whole torus dimensions where the sizes allow, else split ones.
        grid = mesh_utils.create_device_mesh(
            tuple(sizes.values()), self.devices(), allow_split_physical_axes=True
        )
        auto = (jax.sharding.AxisType.Auto,) * len(sizes)
        return jax.sharding.Mesh(grid, tuple(sizes), axis_types=auto)

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        """A context to compile for this slice in: jax's persistent compilation cache is off.

        jax writes a deviceless executable to its persistent cache but cannot load one back
        (the compile-only client has no devices to load it on: the read fails with ``PjRtCompiler
        must be constructed with a Client``, warns, and compiles again), so a target's programs
        are compiled without the cache. The cache is back on for what is compiled afterwards.

        Yields:
          None; compile (``jitted.lower(...).compile()``) inside.
        """
        import jax
        from jax.experimental.compilation_cache import compilation_cache

        with _UNCACHED:
            enabled = jax.config.jax_enable_compilation_cache
            compilation_cache.reset_cache()  # jax decides whether to use it once per process
            jax.config.update("jax_enable_compilation_cache", False)
            try:
                yield
            finally:
                jax.config.update("jax_enable_compilation_cache", enabled)
                compilation_cache.reset_cache()

    def __str__(self) -> str:
        return self.name


_UNCACHED = threading.Lock()  # one target compile at a time turns the global cache off


@functools.cache
def _topology(name: str) -> Any:
    """The topology description of ``name`` (cached: building it costs about a second).

    libtpu takes a lock file (``/tmp/libtpu_lockfile``) so that one process owns a host's
    TPUs; a deviceless compile owns none, so several processes may compile at once (the test
    suite's workers do): ``ALLOW_MULTIPLE_LIBTPU_LOAD`` is set unless the environment says
    otherwise.
    """
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(topology_name=name, platform="tpu")
    except (ImportError, RuntimeError) as error:  # no libtpu, or it cannot start
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise RuntimeError(
            f"Cannot start the TPU compiler for slice {name!r} ({type(error).__name__}: "
            f'{first}). It needs libtpu beside jax: pip install "libtpu==0.0.42.*" (the '
            "version jax 0.10.2 pins; make test installs it)."
        ) from error
