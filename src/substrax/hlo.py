"""Collective communication read off compiled HLO text: what XLA actually chose.

Use the text of a compiled executable (``jitted.lower(...).compile().as_text()``), which is
partitioned: every shape in it is per device. Each collective's traffic per device follows the
ring algorithm's volume, the usual way of stating collective cost: with ``n`` devices in a
group and ``B`` the bytes of the full (gathered or reduced) array,

* all-gather: ``B * (n - 1) / n`` (``B`` is the result),
* reduce-scatter: ``B * (n - 1) / n`` (``B`` is the operand: ``n`` times the result),
* all-reduce: ``2 * B * (n - 1) / n``,
* all-to-all: ``B * (n - 1) / n``,
* collective-permute: ``B`` (each device sends its buffer once).

XLA:TPU writes some reduce-scatters as a fusion (a computation named ``all-reduce-scatter``)
of an all-reduce and the slice each device keeps; those count as reduce-scatters. An
all-reduce followed by a separate slice is an all-reduce: XLA:TPU chose to reduce the whole
array (it does so for groups spanning more than one dimension of a 3-D torus).

Counts are static: an op inside a loop body is counted once, and :attr:`Collective.computation`
names the computation it sits in, so loop bodies can be told apart; :attr:`Collective.runs`
is how often it runs per execution (the product of the known trip counts of the ``while``
loops around it), and ``traffic_by_kind(..., trips=True)`` weights each op by it.

The text of a lowered program (``jitted.lower(...).as_text()``, StableHLO) is read too: there
only the collectives the program spells out appear (those of ``shard_map`` regions; XLA adds
its own when it partitions), in the dtypes the program asks for. That is how bf16 traffic is
measured on CPU, whose compiler widens bf16 collectives to f32 (accelerators run them in
bf16).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "KINDS", "Collective", "argument_bytes", "collectives", "compiled_flops",
    "conditional_branches", "dot_flops", "PLATFORMS", "loop_runs", "peak_bytes",
    "traffic_by_axes", "traffic_by_kind", "while_bodies",
]  # fmt: skip

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
"""The collective kinds, as XLA names them."""

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_SHAPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_OP = re.compile(r"=\s*(?P<result>.*?)\s(?P<kind>" + "|".join(KINDS) + r")(?P<async>-start)?\(")
#: XLA:TPU's fused reduce-scatter: an all-reduce and the slice it keeps, in one kernel.
_REDUCE_SCATTER_FUSION = "all-reduce-scatter"
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")  # unindented header


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of a compiled program.

    Attributes:
      kind: One of :data:`KINDS`.
      computation: The HLO computation that holds it (loop bodies have their own).
      result_bytes: Bytes of its result per device.
      group_size: Devices in each of its replica groups.
      traffic_bytes: Bytes it moves per device, by the ring volumes in the module docstring.
      runs: How often it runs per execution: the known trip counts of the loops around it
        multiplied (1 outside loops, and for a loop whose count XLA does not state).
      group: The devices of its first replica group (a permute: its first source and
        target), as logical ids (positions in the mesh's flattened devices); empty where
        the text does not say.
    """

    kind: str
    computation: str
    result_bytes: int
    group_size: int
    traffic_bytes: float
    runs: int = 1
    group: tuple[int, ...] = ()

    def axes(self, axis_sizes: dict[str, int]) -> tuple[str, ...] | None:
        """The mesh axes its group spans: those along which the group's devices differ.

        Args:
          axis_sizes: The program's mesh, ``{axis_name: size}`` outermost first (as
            ``dict(mesh.shape)``).

        Returns:
          The axes in mesh order, or None where the group is not known.
        """
        if not self.group:
            return None
        coords = np.array(np.unravel_index(np.array(self.group), tuple(axis_sizes.values())))
        varies = (coords != coords[:, :1]).any(axis=1)
        return tuple(name for name, moves in zip(axis_sizes, varies, strict=True) if moves)


def _shape_bytes(text: str) -> list[int]:
    sizes = []
    for dtype, dims in _SHAPE.findall(text):
        if dtype not in _DTYPE_BYTES:
            continue
        count = 1
        for dim in filter(None, dims.split(",")):
            count *= int(dim)
        sizes.append(count * _DTYPE_BYTES[dtype])
    return sizes


