"""Named layouts: what each mesh axis does, and everything that follows from it.

A :class:`Layout` gives each mesh axis one role: ``pipe`` (pipeline stages), ``data`` (replicas:
the batch is split, parameters are whole), ``fsdp`` (the batch is split and parameters are
sharded on ``embed``), ``context`` (the sequence, logical name ``seq``, is split: context
parallelism; parameters are sharded on ``embed`` over it too, as over FSDP axes), ``expert``
(the batch is split and the experts of mixture-of-experts layers, logical name ``expert``, are
sharded: expert parallelism; the other parameters are sharded on ``embed`` over it, as over FSDP
axes) or ``tensor`` (``heads``, ``kv_heads``, ``mlp`` and ``vocab`` are
split). From the roles follow the parameter rules, the compute rules (what a parameter looks
like where it is used: gathered over the FSDP and context axes), the batch axes and the
strategy for variables without annotations. The library's named layouts (:data:`LAYOUTS`), the
planner's candidates and configs built from :class:`~substrax.mesh.ShardingConfig` are all
layouts.

A new kind of parallelism is a new role here (a role, its logical names, and its entry in
:data:`LAYOUTS`), not a new mechanism. ZeRO is not a role but a degree of what the replica axes
shard (:attr:`Layout.zero`): the optimizer state (1), and the gradients too (2); the parameters
stay whole on them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from substrax.mesh._config import ParallelismConfig, ShardingConfig
from substrax.mesh._resolve import as_axes, spec_entry
from substrax.mesh._rules import MeshRules

if TYPE_CHECKING:  # the planner's layouts need no jax: imported where a mesh or strategy is made
    from jax.sharding import Mesh

    from substrax.mesh import FSDPStrategy, MultiDimensionalStrategy, TensorParallelStrategy

__all__ = ["LAYOUTS", "ROLES", "Layout"]

#: The named layouts :meth:`Layout.named` builds.
LAYOUTS = (
    "dp", "fsdp", "hsdp", "tp", "fsdp+tp", "pp", "zero1", "zero2", "zero1+tp", "zero2+tp",
    "cp", "fsdp+cp", "ep", "fsdp+ep",
)  # fmt: skip

#: The roles a mesh axis can have, outermost first.
ROLES = ("pipe", "data", "fsdp", "expert", "context", "tensor")

#: Logical names that each role's axes shard (``data``, ``fsdp`` and ``expert`` also split
#: ``batch``).
_ROLE_NAMES = {
    "pipe": ("layers",),
    "fsdp": ("embed",),
    "expert": ("expert",),
    "context": ("seq",),
    "tensor": ("heads", "kv_heads", "mlp", "vocab"),
}
#: Logical names every layout knows, replicated unless a role shards them.
_NAMES = (
    "data", "batch", "seq", "embed", "mlp", "heads", "kv_heads", "kv", "vocab", "layers", "expert",
)  # fmt: skip

#: Mesh axis names of :meth:`Layout.from_degrees` (the planner's meshes), outermost first.
_DEGREE_AXES = {
    "pipe": "pipe", "data": "data", "fsdp": "fsdp", "expert": "expert", "context": "context",
    "tensor": "model",
}  # fmt: skip
#: The short names of the roles in labels and layout names.
_SHORT = {"pipe": "pp", "data": "dp", "fsdp": "fsdp", "expert": "ep", "context": "cp",
          "tensor": "tp"}  # fmt: skip


def _shape_of(mesh: Mesh | Mapping[str, int]) -> dict[str, int]:
    if isinstance(mesh, Mapping):
        return {str(name): int(size) for name, size in mesh.items()}
    if hasattr(mesh, "axis_names") and hasattr(mesh, "shape"):
        return {name: int(size) for name, size in dict(mesh.shape).items()}
    raise TypeError(f"Expected a Mesh or a mapping of axis names to sizes, got {mesh!r}.")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh's axes, the role of each, and the rules and strategy that follow.

    Build one with :meth:`named`, :meth:`from_config` or :meth:`from_degrees`.

    Attributes:
      axis_names: The mesh axes, outermost first.
      axis_sizes: Their sizes.
      pipe_axes: Axes of pipeline stages (``layers`` is split over them).
      data_axes: Replica axes: the batch is split over them, parameters are whole.
      fsdp_axes: FSDP axes: the batch is split, and parameters are sharded on ``embed``; a step
        gathers them where they are used and reduces their gradients back to shards.
      expert_axes: Expert-parallel axes: the batch is split, and the ``expert`` dimension of
        mixture-of-experts weights is sharded; tokens reach their experts with ``all_to_all``
        (:func:`substrax.spmd.experts`). The other parameters and their optimizer state are
        sharded on ``embed`` over them too, as over FSDP axes (gathered where used,
        gradients reduced back to shards); an expert weight keeps them on its ``expert``
        dimension, the first that asks.
      context_axes: Context-parallel axes: the sequence (``seq``) of the batch and of
        activations is split, in :func:`~substrax.spmd.zigzag` order. Parameters and their
        optimizer state are sharded on ``embed`` over them too, as over FSDP axes (gathered
        where used, gradients reduced back to shards), as torchtitan's FSDP spans its
        context axis. Attention runs through :func:`substrax.spmd.attention`.
      tensor_axes: Tensor-parallel axes: ``heads``, ``kv_heads``, ``mlp`` and ``vocab`` are split.
      fsdp_min_weight_size: The smallest first dimension of an unannotated variable that the
        FSDP axes shard, as ``ShardingConfig.fsdp_min_weight_size`` and
        ``FSDPStrategy(min_weight_size=)`` mean it (0: any).
      fsdp_min_elements: The fewest elements of an unannotated variable that the FSDP axes
        shard (smaller ones, such as norm scales, stay replicated).
      zero: What the replica axes shard besides the batch (ZeRO's stages): 0 nothing, 1 the
        optimizer state, 2 the optimizer state and the gradients. Parameters stay whole on
        them; a step reduce-scatters the gradients, updates its shard and all-gathers the new
        parameters.
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    pipe_axes: tuple[str, ...] = ()
    data_axes: tuple[str, ...] = ()
    fsdp_axes: tuple[str, ...] = ()
    expert_axes: tuple[str, ...] = ()
    context_axes: tuple[str, ...] = ()
    tensor_axes: tuple[str, ...] = ()
    fsdp_min_weight_size: int = 0
    fsdp_min_elements: int = 256
    zero: int = 0

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2) or isinstance(self.zero, bool):
            raise ValueError(f"zero must be 0, 1 or 2 (ZeRO's stages), got {self.zero!r}.")
        for field in ("axis_names", "axis_sizes", *(f"{r}_axes" for r in ROLES)):
            value = getattr(self, field)
            object.__setattr__(self, field, as_axes(value))
        if len(self.axis_names) != len(self.axis_sizes) or not self.axis_names:
            raise ValueError(
                f"A layout needs one size per mesh axis, got axis_names {self.axis_names} and "
                f"axis_sizes {self.axis_sizes}."
            )
        if any(not isinstance(s, int) or s < 1 for s in self.axis_sizes):
            raise ValueError(f"Mesh axis sizes must be positive integers, got {self.axis_sizes}.")
        seen: dict[str, str] = {}
        for role in ROLES:
            for axis in self.axes_of(role):
                if axis not in self.axis_names:
                    raise ValueError(
                        f"Role {role!r} names mesh axis {axis!r}, which the mesh lacks; mesh "
                        f"axes: {self.axis_names}."
                    )
                if axis in seen:
                    raise ValueError(
                        f"Mesh axis {axis!r} has two roles, {seen[axis]!r} and {role!r}; give "
                        "each axis one role."
                    )
                seen[axis] = role
        idle = [a for a, s in self.shape.items() if s > 1 and a not in seen]
        if idle:
            raise ValueError(
                f"Mesh axis {idle[0]!r} of size {self.shape[idle[0]]} has no role; give it one "
                f"of {ROLES}."
            )

    # --- constructors -----------------------------------------------------------------------

    @classmethod
    def named(cls, name: str, mesh: Mesh | Mapping[str, int]) -> Layout:
        """One of the library's named layouts on ``mesh``.

        * ``dp``: every axis is a replica axis (parameters replicated, batch split).
        * ``fsdp``: every axis is an FSDP axis (parameters sharded on ``embed`` over all).
        * ``hsdp``: FSDP on the ``model`` axis, replicas over the others.
        * ``tp``: tensor parallelism on the ``model`` axis, replicas over the others.
        * ``fsdp+tp``: tensor parallelism on the ``model`` axis, FSDP over the others.
        * ``pp``: pipeline stages on the ``pipe`` axis, replicas over the others.
        * ``zero1`` / ``zero2``: ``dp`` with the optimizer state (and for ``zero2`` the
          gradients) sharded over the replicas; ``zero1+tp`` / ``zero2+tp``: the same on
          ``tp``'s replica axes.
        * ``cp`` / ``fsdp+cp``: context parallelism on the ``context`` axis (the sequence is
          split), replicas / FSDP over the others.
        * ``ep`` / ``fsdp+ep``: expert parallelism on the ``expert`` axis (experts sharded,
          tokens dispatched with ``all_to_all``), replicas / FSDP over the others.

        A mesh without a ``model`` (``context``, ``expert``) axis uses its innermost axis for
        it (neighbouring devices: the fast links these roles want); one without a ``pipe`` axis
        uses its outermost for ``pipe``.

        Args:
          name: One of :data:`LAYOUTS`.
          mesh: A ``Mesh`` or ``{axis_name: size}``, outermost axis first.

        Returns:
          The layout.

        Raises:
          ValueError: For an unknown name, or a layout that needs two axes on a mesh of one.
          TypeError: If ``mesh`` is neither a mesh nor a mapping.
        """
        if name not in LAYOUTS:
            raise ValueError(f"Unknown layout {name!r}; choose one of {', '.join(LAYOUTS)}.")
        shape = _shape_of(mesh)
        names = tuple(shape)
        zero, name = (int(name[4]), name[6:] or "dp") if name.startswith("zero") else (0, name)
        if name in ("hsdp", "fsdp+tp", "pp", "cp", "fsdp+cp", "fsdp+ep") and len(names) < 2:
            raise ValueError(
                f"Layout {name!r} needs a mesh of at least two axes (its roles differ); the "
                f"mesh has {shape}."
            )

        def inner(axis: str) -> str:  # the named axis, else the innermost
            return axis if axis in names else names[-1]

        def besides(axis: str) -> tuple[str, ...]:
            return tuple(a for a in names if a != axis)

        model, context, expert = inner("model"), inner("context"), inner("expert")
        pipe = "pipe" if "pipe" in names else names[0]
        roles = {
            "dp": {"data": names},
            "fsdp": {"fsdp": names},
            "hsdp": {"fsdp": (model,), "data": besides(model)},
            "tp": {"tensor": (model,), "data": besides(model)},
            "fsdp+tp": {"tensor": (model,), "fsdp": besides(model)},
            "pp": {"pipe": (pipe,), "data": besides(pipe)},
            "cp": {"context": (context,), "data": besides(context)},
            "fsdp+cp": {"context": (context,), "fsdp": besides(context)},
            "ep": {"expert": (expert,), "data": besides(expert)},
            "fsdp+ep": {"expert": (expert,), "fsdp": besides(expert)},
        }[name]
        axes = {f"{r}_axes": a for r, a in roles.items()}
        return cls(names, tuple(shape.values()), **axes, zero=zero)

    @classmethod
    def from_degrees(
        cls,
        *,
        pp: int = 1,
        dp: int = 1,
        fsdp: int = 1,
        ep: int = 1,
        cp: int = 1,
        tp: int = 1,
        zero: int = 0,
    ) -> Layout:
        """A layout of the given degrees, on axes named after the roles (``model`` for tensor).

        The axes are ``pipe``, ``data``, ``fsdp``, ``expert``, ``context``, ``model``. Axes of
        size 1 are left out (one device: a ``data`` axis of size 1). The planner's
        candidates are built this way.

        Args:
          pp: Pipeline stages.
          dp: Replicas.
          fsdp: FSDP degree.
          ep: Expert-parallel degree.
          cp: Context-parallel degree.
          tp: Tensor-parallel degree.
          zero: ZeRO's stage over the replicas (see :attr:`zero`).

        Returns:
          The layout.

        Raises:
          ValueError: If a degree is not a positive integer, or ``zero`` not 0, 1 or 2.
        """
        degrees = {"pipe": pp, "data": dp, "fsdp": fsdp, "expert": ep, "context": cp, "tensor": tp}
        for role, degree in degrees.items():
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise ValueError(f"The {role} degree must be a positive integer, got {degree!r}.")
        used = {role: degree for role, degree in degrees.items() if degree > 1} or {"data": 1}
        axes = tuple(_DEGREE_AXES[role] for role in used)
        roles = {f"{role}_axes": (_DEGREE_AXES[role],) for role in used}
        return cls(axes, tuple(used.values()), **roles, zero=zero)

    @classmethod
    def from_config(cls, config: ShardingConfig | ParallelismConfig) -> Layout:
        """The layout a :class:`~substrax.mesh.ShardingConfig` or ``ParallelismConfig`` describes.

        The mesh is the config's (``pipe``, ``data``, ``model`` for a ``ShardingConfig``): the
        ``pipe`` axis holds stages, ``model`` is tensor parallel, and ``data`` is an FSDP axis
        when ``fsdp_enabled`` and a replica axis otherwise.

        Args:
          config: The configuration.

        Returns:
          The layout.

        Raises:
          ValueError: If the config is not valid (``ParallelismConfig.is_valid``) or names an
            axis other than ``pipe``, ``data`` and ``model``.
          TypeError: For anything else.
        """
        if isinstance(config, ShardingConfig):
            config = ParallelismConfig.from_sharding_config(config)
        if not isinstance(config, ParallelismConfig):
            raise TypeError(
                f"Expected a ShardingConfig or ParallelismConfig, got {type(config).__name__}."
            )
        if not config.is_valid():
            raise ValueError(f"{config!r} is not valid: its mesh does not realise its config.")
        sharding = config.sharding_config
        data_role = "fsdp" if sharding.fsdp_enabled else "data"
        by_name = {"pipe": "pipe", "data": data_role, "model": "tensor"}
        unknown = [a for a in config.mesh_axis_names if a not in by_name]
        if unknown:
            raise ValueError(
                f"Mesh axis {unknown[0]!r} of {config.mesh_axis_names} has no role in a config "
                f"layout; name the axes from {tuple(by_name)}."
            )
        roles: dict[str, tuple[str, ...]] = {}
        for axis in config.mesh_axis_names:
            roles[by_name[axis]] = (*roles.get(by_name[axis], ()), axis)
        roles = {f"{role}_axes": axes for role, axes in roles.items()}
        return cls(config.mesh_axis_names, config.mesh_shape, **roles,
                   fsdp_min_weight_size=sharding.fsdp_min_weight_size)  # fmt: skip

    # --- what follows from the roles --------------------------------------------------------

    @property
    def shape(self) -> dict[str, int]:
        """``{axis_name: size}``, outermost first (as ``Mesh.shape``)."""
        return dict(zip(self.axis_names, self.axis_sizes, strict=True))

    def axes_of(self, role: str) -> tuple[str, ...]:
        """The mesh axes of a role.

        Args:
          role: One of :data:`ROLES`.

        Returns:
          The axes, outermost first.

        Raises:
          ValueError: For an unknown role.
        """
        if role not in ROLES:
            raise ValueError(f"Unknown role {role!r}; choose one of {ROLES}.")
        return getattr(self, f"{role}_axes")

    @functools.cached_property
    def _degrees(self) -> dict[str, int]:
        """Each role's degree, computed once (the planner asks for them many times)."""
        sizes = self.shape
        degrees = {role: math.prod(sizes[a] for a in self.axes_of(role)) for role in ROLES}
        degrees["batch"] = math.prod(sizes[a] for a in self.batch_axes)
        return degrees

    def _degree(self, role: str) -> int:
        return self._degrees[role]

    @property
    def pp(self) -> int:
        """Pipeline stages."""
        return self._degree("pipe")

    @property
    def dp(self) -> int:
        """Replicas (data parallelism without parameter sharding)."""
        return self._degree("data")

    @property
    def fsdp(self) -> int:
        """The FSDP degree (devices each parameter's ``embed`` is split over)."""
        return self._degree("fsdp")

    @property
    def ep(self) -> int:
        """The expert-parallel degree."""
        return self._degree("expert")

    @property
    def cp(self) -> int:
        """The context-parallel degree (devices the sequence is split over)."""
        return self._degree("context")

    @property
    def tp(self) -> int:
        """The tensor-parallel degree."""
        return self._degree("tensor")

    @property
    def devices(self) -> int:
        """The device count."""
        return math.prod(self.axis_sizes)

    def _active(self, role: str) -> bool:
        return self._degree(role) > 1

    @property
    def name(self) -> str:
        """The kind of layout: ``dp``, ``fsdp``, ``hsdp``, ``tp``, ``fsdp+tp``, ``pp``, ...

        Roles of size 1 do not count; combinations join with ``+`` (``pp+fsdp+tp``,
        ``fsdp+cp``).
        """
        parts = ["pp"] if self._active("pipe") else []
        inner = [_SHORT[r] for r in ("expert", "context", "tensor") if self._active(r)]
        if self._active("fsdp"):
            parts.append("hsdp" if self._active("data") else "fsdp")
        elif self.zero and self._active("data"):
            parts.append(f"zero{self.zero}")
        elif self._active("data") and not inner and not parts:
            parts.append("dp")
        return "+".join(parts + inner) or "dp"

    @property
    def label(self) -> str:
        """Degrees such as ``"fsdp 512 x tp 8"`` (``"single device"`` for one)."""
        degrees = [(f"zero{self.zero} dp" if r == "data" and self.zero else _SHORT[r],
                    self._degree(r)) for r in ROLES]  # fmt: skip
        return " x ".join(f"{k} {v}" for k, v in degrees if v > 1) or "single device"

    @property
    def optimizer_axes(self) -> tuple[str, ...]:
        """The axes the optimizer state is sharded over on top of its parameter's spec.

        The replica (data) axes with ``zero`` >= 1, else none.
        """
        return self.data_axes if self.zero else ()

    def optimizer_spec(self, spec: Any, shape: Sequence[int]) -> tuple[Any, str | None]:
        """A parameter's spec with :attr:`optimizer_axes` added, for its optimizer state.

        The axes go on the largest dimension that no mesh axis shards yet and that they
        divide (a step that splits the batch over them reduce-scatters each gradient along it,
        which must not interleave with another axis); the spec is returned unchanged when there
        is none.

        Args:
          spec: The parameter's ``PartitionSpec``, or its entries as a tuple.
          shape: Its shape.

        Returns:
          ``(spec, why)``: the new spec (of ``spec``'s type), and why it is the parameter's own
          (no dimension divides) or None.
        """
        axes = tuple(a for a in self.optimizer_axes if self.shape[a] > 1)
        if not axes:
            return spec, None
        size = math.prod(self.shape[a] for a in axes)
        entries = list(spec) + [None] * (len(shape) - len(spec))

        fits = [d for d, n in enumerate(shape) if entries[d] is None and n % size == 0]
        if not fits:
            return spec, (
                f"no unsharded dimension of {tuple(shape)} (spec {spec}) divides by the {size} "
                f"replicas of {axes}: the optimizer state stays as the parameter's"
            )
        dim = max(fits, key=lambda d: shape[d])
        entries[dim] = spec_entry(axes)
        return (tuple(entries) if isinstance(spec, tuple) else type(spec)(*entries)), None

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch's leading dimension is split over: replica, FSDP, expert."""
        split = self.data_axes + self.fsdp_axes + self.expert_axes
        return tuple(a for a in self.axis_names if a in split)

    @property
    def batch_degree(self) -> int:
        """The devices the batch's rows are split over (the product of :attr:`batch_axes`)."""
        return self._degrees["batch"]

    @property
    def gather_axes(self) -> tuple[str, ...]:
        """The axes every parameter is whole on where it is used: replica, FSDP and context.

        A step gathers the parameters sharded over them and reduces every gradient over them;
        substrax's manual data-parallel step makes the batch's among them manual. Expert axes
        split the batch too, but an expert's weights stay on their devices and the tokens
        travel.
        """
        split = self.data_axes + self.fsdp_axes + self.context_axes
        return tuple(a for a in self.axis_names if a in split)

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """The axes that shard every parameter on ``embed``: FSDP, expert and context axes.

        A mesh axis shards one dimension of an array, the first that asks for it: an expert
        weight (``expert``, ``embed``, ...) keeps the expert axes on its ``expert`` dimension.
        """
        split = self.fsdp_axes + self.expert_axes + self.context_axes
        return tuple(a for a in self.axis_names if a in split)

    @property
    def param_rules(self) -> MeshRules:
        """How parameters are stored, as rules.

        ``embed`` over the FSDP and context axes, ``heads``, ``kv_heads``, ``mlp`` and
        ``vocab`` over the tensor axes, ``layers`` over the stage axes, ``expert`` over the
        expert axes, ``seq`` over the context axes, ``data`` and ``batch`` over the batch
        axes; ``kv`` (head width) replicated.
        """
        table: dict[str, tuple[str, ...]] = {name: () for name in _NAMES}
        for role, names in _ROLE_NAMES.items():
            table.update((name, self.axes_of(role)) for name in names)
        table["data"] = table["batch"] = self.batch_axes
        table["embed"] = self.shard_axes
        return MeshRules().extend(**{k: spec_entry(v) for k, v in table.items()})

    @property
    def compute_rules(self) -> MeshRules:
        """How parameters and activations look where they are used, as rules.

        The parameter rules gathered over :attr:`gather_axes` and the expert axes
        (:meth:`~substrax.mesh.MeshRules.gathered_over`), so a step gathers each parameter once;
        the sequence (``seq``) stays split over the context axes and ``expert`` over the expert
        axes (an expert is computed where it is stored), as the batch over its axes.
        """
        gathered = self.param_rules.gathered_over(self.gather_axes + self.expert_axes)
        return gathered.extend(
            seq=spec_entry(self.context_axes), expert=spec_entry(self.expert_axes)
        )

    def strategy(self) -> FSDPStrategy | TensorParallelStrategy | MultiDimensionalStrategy | None:
        """The strategy for variables without logical names.

        FSDP axes shard each variable's largest dimension they divide
        (:class:`~substrax.mesh.FSDPStrategy` with ``shard="largest"``, for variables of at
        least ``fsdp_min_elements`` elements and a first dimension of at least
        ``fsdp_min_weight_size``), tensor axes split layers as
        :class:`~substrax.mesh.TensorParallelStrategy` does; both merge into a
        :class:`~substrax.mesh.MultiDimensionalStrategy`. Context and expert axes shard as FSDP
        axes do; replica and stage axes shard no unannotated variable.

        Returns:
          The strategy, or None when no axis shards parameters.
        """
        from substrax.mesh import FSDPStrategy, MultiDimensionalStrategy, TensorParallelStrategy

        index = {a: i for i, a in enumerate(self.axis_names)}
        parts: dict[str, Any] = {}
        for axis in self.shard_axes:
            parts[f"fsdp/{axis}"] = FSDPStrategy(
                axis,
                index[axis],
                self.fsdp_min_weight_size,
                shard="largest",
                min_elements=self.fsdp_min_elements,
            )
        for axis in self.tensor_axes:
            parts[f"tensor/{axis}"] = TensorParallelStrategy(axis, index[axis])
        if not parts:
            return None
        if len(parts) == 1:
            return next(iter(parts.values()))
        config = ParallelismConfig(self.axis_sizes, self.axis_names, self.sharding_config())
        return MultiDimensionalStrategy(parts, config)

    def sharding_config(self) -> ShardingConfig:
        """The layout's degrees as a :class:`~substrax.mesh.ShardingConfig`.

        Returns:
          ``data_parallel_size`` = replicas x FSDP x expert x context degrees (the config
          has no roles of its own for the last two), ``fsdp_enabled`` when FSDP > 1.
        """
        return ShardingConfig(
            data_parallel_size=self.dp * self.fsdp * self.ep * self.cp,
            tensor_parallel_size=self.tp,
            pipeline_parallel_size=self.pp,
            fsdp_enabled=self.fsdp > 1,
            fsdp_min_weight_size=self.fsdp_min_weight_size,
        )

    def make_mesh(self, devices: Sequence[Any] | None = None) -> Mesh:
        """A device mesh of this layout's shape (Auto axes).

        Args:
          devices: The devices; the first ``devices`` count of ``jax.devices()`` when None.

        Returns:
          The mesh.

        Raises:
          ValueError: If there are not enough devices.
        """
        import jax

        from substrax.mesh._devices import DeviceMeshManager, simulate_hint

        if devices is None:
            available = jax.devices()
            if len(available) < self.devices:
                raise ValueError(
                    f"Layout {self.label} needs {self.devices} devices; {len(available)} are "
                    "visible." + simulate_hint(self.devices, available)
                )
            devices = available[: self.devices]
        return DeviceMeshManager.create_device_mesh(self.shape, devices)

    def check_mesh(self, mesh: Mesh) -> None:
        """Checks that ``mesh`` has this layout's axes and sizes.

        Args:
          mesh: The mesh.

        Raises:
          ValueError: If the axes or sizes differ.
        """
        if _shape_of(mesh) != self.shape:
            raise ValueError(
                f"The mesh {_shape_of(mesh)} is not the layout's {self.shape} ({self.name})."
            )

    def __str__(self) -> str:
        roles = ", ".join(f"{r}={self.axes_of(r)}" for r in ROLES if self.axes_of(r))
        return f"Layout {self.name} on {self.shape} ({roles})"
