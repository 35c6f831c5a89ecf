"""compile_for: a model's sharded init and training step compiled for a TPU slice it is not on.

The real TPU compiler runs here without a TPU (:mod:`substrax.target`): the model is planned
for a mesh over the slice's chips, made abstract (:meth:`ModelPlan.abstract_model`), given an
abstract optimizer, and its init and step are lowered and compiled for the slice. What the
compiler reports (memory per chip, collectives, FLOPs) is what that slice would run.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from substrax.hlo import argument_bytes, compiled_flops, peak_bytes, traffic_by_axes
from substrax.layout import Layout
from substrax.target import CompileTarget
from substrax_flax._create import plan_model
from substrax_flax._jitted import JittedStep
from substrax_flax._optimizer import create_sharded_optimizer
from substrax_flax._plan import LayoutLike, ModelPlan
from substrax_flax._report import sharding_report
from substrax_flax._step_plan import StepPlan
from substrax_flax._train import make_train_step

__all__ = ["CompileRefused", "ProgramMemory", "TargetReport", "compile_for"]

_MIB = 2**20
#: Layouts :func:`compile_for` lays out on one mesh axis when no ``axis_sizes`` are given.
_ONE_AXIS = ("dp", "fsdp", "zero1", "zero2")


class CompileRefused(ValueError):
    """The target's compiler refused a program (out of memory, a program it cannot partition).

    Its message names the layout, the program (``"sharded init"`` or ``"training step"``), the
    compiler's first line and the step's decisions that led there.

    Attributes:
      layout: The layout's label.
      program: Which program was refused.
      compiler: The compiler's first line (``RESOURCE_EXHAUSTED: Ran out of memory ...``).
    """

    def __init__(self, message: str, layout: str, program: str, compiler: str):
        """Records what was refused beside the message.

        Args:
          message: The full message (layout, program, compiler's words, step's decisions).
          layout: The layout's label.
          program: ``"sharded init"`` or ``"training step"``.
          compiler: The compiler's first line.
        """
        super().__init__(message)
        self.layout, self.program, self.compiler = layout, program, compiler


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """A compiled program's bytes per device, as the compiler states them.

    Attributes:
      arguments: Its inputs, in the device's layouts (XLA:TPU pads the last two dimensions
        of each to whole tiles).
      argument_data: Its inputs as their shapes state them, unpadded
        (:func:`substrax.hlo.argument_bytes`): what a plan's bytes per device count.
      outputs: Its outputs.
      aliased: Outputs written into donated inputs' buffers.
      temporaries: Its scratch buffers as the compiler states them (``temp_size_in_bytes``;
        XLA:TPU's exceeds what it allocates for them, see ``peak``).
      peak: What the program allocates per device (:func:`substrax.hlo.peak_bytes`): on
        XLA:TPU its heap peak, the buffer assignment it checks against HBM; on XLA:CPU and
        XLA:GPU arguments + outputs - aliased + temporaries.
      host_temporaries: Its scratch buffers in the host's memory: the activations that remat
        ``"offload"`` moves there (0 on XLA:CPU, which keeps them on the device).
      heap_peak: The compiler's simulation of the most bytes live at once
        (``memory_analysis().peak_memory_in_bytes``). XLA:TPU's is its buffer assignment, so
        ``peak`` there; XLA:CPU's leaves the temporaries out (arguments + outputs).
    """

    arguments: int
    argument_data: int
    outputs: int
    aliased: int
    temporaries: int
    peak: int
    host_temporaries: int = 0
    heap_peak: int = 0

    @classmethod
    def of(cls, compiled: Any, platform: str, hlo_text: str | None = None) -> ProgramMemory:
        """The memory the compiler states for a program.

        Args:
          compiled: A ``jax.stages.Compiled``.
          platform: Its compiler's platform (``"tpu"`` for a target slice; one of
            :data:`substrax.hlo.PLATFORMS`).
          hlo_text: Its ``as_text()``, where the caller has it already; None asks
            ``compiled`` for it.

        Returns:
          Its memory per device.
        """
        memory = compiled.memory_analysis()
        text = compiled.as_text() if hlo_text is None else hlo_text
        return cls(
            int(memory.argument_size_in_bytes), argument_bytes(text),
            int(memory.output_size_in_bytes),
            int(memory.alias_size_in_bytes), int(memory.temp_size_in_bytes),
            peak_bytes(memory, platform), int(getattr(memory, "host_temp_size_in_bytes", 0) or 0),
            int(getattr(memory, "peak_memory_in_bytes", 0) or 0),
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TargetReport:
    """What the compiler says of a model's init and training step on a target slice.

    Attributes:
      target: The slice (``"v5p:4x4x4"``).
      layout: The layout's label (``"fsdp 64"``).
      axis_sizes: The mesh, ``{axis_name: size}``.
      memory_bytes: HBM per chip.
      state_bytes: Parameters and optimizer state per device, as planned
        (:func:`sharding_report`).
      init: The sharded init's memory per device.
      step: The training step's memory per device.
      flops: The step's FLOPs per device: the compiler's cost analysis, with every trip of a
        loop's matrix products counted (it counts a loop body once;
        :func:`substrax.hlo.compiled_flops`).
      collectives: ``{(kind, mesh axes): {"count", "bytes"}}`` per device per step
        (:func:`substrax.hlo.traffic_by_axes`, each loop trip counted).
      plan: The step's plan (every decision and each parameter's specs).
      compile_seconds: Wall time of planning, lowering and compiling both programs.
      hlo: The compiled step's HLO text.
    """

    target: str
    layout: str
    axis_sizes: dict[str, int]
    memory_bytes: int
    state_bytes: int
    init: ProgramMemory
    step: ProgramMemory
    flops: float
    collectives: dict[tuple[str, tuple[str, ...] | None], dict[str, float]]
    plan: StepPlan
    compile_seconds: float
    hlo: str = dataclasses.field(repr=False, default="")

    @property
    def traffic_bytes(self) -> float:
        """Collective bytes per device per step, all kinds."""
        return sum(row["bytes"] for row in self.collectives.values())

    @property
    def fits(self) -> bool:
        """Whether the step's peak fits the chip's HBM."""
        return self.step.peak <= self.memory_bytes

    def _host(self) -> str:
        """The step's bytes in host memory (remat offload), in the summary's words, or ""."""
        if not self.step.host_temporaries:
            return ""
        step = self.step
        text = f"; in host memory {step.host_temporaries / _MIB:,.1f} (remat offload)"
        stated = step.arguments + step.outputs - step.aliased + step.temporaries
        if step.peak == stated != step.heap_peak:  # peak_bytes fell back: the heap is the host's
            text += (
                "; the peak counts the stated temporaries, above what XLA:TPU allocates (its "
                "heap peak is the host memory's)"
            )
        return text

    def summary(self) -> str:
        """The report as text: memory against HBM, collectives, FLOPs, then the step's decisions.

        Returns:
          The lines, joined.
        """
        hbm = self.memory_bytes / 2**30
        lines = [
            f"{self.target}: {self.layout} on {self.axis_sizes}, compiled by XLA:TPU in "
            f"{self.compile_seconds:.1f} s",
            f"  state (params + optimizer): {self.state_bytes / _MIB:,.1f} MiB per chip",
            f"  init: peak {self.init.peak / _MIB:,.1f} MiB (outputs "
            f"{self.init.outputs / _MIB:,.1f}, temporaries {self.init.temporaries / _MIB:,.1f})",
            f"  step: peak {self.step.peak / _MIB:,.1f} MiB of {hbm:,.1f} GiB HBM "
            f"({'fits' if self.fits else 'DOES NOT FIT'}): arguments "
            f"{self.step.arguments / _MIB:,.1f}, outputs {self.step.outputs / _MIB:,.1f} "
            f"({self.step.aliased / _MIB:,.1f} donated), temporaries "
            f"{self.step.temporaries / _MIB:,.1f}{self._host()}",
            f"  FLOPs: {self.flops / 1e12:,.3f} TFLOP per chip per step",
            f"  collectives: {self.traffic_bytes / _MIB:,.1f} MiB per chip per step",
        ]
        for (kind, axes), row in self.collectives.items():
            over = "axes unknown" if axes is None else f"over {axes}"
            mib = row["bytes"] / _MIB
            lines.append(f"    {kind:<18} {over:<26} {int(row['count']):>5}x {mib:>10,.1f} MiB")
        width = max(len(d.name) for d in self.plan.decisions)
        lines.append(
            f"  step plan ({len(self.plan.params)} parameters; print report.plan for each):"
        )
        lines += [f"    {d.name:<{width}}  {d.value}: {d.reason}" for d in self.plan.decisions]
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready values (bytes per device, collectives as a list).

        Returns:
          A dict of plain values.
        """
        return {
            "target": self.target,
            "layout": self.layout,
            "axis_sizes": self.axis_sizes,
            "memory_bytes": self.memory_bytes,
            "fits": self.fits,
            "state_bytes": self.state_bytes,
            "init": dataclasses.asdict(self.init),
            "step": dataclasses.asdict(self.step),
            "flops": self.flops,
            "traffic_bytes": self.traffic_bytes,
            "collectives": [
                {"kind": kind, "axes": list(axes) if axes is not None else None, **row}
                for (kind, axes), row in self.collectives.items()
            ],
            "plan": [
                {"name": d.name, "value": d.value, "reason": d.reason} for d in self.plan.decisions
            ],
            "compile_seconds": self.compile_seconds,
        }