def _async_results(text: str) -> list[int]:
    """The result bytes of an async start's ``(operands, results[, context scalars])`` tuple.

    XLA:CPU writes ``(operand, result)``; XLA:TPU appends ``u32[]`` context values to a
    collective-permute's tuple. With several operands the results are the second half.
    """
    shapes = [(dtype, dims) for dtype, dims in _SHAPE.findall(text) if dtype in _DTYPE_BYTES]
    while shapes and not shapes[-1][1] and shapes[-1][0] in ("u32", "s32"):
        shapes.pop()
    half = shapes[len(shapes) // 2 :] if len(shapes) > 1 else shapes
    return _shape_bytes(" ".join(f"{dtype}[{dims}]" for dtype, dims in half))


def _group_size(line: str, num_devices: int) -> int:
    # the axes in braces, after the mesh and an optional device order: "mesh['a'=4,'b'=2],
    # device_ids=([2,4]T(1,0)) {'a'}"
    named = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line)
    if named:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", named.group(1)))
        size = 1
        for axis in re.findall(r"'([^']+)'", named.group(2)):
            size *= int(sizes[axis])
        return size
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if iota:
        return int(iota.group(2))
    listed = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if listed:
        return len(listed.group(1).split(","))
    return num_devices


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """The ids of an iota device list ``[dims]`` with an optional transpose ``T(perm)``."""
    shape = tuple(int(d) for d in dims.split(",") if d)
    ids = np.arange(math.prod(shape)).reshape(shape)
    if perm:
        ids = ids.transpose(tuple(int(p) for p in perm.split(",")))
    return ids.reshape(-1)


def _first_group(line: str) -> tuple[int, ...]:
    """The device ids of an op's first replica group (or a permute's first pair)."""
    listed = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if listed:
        return tuple(int(i) for i in listed.group(1).split(",") if i)
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line)
    if iota:
        groups, size = int(iota.group(1)), int(iota.group(2))
        return tuple(int(i) for i in _iota(iota.group(3), iota.group(4)).reshape(groups, size)[0])
    named = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))?"
        r"[^{]*\{([^}]*)\}",
        line,
    )
    if named:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", named.group(1)))
        shape = tuple(int(v) for v in sizes.values())
        if named.group(2):
            ids = _iota(named.group(2), named.group(3)).reshape(shape)
        else:
            ids = np.arange(math.prod(shape)).reshape(shape)
        spanned = set(re.findall(r"'([^']+)'", named.group(4)))
        index = tuple(slice(None) if a in spanned else 0 for a in sizes)
        return tuple(int(i) for i in ids[index].reshape(-1))
    pairs = re.search(r"source_target_pairs=\{\{(\d+),(\d+)\}", line)
    if pairs:
        return (int(pairs.group(1)), int(pairs.group(2)))
    return ()


def _traffic(kind: str, result_bytes: int, n: int) -> float:
    if kind == "collective-permute":
        return float(result_bytes)
    if n <= 1:
        return 0.0
    share = (n - 1) / n
    if kind == "all-reduce":
        return 2 * result_bytes * share
    if kind == "reduce-scatter":
        return result_bytes * n * share
    return result_bytes * share


def collectives(hlo_text: str, num_devices: int = 1) -> list[Collective]:
    """Every collective op in a compiled program's HLO text, or a lowered program's StableHLO.

    Args:
      hlo_text: ``compiled.as_text()`` of a partitioned program, or ``lowered.as_text()``
        (StableHLO: the program's own collectives, see the module docstring).
      num_devices: Group size to assume where an op lists no replica groups (all devices).

    Returns:
      One :class:`Collective` per op, in text order. ``*-done`` halves of asynchronous pairs
      are skipped; a ``*-start`` counts as the op.
    """
    if "stablehlo." in hlo_text:
        return _stablehlo_collectives(hlo_text, num_devices)
    runs = _computation_runs(hlo_text)
    found, computation = [], ""
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group(1)
            continue
        match = _OP.search(line)
        if match is None:
            continue
        kind = match.group("kind")
        results = _shape_bytes(match.group("result"))
        if match.group("async"):
            results = _async_results(match.group("result"))
        n = _group_size(line, num_devices)
        size = sum(results)
        if kind == "all-reduce" and computation.startswith(_REDUCE_SCATTER_FUSION):
            kind, size = "reduce-scatter", size // n  # the fusion keeps this device's slice
        found.append(
            Collective(kind, computation, size, n, _traffic(kind, size, n),
                       runs.get(computation, 1), _first_group(line))
        )  # fmt: skip
    return found


