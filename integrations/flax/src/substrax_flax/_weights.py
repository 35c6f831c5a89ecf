"""Pretrained weights in and out: safetensors checkpoints read into a plan's shardings, and back.

:func:`plan_weights` matches a checkpoint's tensor names to a model's variables through a key
map and checks every shape and dtype before a byte is read; :func:`load_weights` then creates
the model with each array made from the slices its devices hold (each process reads only
those), running no initialiser for a loaded variable. :func:`save_weights` writes a model
back in the checkpoint's names and layouts, one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from substrax.distributed import progress
from substrax_flax._create import plan_model
from substrax_flax._plan import LayoutLike, ModelPlan
from substrax_flax._rearrange import Lazy, Pattern, Source, Stack, Take, arrange, lazy_arrange
from substrax_flax._rearrange import normalize as normalize_index
from substrax_flax._resolve import Rules, Strategy
from substrax_flax._safetensors import Checkpoint, parse_size, write_checkpoint
from substrax_flax._state import map_variables, values_by_path, variables

__all__ = [
    "KeyMap",
    "Target",
    "WeightsMismatch",
    "WeightsPlan",
    "load_weights",
    "plan_weights",
    "save_tensors",
    "save_weights",
]

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes in the model, and how it is rearranged on the way.

    Attributes:
      path: The model variable, ``/`` or ``.`` separated (``"blocks/attn/q/kernel"``); it may
        use the key's placeholders (``"blocks/{i}/attn/q/kernel"``). A placeholder of the key
        that the path lacks stacks the tensors along a new leading dimension, in the
        placeholder's order (per-layer tensors into an ``nnx.scan`` / ``nnx.vmap`` stack).
      pattern: A rearrangement from the file's axes to the model's, in einops' notation:
        ``"o i -> i o"`` transposes a ``[out, in]`` matrix, ``"(h d) e -> e h d"`` also
        splits the heads (None: as stored).
      sizes: Sizes of the pattern's axes that the shape cannot tell (``{"h": 32}``).
      take: ``(axis, start, stop)``: the slice of the file tensor this variable holds, for a
        fused tensor (a ``qkv`` projection) split over several variables.
    """

    path: str
    pattern: str | None = None
    sizes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    take: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise TypeError(f"Target.path must be a variable's path, got {self.path!r}.")
        object.__setattr__(self, "path", self.path.replace(".", "/"))
        if self.pattern is not None:
            Pattern.parse(self.pattern, self.sizes)  # raises now, naming the pattern
        if self.take is not None and (len(self.take) != 3 or self.take[1] >= self.take[2]):
            raise ValueError(
                f"take must be (axis, start, stop) with start < stop, got {self.take}."
            )

    @property
    def parsed(self) -> Pattern | None:
        """The parsed pattern (None without one)."""
        return None if self.pattern is None else Pattern.parse(self.pattern, self.sizes)


#: A key map: checkpoint tensor names (with ``{i}``-style placeholders for layer numbers) to
#: a variable path, a :class:`Target`, several Targets (a fused tensor), or None (ignore
#: it); or a function of a tensor's name returning one of those.
KeyMap = (
    Mapping[str, str | Target | Sequence[Target] | None]
    | Callable[[str], str | Target | Sequence[Target] | None]
    | None
)


class WeightsMismatch(ValueError):
    """A checkpoint and a model disagree: every problem, listed at once, before any read."""


def _targets(value: Any, key: str = "") -> list[Target]:
    if value is None:
        return []
    if isinstance(value, str):
        return [Target(value)]
    if isinstance(value, Target):
        return [value]
    if isinstance(value, Sequence) and all(isinstance(t, Target) for t in value):
        return list(value)
    entry = f"A key map entry {key!r}" if key else "A key map entry"
    raise TypeError(
        f"{entry} is a variable path, a Target, a list of Targets or None; got {value!r}."
    )


def _check_key_map(key_map: Any) -> None:
    """Raises for a key map that is not a table of valid entries or a function.

    Raises:
      TypeError: Naming the entry.
    """
    if callable(key_map) and not isinstance(key_map, Mapping):
        return
    if not isinstance(key_map, Mapping):
        raise TypeError(
            f"key_map must be a table {{checkpoint name: variable path or Target}}, a function "
            f"of the name, or None; got {type(key_map).__name__}."
        )
    for key, value in key_map.items():
        if not isinstance(key, str):
            raise TypeError(f"Key map names are strings, got {key!r}.")
        _targets(value, key)