def compile_for(
    factory: Callable[[], nnx.Module],
    tx: optax.GradientTransformation,
    step: Callable[..., Any] | JittedStep,
    batch: Any,
    *,
    target: str | CompileTarget,
    layout: LayoutLike,
    axis_sizes: Mapping[str, int] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    **step_options: Any,
) -> TargetReport:
    """Compiles a model's sharded init and training step for a TPU slice, without its chips.

    The model ``factory`` builds is planned for the layout on a mesh over the slice's chips,
    made abstract (nothing is created, here or anywhere), given its optimizer abstractly, and
    the init (:meth:`ModelPlan.compile_init`) and the step are compiled by the real TPU
    compiler (``libtpu``; see :mod:`substrax.target`). The step is the one training would
    run: its plan is made for the target's platform and mesh, not this machine's. An init
    already compiled for the target (the same program: the same model and layout, as when
    comparing step options) is reused.

    Args:
      factory: A function of no arguments that builds the model (run abstractly only).
      tx: The optax transformation, such as ``optax.adamw(1e-4)``.
      step: ``loss_fn(model, batch)`` (the step is ``make_train_step(loss_fn,
        **step_options)``), or a step already built: a pipeline's
        (``make_train_step(Stages(...), mesh)``) or a configured :class:`TrainStep`.
      batch: The global batch's shapes: a pytree of ``jax.ShapeDtypeStruct`` (or arrays,
        whose shapes are taken), rows first, as the step splits them.
      target: The slice, ``"v5p:4x4x4"`` or ``"v5p-128"`` (:meth:`CompileTarget.parse`).
      layout: A layout name (:data:`substrax.layout.LAYOUTS`) or a
        :class:`~substrax.layout.Layout` (a planner candidate's).
      axis_sizes: The mesh for a layout name, ``{"data": 8, "model": 4}``; one-axis layouts
        (``dp``, ``fsdp``, ``zero1``, ``zero2``) default to ``{"data": chips}``.
      mesh: A mesh already laid over the target's chips (:meth:`CompileTarget.make_mesh`), for a
        step built on it; otherwise one is made.
      **step_options: :func:`make_train_step`'s options (``precision``, ``remat``,
        ``microbatches``, ...) when ``step`` is a loss function.

    Returns:
      The :class:`TargetReport`.

    Raises:
      ValueError: For a target, layout or mesh that do not agree (naming what would), or step
        options given with a built step.
      CompileRefused: A program the TPU compiler refuses (a ``ValueError`` naming the layout
        and the step's decisions).
      RuntimeError: Where the TPU compiler is not installed.
    """
    start = time.perf_counter()
    target = CompileTarget.parse(target)
    mesh = _target_mesh(target, layout, axis_sizes, mesh)
    step = _step_of(step, step_options)
    plan = plan_model(factory, mesh, layout=layout)
    label = plan.layout.label if plan.layout is not None else str(dict(mesh.shape))
    init = _compile(target, lambda: _compiled_init(target, plan), label, "sharded init", None)
    model = plan.abstract_model()
    optimizer = create_sharded_optimizer(model, tx)
    shapes = jax.tree.map(_shape_of, batch)
    step_plan = step.plan_for(model, optimizer, shapes)
    compiled = _compile(
        target, lambda: step.lower(model, optimizer, shapes).compile(), label, "training step",
        step_plan,
    )  # fmt: skip
    text = compiled.as_text()
    return TargetReport(
        target=target.name,
        layout=label,
        axis_sizes=dict(mesh.shape),
        memory_bytes=target.memory_bytes,
        state_bytes=sharding_report(model).bytes_per_device
        + sharding_report(optimizer).bytes_per_device,
        init=ProgramMemory.of(init, "tpu"),
        step=ProgramMemory.of(compiled, "tpu", text),
        flops=compiled_flops(compiled, text),
        collectives=traffic_by_axes(text, dict(mesh.shape), trips=True),
        plan=step_plan,
        compile_seconds=time.perf_counter() - start,
        hlo=text,
    )