_WHILE = re.compile(r"\swhile\(.*?body=%?([\w.\-]+)")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_BOUND = re.compile(r"\bs32\[\]\S*\s+constant\((\d+)\)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def loop_runs(hlo_text: str) -> dict[str, int]:
    """How often each ``while`` body of a compiled program runs per execution.

    Args:
      hlo_text: ``compiled.as_text()`` of a program.

    Returns:
      ``{body computation: runs}``: the loop's known trip count (XLA's
      ``known_trip_count``; 1 where it states none) times the runs of the computation
      holding the loop, so nested loops multiply.
    """
    bodies = while_bodies(hlo_text)
    return {name: runs for name, runs in _computation_runs(hlo_text).items() if name in bodies}


#: How many programs' parses are kept: one program's text is read by several of this module's
#: functions in a row (``compiled_flops`` reads it twice, then ``traffic_by_axes``). The parses
#: are shared, so no caller may change them.
_PARSES_KEPT = 2


@functools.lru_cache(maxsize=_PARSES_KEPT)
def _loop_trips(hlo_text: str) -> tuple[dict[str, int], dict[str, str]]:
    """``({loop body: trips}, {computation: the computation that runs it})``.

    A loop's trips are XLA's ``known_trip_count`` where it states one (XLA:CPU does), else
    the constant its condition compares the counter with (``counter < N``, counting from 0
    as jax's scans and fori_loops do: XLA:TPU states no count), else 1. A computation called
    by another (``calls=``: a fusion, such as XLA:TPU's ``all-reduce-scatter``) is run by it,
    once per run.
    """
    parent, trips, conditions, bounds, computation = {}, {}, {}, {}, ""
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group(1)
            continue
        bound = _BOUND.search(line)
        if bound:
            bounds.setdefault(computation, []).append(int(bound.group(1)))
        loop = _WHILE.search(line)
        if loop:
            count = _TRIPS.search(line)
            parent[loop.group(1)] = computation
            trips[loop.group(1)] = int(count.group(1)) if count else None
            condition = _CONDITION.search(line)
            conditions[loop.group(1)] = condition.group(1) if condition else ""
            continue
        for called in _CALLS.findall(line):
            parent.setdefault(called, computation)
            trips.setdefault(called, 1)
    for body, count in trips.items():
        if count is None:  # one constant in the condition: its bound
            found = bounds.get(conditions[body], [])
            trips[body] = found[0] if len(found) == 1 else 1
    return trips, parent


@functools.lru_cache(maxsize=_PARSES_KEPT)
def _computation_runs(hlo_text: str) -> dict[str, int]:
    """Runs per execution of every loop body and every computation called from one."""
    trips, parent = _loop_trips(hlo_text)

    def runs(body: str, seen: frozenset = frozenset()) -> int:
        if body not in trips or body in seen:
            return 1
        return trips[body] * runs(parent[body], seen | {body})

    return {body: runs(body) for body in trips}


_STABLEHLO_OP = re.compile(
    r'"stablehlo\.(all_gather|reduce_scatter|all_reduce|all_to_all|'
    r'collective_permute)"'
)
_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]+[0-9]*[a-z0-9]*)>")


def _tensor_bytes(text: str) -> int:
    total = 0
    for dims, dtype in _TENSOR.findall(text):
        count = 1
        for dim in filter(None, dims.split("x")):
            count *= int(dim)
        total += count * _DTYPE_BYTES.get(dtype, 0)
    return total


_SDY_MESH = re.compile(r"sdy\.mesh\s+@([\w.\-]+)\s*=\s*<\[([^\]]*)\]")
_LISTED_GROUPS = re.compile(r"replica_groups = dense<.*?> : tensor<(\d+)x(\d+)xi64>")
# jax >= 0.11 names a collective's groups by the mesh axes they span
_MESH_AXES_GROUPS = re.compile(
    r"replica_groups = #stablehlo\.replica_group_mesh_axes<mesh = @([\w.\-]+), axes = \[(.*?)\]>"
)