def _compile(key: str) -> re.Pattern:
    parts = _PLACEHOLDER.split(key)
    pattern = "".join(
        re.escape(part) if k % 2 == 0 else f"(?P<{part}>[0-9]+)" for k, part in enumerate(parts)
    )
    return re.compile(pattern)


@dataclasses.dataclass(frozen=True)
class _Match:
    name: str  # the file tensor
    target: Target
    path: str  # the model variable
    layer: int | None  # its place in a stack


def _match(key_map: KeyMap, name: str) -> tuple[list[_Match], bool]:
    """The model places of file tensor ``name``, and whether the key map knows it at all."""
    if callable(key_map) and not isinstance(key_map, Mapping):
        return [_Match(name, t, t.path, None) for t in _targets(key_map(name))], True
    for key, value in key_map.items():
        found = _compile(key).fullmatch(name)
        if found is None:
            continue
        bound = {k: int(v) for k, v in found.groupdict().items()}
        matches = []
        for target in _targets(value):
            used = set(_PLACEHOLDER.findall(target.path))
            stacked = [k for k in bound if k not in used]
            path = target.path.format(**bound)
            layer = bound[stacked[0]] if stacked else None
            matches.append(_Match(name, target, path, layer))
        return matches, True
    return [], False


def _lazy(checkpoint: Checkpoint, match: _Match) -> Lazy:
    name = match.name
    out: Lazy = Source(name, checkpoint.shape(name), checkpoint.dtype(name), checkpoint.read)
    if match.target.take is not None:
        out = Take(out, *match.target.take)
    if match.target.pattern is not None:
        out = lazy_arrange(out, match.target.parsed)
    return out


def _identity(paths: Sequence[str]) -> dict[str, str]:
    return {path.replace("/", "."): path for path in paths}


def _is_weight(variable: Any) -> bool:
    """Variables a checkpoint must hold: parameters, not LoRA adapters (new by nature)."""
    return isinstance(variable, nnx.Param) and not isinstance(variable, nnx.LoRAParam)