#: The inits :func:`compile_for` compiled last, by target, device order and program text.
_INITS: collections.OrderedDict[tuple[str, tuple[int, ...], str], Any] = collections.OrderedDict()
_KEPT_INITS = 4


def _compiled_init(target: CompileTarget, plan: ModelPlan) -> Any:
    """``plan``'s init compiled for ``target``, once per program.

    The init depends on the model and its layout only, so a sweep over step options (remat,
    microbatches, the guard) for one model compiles it once; the last :data:`_KEPT_INITS`
    are kept (an executable compiled for a slice it is not on holds no device memory).
    """
    lowered = plan._lower_init()
    key = (target.name, tuple(d.id for d in plan.mesh.devices.flat), lowered.as_text())
    if key not in _INITS:
        _INITS[key] = lowered.compile()
        while len(_INITS) > _KEPT_INITS:
            _INITS.popitem(last=False)
    _INITS.move_to_end(key)
    return _INITS[key]


def _target_mesh(
    target: CompileTarget, layout: LayoutLike, axis_sizes: Mapping[str, int] | None, mesh: Any
) -> jax.sharding.Mesh:
    """The mesh to compile on: given, the layout's shape, or ``axis_sizes`` over the chips."""
    if mesh is not None:
        if mesh.devices.size != target.chips or mesh.devices.flat[0].platform != "tpu":
            raise ValueError(
                f"mesh {dict(mesh.shape)} is not over target {target.name}'s {target.chips} "
                f"chips; build it with CompileTarget.parse({target.name!r}).make_mesh(axis_sizes)."
            )
        return mesh
    if isinstance(layout, Layout):
        return target.make_mesh(axis_sizes or layout.shape)
    if axis_sizes is None:
        if layout not in _ONE_AXIS:
            raise ValueError(
                f"Layout {layout!r} needs its mesh's axes: pass axis_sizes=..., such as "
                f"{{'data': {target.chips // 2}, 'model': 2}} for {target.name}'s "
                f"{target.chips} chips (layouts on one axis: {', '.join(_ONE_AXIS)})."
            )
        axis_sizes = {"data": target.chips}
    return target.make_mesh(axis_sizes)