def _stablehlo_group_size(line: str, meshes: dict[str, dict[str, int]], num_devices: int) -> int:
    """The devices in each replica group of a StableHLO collective (all where it lists none)."""
    listed = _LISTED_GROUPS.search(line)
    if listed:
        return int(listed.group(2))
    named = _MESH_AXES_GROUPS.search(line)
    if named:
        sizes = meshes.get(named.group(1), {})
        return math.prod(sizes.get(a, 1) for a in re.findall(r'name = "([^"]+)"', named.group(2)))
    return num_devices


def _stablehlo_collectives(text: str, num_devices: int) -> list[Collective]:
    """Collectives of StableHLO text: the result type ends the op's line or its region."""
    meshes = {
        name: {a: int(n) for a, n in re.findall(r'"([^"]+)"=(\d+)', axes)}
        for name, axes in _SDY_MESH.findall(text)
    }
    found, pending, computation = [], None, ""
    for line in text.splitlines():
        header = re.match(r"\s*func\.func\s+(?:\w+\s+)?@([\w.\-]+)", line)
        if header:
            computation = header.group(1)
        match = _STABLEHLO_OP.search(line)
        if match:
            size = _stablehlo_group_size(line, meshes, num_devices)
            pending = (match.group(1).replace("_", "-"), size)
        if pending is not None and ") -> " in line:
            kind, size = pending
            result = _tensor_bytes(line.rsplit(") -> ", 1)[1])
            found.append(Collective(kind, computation, result, size, _traffic(kind, result, size)))
            pending = None
    return found


def traffic_by_kind(
    hlo_text: str, num_devices: int = 1, *, trips: bool = False
) -> dict[str, dict[str, float]]:
    """Count and traffic per device of each collective kind.

    Args:
      hlo_text: ``compiled.as_text()`` of a partitioned program, or ``lowered.as_text()``.
      num_devices: Group size to assume where an op lists no replica groups.
      trips: Count each op as often as it runs (:attr:`Collective.runs`: a pipeline's
        permutes once per tick), not once per appearance in the text.

    Returns:
      ``{kind: {"count": int, "bytes": float}}`` for every kind in :data:`KINDS`.
    """
    table = {kind: {"count": 0, "bytes": 0.0} for kind in KINDS}
    for op in collectives(hlo_text, num_devices):
        times = op.runs if trips else 1
        table[op.kind]["count"] += times
        table[op.kind]["bytes"] += op.traffic_bytes * times
    return table


def traffic_by_axes(
    hlo_text: str, axis_sizes: dict[str, int], *, trips: bool = False
) -> dict[tuple[str, tuple[str, ...] | None], dict[str, float]]:
    """Count and traffic per device of each collective kind over each set of mesh axes.

    Args:
      hlo_text: ``compiled.as_text()`` of a partitioned program.
      axis_sizes: Its mesh, ``{axis_name: size}`` outermost first (``dict(mesh.shape)``).
      trips: Count each op as often as it runs (see :func:`traffic_by_kind`).

    Returns:
      ``{(kind, axes): {"count": int, "bytes": float}}``, ``axes`` the mesh axes the op's
      groups span (:meth:`Collective.axes`; None where the text does not say), sorted by
      kind then axes.
    """
    table: dict[tuple[str, tuple[str, ...] | None], dict[str, float]] = {}
    for op in collectives(hlo_text, math.prod(axis_sizes.values())):
        times = op.runs if trips else 1
        row = table.setdefault((op.kind, op.axes(axis_sizes)), {"count": 0, "bytes": 0.0})
        row["count"] += times
        row["bytes"] += op.traffic_bytes * times
    order = {kind: i for i, kind in enumerate(KINDS)}
    return dict(sorted(table.items(), key=lambda item: (order[item[0][0]], str(item[0][1]))))


def while_bodies(hlo_text: str) -> set[str]:
    """Names of the computations that are bodies of ``while`` loops (``scan``, ``fori_loop``).

    Args:
      hlo_text: ``compiled.as_text()`` of a program.

    Returns:
      The body computations' names, to compare with :attr:`Collective.computation`.
    """
    return set(_WHILE.findall(hlo_text))