class WeightsPlan:
    """What :func:`load_weights` will do, decided before anything is read.

    Attributes:
      model: The :class:`ModelPlan` (shardings of every variable).
      checkpoint: The checkpoint.
      sources: ``{variable path: lazy array}`` of each variable read from the checkpoint.
      initialised: Variables that keep their initialisers (not in the checkpoint: LoRA
        adapters, random streams, those ``allow_missing`` names).
      ignored: Checkpoint tensors the key map maps to None.
      problems: Every mismatch, one line each (empty when the load can run).
      dtype: The dtype loaded variables are stored in (None: the checkpoint's).
    """

    def __init__(
        self,
        model: ModelPlan,
        checkpoint: Checkpoint,
        sources: dict[str, Lazy],
        initialised: Sequence[str],
        ignored: Sequence[str],
        problems: Sequence[str],
        dtype: Any,
    ):
        """Holds what :func:`plan_weights` decided; use that function rather than this.

        Args:
          model: The :class:`ModelPlan`.
          checkpoint: The checkpoint (its headers read, no tensor).
          sources: ``{variable path: lazy array}``.
          initialised: Paths that keep their initialisers.
          ignored: Checkpoint tensors the key map ignores.
          problems: Every mismatch found.
          dtype: The dtype loaded variables are stored in, or None.
        """
        self.model, self.checkpoint, self.sources = model, checkpoint, sources
        self.initialised, self.ignored = tuple(initialised), tuple(ignored)
        self.problems, self.dtype = tuple(problems), dtype

    def __str__(self) -> str:
        files = len(self.checkpoint.files)
        stored = f", stored as {jnp.dtype(self.dtype).name}" if self.dtype is not None else ""
        lines = [
            f"{len(self.sources)} variables from {self.checkpoint.source} "
            f"({self.checkpoint.nbytes / 2**20:.2f} MiB in {files} file{'s' * (files > 1)})"
            + stored,
            f"{len(self.initialised)} keep their initialisers"
            + (f": {', '.join(self.initialised)}" if self.initialised else ""),
        ]
        if self.ignored:
            lines.append(f"{len(self.ignored)} tensors ignored: {', '.join(self.ignored)}")
        lines += [f"converted: {line}" for line in self.conversions]
        lines += [f"problem: {p}" for p in self.problems]
        return "\n".join(lines)

    @property
    def conversions(self) -> list[str]:
        """Each dtype conversion that ``dtype=`` asked for, one line per source dtype.

        Each line gives how many tensors, from and to, and whether it rounds (a narrower
        float).
        """
        if self.dtype is None:
            return []
        to = jnp.dtype(self.dtype)
        counts: dict[Any, int] = {}
        for lazy in self.sources.values():
            if jnp.dtype(lazy.dtype) != to:
                counts[jnp.dtype(lazy.dtype)] = counts.get(jnp.dtype(lazy.dtype), 0) + 1
        return [
            f"{n} tensor(s) {source.name} -> {to.name}"
            + (" (narrower: rounded)" if to.itemsize < source.itemsize else "")
            for source, n in counts.items()
        ]

    def check(self) -> None:
        """Raises if the checkpoint does not fit the model.

        Raises:
          WeightsMismatch: Listing every problem, if there are any.
        """
        if self.problems:
            raise WeightsMismatch(
                f"The checkpoint at {self.checkpoint.source} does not fit the model "
                f"({len(self.problems)} problems; nothing was read):\n  "
                + "\n  ".join(self.problems)
            )

    def load(self) -> nnx.Module:
        """Creates the model with the checkpoint's values in the planned shardings.

        Each array is made from the slices its process's devices hold
        (``jax.make_array_from_callback``): a process reads only those bytes. Variables in
        :attr:`initialised` come from one jitted init that computes only them.

        Returns:
          The model, which remembers its plan (an optimizer and the steps use it).

        Raises:
          WeightsMismatch: If there are :attr:`problems`.
        """
        self.check()
        shardings = values_by_path(self.model.shardings)
        dtypes = {row.path: jnp.dtype(row.dtype) for row in self.model.rows}
        values = {}
        for path, lazy in self.sources.items():
            values[path] = _make_array(lazy, shardings[path], dtypes[path])
        return self.model.create_with(values)


def _make_array(lazy: Lazy, sharding: Any, dtype: Any) -> jax.Array:
    """The array of ``lazy`` in ``sharding``, one distinct slice on the host at a time.

    Each slice is read once, put on every device that holds it, and dropped.
    """
    by_slice: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(lazy.shape).items():
        index = normalize_index(index, lazy.shape)
        by_slice.setdefault(tuple((s.start, s.stop) for s in index), []).append(device)
    shards = []
    for key, devices in by_slice.items():
        data = np.asarray(lazy.read(tuple(slice(*k) for k in key))).astype(dtype, copy=False)
        shards += [jax.device_put(data, device) for device in devices]
        jax.block_until_ready(shards[-1])
        del data
    return jax.make_array_from_single_device_arrays(lazy.shape, sharding, shards)


def _sources(checkpoint, key_map, template, problems):
    """``{path: [matches]}`` for every file tensor, noting unknown and ignored tensors."""
    placed: dict[str, list[_Match]] = {}
    ignored, unexpected = [], []
    for name in checkpoint.names:
        try:
            matches, known = _match(key_map, name)
        except (TypeError, ValueError, KeyError, IndexError) as error:
            problems.append(f"tensor {name!r}: the key map fails on it ({error})")
            continue
        if not known:
            unexpected.append(name)
        elif not matches:
            ignored.append(name)
        for match in matches:
            placed.setdefault(match.path, []).append(match)
    if unexpected:
        problems.append(
            f"{len(unexpected)} checkpoint tensors the key map does not name (map them, or to "
            f"None to ignore them): {', '.join(unexpected)}"
        )
    unknown = sorted(set(placed) - set(template))
    for path in unknown:
        names = ", ".join(m.name for m in placed.pop(path)[:3])
        problems.append(f"{names} -> {path!r}: the model has no such variable")
    return placed, ignored