def _step_of(step: Any, options: dict[str, Any]) -> JittedStep:
    if isinstance(step, JittedStep):
        if options:
            raise ValueError(
                f"compile_for was given a built step and step options {sorted(options)}; "
                "give the options to the step's maker instead."
            )
        return step
    if not callable(step):
        raise TypeError(
            "step must be loss_fn(model, batch) or a step from make_train_step, got "
            f"{type(step).__name__}."
        )
    return make_train_step(step, **options)


def _shape_of(leaf: Any) -> jax.ShapeDtypeStruct:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
    return jax.ShapeDtypeStruct(np.shape(leaf), np.result_type(leaf))


def _compile(
    target: CompileTarget, make: Callable[[], Any], layout: str, what: str, plan: StepPlan | None
) -> Any:
    """``make()`` for ``target``, a refusal by its compiler named by layout and step decisions."""
    try:
        with target.compiling():
            return make()
    except jax.errors.JaxRuntimeError as error:
        decisions = (
            "; ".join(f"{d.name} {d.value} ({d.reason})" for d in plan.decisions) if plan else ""
        )
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CompileRefused(
            f"XLA:TPU refused the {what} of layout {layout}: {first}"
            + (f". The step's decisions: {decisions}" if decisions else ""),
            layout, what, first,
        ) from error  # fmt: skip