def conditional_branches(hlo_text: str) -> set[str]:
    """Names of the computations that are branches of ``conditional`` ops (``lax.cond``).

    Args:
      hlo_text: ``compiled.as_text()`` of a program.

    Returns:
      The branch computations' names, to compare with :attr:`Collective.computation`.
    """
    return {name for listed in _BRANCHES.findall(hlo_text) for name in _branch_names(listed)}


def _branch_names(listed: str) -> list[str]:
    """The computations a ``branch_computations={...}`` attribute lists, in its order."""
    return [name.strip().lstrip("%") for name in listed.split(",")]


def argument_bytes(hlo_text: str) -> int:
    """The bytes of a compiled program's arguments per device, as their shapes state them.

    ``memory_analysis().argument_size_in_bytes`` counts each argument in its device layout:
    XLA:TPU pads the last two dimensions to whole tiles (``f32[8,64]{1,0:T(8,128)}`` takes
    as much as ``f32[8,128]``), which for small shards can be several times the data. This
    counts the shapes alone, what a plan's bytes per device are.

    Args:
      hlo_text: ``compiled.as_text()`` of a partitioned program.

    Returns:
      The bytes of the entry computation's parameters, unpadded.

    Raises:
      ValueError: If the text has no ``entry_computation_layout``.
    """
    start = hlo_text.find("entry_computation_layout={(")
    if start < 0:
        raise ValueError("The text has no entry_computation_layout: pass compiled.as_text().")
    end = hlo_text.find(")->", start)
    return sum(_shape_bytes(hlo_text[start:end]))


#: The compilers :func:`peak_bytes` knows, by the platform name jax gives them.
PLATFORMS = ("cpu", "gpu", "tpu")


def peak_bytes(memory: Any, platform: str) -> int:
    """A compiled program's peak bytes per device: what it allocates, from its memory analysis.

    XLA:CPU and XLA:GPU allocate the program's temporaries as one block of
    ``temp_size_in_bytes``: the peak is the arguments and outputs, less the outputs that reuse
    donated arguments' buffers, plus the temporaries. XLA:TPU allocates its buffer assignment,
    whose size is its heap peak, ``peak_memory_in_bytes`` (arguments and temporaries live at
    once), and checks that against the chip's HBM. Its ``temp_size_in_bytes`` is larger for
    scanned, rematerialised programs and is not allocated: XLA:TPU compiles a program whose
    arguments and ``temp_size_in_bytes`` exceed the chip's HBM by a sixth, where its heap
    peak fits (``tests/test_target.py``). Where it keeps temporaries in the host's memory
    (remat ``"offload"``) and those are the larger, its heap peak is theirs (arguments + host
    temporaries), so the peak falls back to the stated temporaries, which exceed what it
    allocates (Llama 3 8B on FSDP 32: 21.34 GiB stated, 10.96 GiB in its buffer assignment).

    Args:
      memory: ``compiled.memory_analysis()``.
      platform: The compiler's platform, one of :data:`PLATFORMS` (``jax.devices()[0].platform``,
        or ``"tpu"`` for a program compiled for a TPU topology).

    Returns:
      The bytes.

    Raises:
      ValueError: If ``platform`` is not one of :data:`PLATFORMS`.
    """
    if platform not in PLATFORMS:
        raise ValueError(f"Unknown platform {platform!r}; choose one of {', '.join(PLATFORMS)}")
    outside = memory.argument_size_in_bytes + memory.output_size_in_bytes
    outside -= memory.alias_size_in_bytes
    if platform == "tpu":
        heap, host = memory.peak_memory_in_bytes, memory.host_temp_size_in_bytes
        if not (host and heap - memory.argument_size_in_bytes <= host):
            return int(max(heap, outside))
    return int(outside + memory.temp_size_in_bytes)