def _assemble(checkpoint, path, matches, shape, problems) -> Lazy | None:
    """One variable's lazy array from its matches, or None (with the problem noted)."""
    layers = [m.layer for m in matches]
    try:
        if all(layer is None for layer in layers):
            if len(matches) > 1:
                names = ", ".join(m.name for m in matches)
                problems.append(f"{path!r} is given by several tensors: {names}")
                return None
            return _lazy(checkpoint, matches[0])
        if any(layer is None for layer in layers) or len(set(layers)) != len(layers):
            problems.append(f"{path!r}: its tensors do not number its layers once each")
            return None
        count = shape[0] if shape else 0
        if sorted(layers) != list(range(count)):
            problems.append(
                f"{path!r} stacks {count} layers; the checkpoint has layers "
                f"{sorted(layers)[:8]}{' ...' if len(layers) > 8 else ''}"
            )
            return None
        by_layer = sorted(matches, key=lambda m: m.layer)
        return Stack([_lazy(checkpoint, m) for m in by_layer])
    except ValueError as error:
        problems.append(f"{matches[0].name} -> {path!r}: {error}")
        return None


def plan_weights(
    factory: Callable[[], nnx.Module],
    mesh: jax.sharding.Mesh | None = None,
    source: str | os.PathLike | None = None,
    rules: Rules = None,
    *,
    layout: LayoutLike = None,
    strategy: Strategy = None,
    key_map: KeyMap = None,
    dtype: Any = None,
    allow_missing: Sequence[str] = (),
    strict: bool = False,
) -> WeightsPlan:
    """Matches a safetensors checkpoint to the model ``factory`` builds; reads no tensor.

    Args:
      factory: A function of no arguments that builds the model (run abstractly only).
      mesh: The device mesh (as :func:`create_sharded_model`).
      source: A ``.safetensors`` file, a directory of them, or a directory with
        ``model.safetensors.index.json`` (a sharded checkpoint).
      rules: As :func:`create_sharded_model`.
      layout: As :func:`create_sharded_model`.
      strategy: As :func:`create_sharded_model`.
      key_map: Checkpoint names to model variables (see :data:`KeyMap` and :class:`Target`);
        None: each variable's path with ``.`` for ``/`` (what :func:`save_weights` writes
        without a key map).
      dtype: Store the loaded floating variables in this dtype, converting the checkpoint's
        floats (None: the checkpoint's dtype must be the model's). Each conversion is listed
        (:attr:`WeightsPlan.conversions`, narrowing ones marked); integer variables keep
        their dtype, and an integer tensor into a float variable is a problem.
      allow_missing: Regular expressions of parameter paths that may be absent from the
        checkpoint (a new head): they keep their initialisers. LoRA adapters and variables
        other than parameters always do.
      strict: A tensor holding NaN or inf is an error when read (False: a
        :class:`NonFiniteWeightsWarning` naming it, and it is loaded as it is).

    Returns:
      The :class:`WeightsPlan`; ``print`` it, or ``.load()`` it.

    Raises:
      FileNotFoundError: If ``source`` holds no checkpoint.
      TypeError: For a key map entry of the wrong type.
    """
    if source is None:
        raise TypeError("plan_weights needs source=: a .safetensors file or a directory of them.")
    if key_map is not None:
        _check_key_map(key_map)
    checkpoint = Checkpoint(source, strict=strict)
    plan = plan_model(factory, mesh, rules, layout=layout, strategy=strategy)
    template = dict(variables(plan._template))
    if key_map is None:
        key_map = _identity([p for p, v in template.items() if isinstance(v, nnx.Param)])
    problems: list[str] = []
    placed, ignored = _sources(checkpoint, key_map, template, problems)
    if dtype is not None and placed:
        plan = plan_model(_cast(factory, set(placed), dtype), mesh, rules, layout=layout,
                          strategy=strategy)  # fmt: skip
    rows = {row.path: row for row in plan.rows}
    sources = {}
    for path, matches in placed.items():
        lazy = _assemble(checkpoint, path, matches, rows[path].shape, problems)
        if lazy is None:
            continue
        row, names = rows[path], ", ".join(m.name for m in matches[:2])
        if lazy.shape != row.shape:
            problems.append(
                f"{names}{' ...' if len(matches) > 2 else ''} -> {path!r}: shape {lazy.shape} "
                f"(from the checkpoint's {checkpoint.shape(matches[0].name)}), the model's "
                f"is {row.shape}"
            )
        elif dtype is None and jnp.dtype(lazy.dtype) != jnp.dtype(row.dtype):
            problems.append(
                f"{names} -> {path!r}: dtype {jnp.dtype(lazy.dtype).name}, the model's is "
                f"{row.dtype} (pass dtype= to convert)"
            )
        elif dtype is not None and _kind(lazy.dtype) != _kind(row.dtype):
            problems.append(
                f"{names} -> {path!r}: dtype {jnp.dtype(lazy.dtype).name} into a "
                f"{jnp.dtype(row.dtype).name} variable: dtype= converts between floating "
                "dtypes only; store the variable as the checkpoint does, or cast it after "
                "loading"
            )
        else:
            sources[path] = lazy
    allowed = [re.compile(p) for p in allow_missing]
    missing = [
        p
        for p, v in template.items()
        if _is_weight(v) and p not in placed and not any(a.fullmatch(p) for a in allowed)
    ]
    if missing:
        problems.append(
            f"{len(missing)} model parameters are not in the checkpoint (map them, or pass "
            f"allow_missing= to keep their initialisers): {', '.join(missing)}"
        )
    initialised = [p for p in template if p not in placed]
    return WeightsPlan(plan, checkpoint, sources, initialised, ignored, problems, dtype)