_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\((?:[^()]|\([^()]*\))*\)|[a-z]+[0-9]*[a-z0-9]*"
    r"\[[0-9,]*\](?:\{[^}]*\})?)\s+(?P<op>[\w\-]+)\((?P<operands>[^)]*)\)(?P<attrs>.*)$"
)
_PARAM = re.compile(r"([\w.\-]+):\s*([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_CALLED = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_BODY = re.compile(r"body=%?([\w.\-]+)")
_CONDITION = re.compile(r"condition=%?([\w.\-]+)")
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
# XLA:GPU rewrites a dot as a cuBLAS call; its dimensions are in the call's backend config.
_KERNEL_FLOPS = re.compile(r'"cost_estimate":\{"flops":"(\d+)"')
_GEMM = re.compile(r'custom_call_target="__cublas\$(?:gemm|lt\$matmul)[^"]*"')
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


@functools.lru_cache(maxsize=_PARSES_KEPT)
def _parse(hlo_text: str) -> tuple[dict[str, list], str]:
    """``({computation: [(op, result dims, operand dims, attrs)]}, entry name)``."""
    computations: dict[str, list] = {}
    entry, shapes, current = "", {}, None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header.group(1), [])
            entry = header.group(1) if line.startswith("ENTRY") else entry
            shapes = {name: _dims(dims) for name, _, dims in _PARAM.findall(line)}
            continue
        found = _INSTRUCTION.match(line)
        if current is None or not found:
            continue
        shape = _SHAPE.match(found.group("shape").lstrip("("))  # a tuple's first element
        result = _dims(shape.group(2)) if shape else []
        shapes[found.group("name")] = result
        operands = [
            shapes.get(o.strip().lstrip("%"), []) for o in found.group("operands").split(",")
        ]
        current.append((found.group("op"), result, operands, found.group("attrs")))
    return computations, entry


def _matmul_flops(result: list[int], operands: list, contracting: str) -> float:
    """``2 x`` a matrix product's multiply-adds: its output's elements times the contracted size."""
    lhs = operands[0] if operands else []
    size = math.prod(lhs[d] if d < len(lhs) else 1 for d in _dims(contracting))
    return 2.0 * math.prod(result) * size


def _convolution_flops(result: list[int], operands: list, attrs: str) -> float:
    """``2 x`` a convolution's multiply-adds: each output element over its kernel's live taps.

    XLA:TPU writes matrix products as convolutions (``dim_labels=...->...``), batched ones
    with their batch dimensions as spatial windows that padding or input dilation leave one
    live tap each: every output element sums the kernel's ``i`` inputs at each tap of its
    window that lands on an input element (not on padding or a dilation hole).
    """
    labels = _DIM_LABELS.search(attrs)
    if not labels or len(operands) < 2:
        return 0.0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    lhs, rhs = operands[0], operands[1]
    if len(lhs) != len(lhs_labels) or len(rhs) != len(rhs_labels) or len(result) != len(out_labels):
        return 0.0
    window = _window(attrs)
    flops = 2.0 * rhs[rhs_labels.index("i")]
    for label, size in zip(out_labels, result, strict=True):
        if not label.isdigit():
            flops *= size  # batch and output features
            continue
        k = int(label)
        spec = window[k] if k < len(window) else {}
        flops *= _live_taps(size, lhs[lhs_labels.index(label)], rhs[rhs_labels.index(label)], spec)
    return flops


def _window(attrs: str) -> list[dict[str, tuple[int, ...]]]:
    """A convolution's window, one dict per spatial dimension (``size``, ``stride``, ...)."""
    found = re.search(r"window=\{([^}]*)\}", attrs)
    if not found:
        return []
    fields = dict(item.split("=", 1) for item in found.group(1).split() if "=" in item)
    rank = len(fields.get("size", "").split("x")) if "size" in fields else 0
    dims = [{} for _ in range(rank)]
    for key, value in fields.items():
        for k, part in enumerate(value.split("x")[:rank]):
            dims[k][key] = tuple(int(v) for v in part.split("_"))
    return dims


def _live_taps(out: int, size: int, taps: int, spec: dict[str, tuple[int, ...]]) -> int:
    """How many (output position, kernel tap) pairs of one spatial dimension read an input."""
    stride = spec.get("stride", (1,))[0]
    low = spec.get("pad", (0, 0))[0]
    dilate, rhs_dilate = spec.get("lhs_dilate", (1,))[0], spec.get("rhs_dilate", (1,))[0]
    span = (size - 1) * dilate + 1
    if out * taps > 10**7:  # a long spatial dimension: every tap (an upper bound)
        return out * taps
    live = 0
    for o in range(out):
        for w in range(taps):
            p = o * stride + w * rhs_dilate - low
            live += 0 <= p < span and p % dilate == 0
    return live


def compiled_flops(compiled: Any, hlo_text: str | None = None) -> float:
    """A compiled program's FLOPs per device, each loop counted as often as it runs.

    XLA's ``cost_analysis()`` counts a ``while`` body once (a scanned model's layers, a
    pipeline's ticks, the blocks of a grouped product) and, on XLA:GPU, no product handed to
    cuBLAS; the matrix products it missed (:func:`dot_flops`) are added to it.

    Args:
      compiled: ``jitted.lower(...).compile()``.
      hlo_text: Its ``as_text()``, where the caller has it already (printing a large
        program's text takes as long as parsing it); None asks ``compiled`` for it.

    Returns:
      The FLOPs of one execution on one device.
    """
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    text = compiled.as_text() if hlo_text is None else hlo_text
    counted = dot_flops(text, trips=False, library_calls=False)  # what cost_analysis saw
    return float(cost.get("flops", 0.0)) + dot_flops(text) - counted


def dot_flops(
    hlo_text: str,
    *,
    branch: Callable[..., float] = max,
    trips: bool = True,
    library_calls: bool = True,
) -> float:
    """The matrix-product FLOPs of one execution of a compiled program, per device.

    XLA's ``cost_analysis()`` counts a ``while`` body once; this counts each ``dot`` (and each
    ``convolution``, XLA:TPU's form of a matrix product, each TPU kernel by the FLOPs its
    ``cost_estimate`` gives, such as ``ragged_dot``'s grouped kernel, and each cuBLAS call,
    XLA:GPU's) as
    often as its loops run (their
    ``known_trip_count``, or their condition's bound), and of a ``conditional`` its costliest
    branch: a static bound on what any device computes, exact where every device takes a
    branch of the same cost (a pipeline tick with work). Elementwise work is not counted.

    Args:
      hlo_text: ``compiled.as_text()`` of a program.
      branch: How a ``conditional``'s branches combine: ``max`` (the most a device can
        compute), ``min`` (the least: a pipeline's idle ticks).
      trips: Count each loop's body as often as it runs; False counts it once, as
        ``cost_analysis()`` does (the difference is what that misses).
      library_calls: Count the products XLA:GPU hands to cuBLAS; False counts only what
        ``cost_analysis()`` sees (it counts no custom call).

    Returns:
      ``2 x`` the multiply-adds of the program's ``dot`` ops.
    """
    computations, entry = _parse(hlo_text)
    loops, _ = _loop_trips(hlo_text)
    memo: dict[str, float] = {}

    def cost(name: str) -> float:
        if name not in memo:
            memo[name] = 0.0  # a cycle (none in valid HLO) counts nothing
            memo[name] = sum(one(*item) for item in computations.get(name, []))
        return memo[name]

    def one(op, result, operands, attrs) -> float:
        if op == "dot":
            contracting = _CONTRACTING.search(attrs)
            return _matmul_flops(result, operands, contracting.group(1) if contracting else "")
        if op == "custom-call" and (kernel := _KERNEL_FLOPS.search(attrs)):
            return float(kernel.group(1))  # a TPU kernel's own estimate (cost_analysis's too)
        if op == "custom-call" and library_calls and _GEMM.search(attrs):
            contracting = _GEMM_CONTRACTING.search(attrs)
            dims = ",".join(re.findall(r"\d+", contracting.group(1))) if contracting else ""
            return _matmul_flops(result, operands, dims)
        if op == "convolution":
            return _convolution_flops(result, operands, attrs)
        if op == "while":
            body, condition = _BODY.search(attrs), _CONDITION.search(attrs)
            inner = cost(body.group(1)) + (cost(condition.group(1)) if condition else 0.0)
            return (loops.get(body.group(1), 1) if trips else 1) * inner
        if op == "conditional":
            branches = _BRANCHES.search(attrs)
            names = _branch_names(branches.group(1)) if branches else []
            return branch([cost(b) for b in names]) if names else 0.0
        called = _CALLED.findall(attrs)
        return sum(cost(c) for c in called)

    return cost(entry)