def _kind(dtype: Any) -> str:
    """``"float"`` for floating dtypes (bfloat16 included), else numpy's kind letter."""
    dtype = jnp.dtype(dtype)
    return "float" if jnp.issubdtype(dtype, jnp.floating) else dtype.kind


def _cast(factory: Callable[[], nnx.Module], paths: set[str], dtype: Any) -> Callable:
    def cast():
        model = factory()
        state = nnx.state(model)

        def value(path, v):  # a Variable, or a bare array kept with nnx.data
            array = v.get_value() if hasattr(v, "get_value") else v
            floating = jnp.issubdtype(array.dtype, jnp.floating)  # integer ids keep theirs
            return array.astype(dtype) if path in paths and floating else array

        cast_state = map_variables(value, state)
        nnx.update(model, cast_state)
        return model

    return cast


def load_weights(
    factory: Callable[[], nnx.Module],
    mesh: jax.sharding.Mesh | None = None,
    source: str | os.PathLike | None = None,
    rules: Rules = None,
    *,
    layout: LayoutLike = None,
    strategy: Strategy = None,
    key_map: KeyMap = None,
    dtype: Any = None,
    allow_missing: Sequence[str] = (),
    strict: bool = False,
) -> nnx.Module:
    """Creates the model ``factory`` builds, sharded, with its parameters from a checkpoint.

    The model is planned abstractly (no initialiser runs for a loaded variable), every
    checkpoint tensor is matched and checked first (:func:`plan_weights`: missing and
    unexpected tensors, shapes and dtypes, all reported in one :class:`WeightsMismatch`),
    then each array is made from the slices its process's devices hold, read straight from
    the memory-mapped files. Host memory holds one variable's slices at a time.

    Args:
      factory: A function of no arguments that builds the model.
      mesh: The device mesh.
      source: A ``.safetensors`` file, a directory of them, or a sharded checkpoint's
        directory.
      rules: As :func:`create_sharded_model`.
      layout: As :func:`create_sharded_model`.
      strategy: As :func:`create_sharded_model`.
      key_map: See :func:`plan_weights`.
      dtype: See :func:`plan_weights`.
      allow_missing: See :func:`plan_weights`.
      strict: See :func:`plan_weights`.

    Returns:
      The model, which remembers its plan (like :func:`create_sharded_model`'s).

    Raises:
      WeightsMismatch: Listing every problem, before anything is read.
      ValueError: Under ``strict``, naming a tensor that holds NaN or inf.
    """
    progress(f"loading weights from {source}", busy=True)  # for the launcher: no known length
    return plan_weights(
        factory, mesh, source, rules, layout=layout, strategy=strategy, key_map=key_map,
        dtype=dtype, allow_missing=allow_missing, strict=strict,
    ).load()  # fmt: skip


def _host(array: jax.Array) -> np.ndarray:
    """The whole of ``array`` on this host (every process takes part in a multi-process run)."""
    if jax.process_count() == 1:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def _exports(key_map: Mapping, params: dict[str, Any]) -> list[tuple[str, list[_Match]]]:
    """``(file name, [parts])`` of every tensor to write, in key map order, then layer order."""
    out = []
    for key, value in key_map.items():
        targets = _targets(value)
        if not targets:
            continue
        keys = set(_PLACEHOLDER.findall(key))
        bindings = _bindings(key, targets, keys, params)
        for bound in bindings:
            name = key.format(**bound)
            parts = []
            for target in targets:
                used = set(_PLACEHOLDER.findall(target.path))
                stacked = [k for k in keys if k not in used]
                path = target.path.format(**{k: bound[k] for k in used})
                parts.append(_Match(name, target, path, bound[stacked[0]] if stacked else None))
            out.append((name, parts))
    return out


def _bindings(key: str, targets: list[Target], keys: set[str], params: dict) -> list[dict]:
    """Every assignment of the key's placeholders that the model's variables give."""
    if not keys:
        return [{}]
    target = targets[0]
    used = set(_PLACEHOLDER.findall(target.path))
    stacked = [k for k in keys if k not in used]
    if len(stacked) > 1:
        raise ValueError(f"Key {key!r}: only one placeholder may stack layers, not {stacked}.")
    found = set()
    regex = _compile(target.path)
    for path in params:
        hit = regex.fullmatch(path)
        if hit is not None:
            found.add(tuple(sorted((k, int(v)) for k, v in hit.groupdict().items())))
    out = []
    for combo in sorted(found):
        bound = dict(combo)
        if stacked:
            layers = np.shape(params[target.path.format(**bound)])[0]
            out += [{**bound, stacked[0]: i} for i in range(layers)]
        else:
            out.append(bound)
    return out


def _file_tensor(parts: list[_Match], get: Callable[[str], np.ndarray]) -> np.ndarray:
    """The file's tensor from the model's variables: the inverse of each part's Target."""
    pieces = []
    for part in parts:
        array = get(part.path)
        if part.layer is not None:
            array = array[part.layer]
        if part.target.pattern is not None:
            array = arrange(array, part.target.parsed.inverse())
        pieces.append((part.target.take, array))
    if len(pieces) == 1 and pieces[0][0] is None:
        return pieces[0][1]
    if any(take is None for take, _ in pieces):
        raise ValueError(f"{parts[0].name!r}: several variables write it, not all with take=.")
    axis = pieces[0][0][0]
    pieces.sort(key=lambda p: p[0][1])
    stops = [0] + [take[2] for take, _ in pieces]
    if [take[1] for take, _ in pieces] != stops[:-1]:
        raise ValueError(f"{parts[0].name!r}: the takes {[t for t, _ in pieces]} leave gaps.")
    return np.concatenate([array for _, array in pieces], axis=axis)


def save_weights(
    model: nnx.Module,
    directory: str | os.PathLike,
    *,
    key_map: Mapping[str, Any] | None = None,
    shard_size: int | str = "2GB",
    dtype: Any = None,
    leave_out: Sequence[str] = (),
) -> list[pathlib.Path]:
    """Writes a model's parameters as a safetensors checkpoint, in the key map's names.

    Each checkpoint tensor is made from the model's variables by inverting its
    :class:`Target` (the pattern's sides swapped, takes concatenated, stacks split per layer)
    and written as soon as it is made, so a host holds one variable at a time, never the
    whole model. In a multi-process run every process takes part in gathering each variable
    and process 0 writes. ``load_weights(factory, ..., source=directory, key_map=key_map)``
    reads it back bit for bit, onto any layout.

    Args:
      model: The model.
      directory: Where to write ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors``
        and ``model.safetensors.index.json`` when it exceeds ``shard_size``).
      key_map: A table as :func:`load_weights` takes (a function cannot be inverted); None:
        each parameter under its path with ``.`` for ``/``.
      shard_size: The largest file, in bytes or as ``"2GB"``, ``"500MB"``.
      dtype: Write tensors in this dtype (None: the model's).
      leave_out: Regular expressions of parameter paths not to write (such as LoRA adapters
        before merging); every other parameter must be in the key map.

    Returns:
      The files written (on processes other than 0: those process 0 writes).

    Raises:
      ValueError: If a parameter is neither written nor left out, or a key map entry names
        a variable the model lacks.
      TypeError: If ``key_map`` is a function.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"save_weights expects an nnx.Module, got {type(model).__name__}.")
    if callable(key_map) and not isinstance(key_map, Mapping):
        raise TypeError("save_weights needs a key map table (a function cannot be inverted).")
    if key_map is not None:
        _check_key_map(key_map)
    limit = parse_size(shard_size)
    state = dict(variables(nnx.state(model)))
    params = {p: v.get_value() if hasattr(v, "get_value") else v for p, v in state.items()}
    weights = [p for p, v in state.items() if isinstance(v, nnx.Param)]
    key_map = _identity(weights) if key_map is None else key_map
    exports = _exports(key_map, params)
    written = {part.path for _, parts in exports for part in parts}
    unknown = sorted(written - set(params))
    if unknown:
        raise ValueError(f"The key map names variables the model lacks: {unknown}.")
    left = [re.compile(p) for p in leave_out]
    unsaved = [p for p in weights if p not in written and not any(r.fullmatch(p) for r in left)]
    if unsaved:
        raise ValueError(
            f"These parameters are in no key map entry, so they would not be saved: {unsaved}. "
            "Map them, or pass leave_out= (LoRA adapters: merge them into the base first)."
        )
    entries = []
    for name, parts in exports:
        shape = _file_shape(parts, params)
        out = np.dtype(dtype) if dtype is not None else np.dtype(params[parts[0].path].dtype)
        entries.append((name, out, shape))
    tensors = _tensors(exports, params, [dt for _, dt, _ in entries])
    if jax.process_index() != 0:
        for _ in tensors:  # every process takes part in each gather
            pass
        directory = pathlib.Path(directory)
        return [directory / "model.safetensors"]
    return write_checkpoint(directory, entries, tensors, shard_size=limit)


def _file_shape(parts: list[_Match], params: dict[str, Any]) -> tuple[int, ...]:
    """The shape :func:`_file_tensor` makes, from the variables' shapes alone."""
    shapes = []
    for part in parts:
        shape = tuple(np.shape(params[part.path]))[(part.layer is not None) :]
        if part.target.pattern is not None:
            shape = part.target.parsed.inverse().out_shape(shape)
        shapes.append((part.target.take, shape))
    if len(shapes) == 1 and shapes[0][0] is None:
        return shapes[0][1]
    axis = shapes[0][0][0] if shapes[0][0] is not None else 0
    merged = list(shapes[0][1])
    merged[axis] = sum(shape[axis] for _, shape in shapes)
    return tuple(merged)


def _tensors(exports, params, dtypes) -> Iterator[np.ndarray]:
    """Each file tensor in turn, one model variable on the host at a time."""
    held: dict[str, np.ndarray] = {}

    def get(path):
        if path not in held:
            held.clear()
            held[path] = _host(params[path])
        return held[path]

    for (_, parts), dt in zip(exports, dtypes, strict=True):
        yield np.asarray(_file_tensor(parts, get)).astype(dt, copy=False)


def save_tensors(
    directory: str | os.PathLike,
    tensors: Mapping[str, np.ndarray],
    *,
    shard_size: int | str = "2GB",
) -> list[pathlib.Path]:
    """Writes host arrays as a safetensors checkpoint (one file, or files and an index).

    For checkpoints made outside a model: converted weights, or test fixtures in a published
    model's format. Files are named as :func:`save_weights` names them.

    Args:
      directory: Where to write.
      tensors: Name -> array (numpy, including ``ml_dtypes.bfloat16``), in the order written.
      shard_size: The largest file, in bytes or as ``"2GB"``.

    Returns:
      The files written.
    """
    arrays = {name: np.asarray(value) for name, value in tensors.items()}
    entries = [(name, array.dtype, array.shape) for name, array in arrays.items()]
    return write_checkpoint(directory, entries, arrays.values(), shard_size=parse_size(shard_size))
