"""Compile your model's sharded init and training step for a TPU slice, on a machine without one.

    python -m substrax_flax.compile --factory examples.gpt:llama3_8b --target v5p-64 \
        --layout fsdp --batch 32x8192

builds the model ``--factory`` names abstractly, plans it for ``--layout`` on a mesh over the
slice's chips, and compiles the init and the step with the real TPU compiler
(:func:`substrax_flax.compile_for`; ``libtpu`` must be installed, as ``make test`` does). It
prints what the compiler says: memory per chip against HBM, collectives by kind and mesh axis,
FLOPs, and the step's plan; ``--json PATH`` writes the same.

The batch (``--batch ROWSxSEQ``) is ``{"inputs", "targets"}``, each ``int32[ROWS, SEQ]``, and
the default loss is next-token cross-entropy of ``model(inputs)``; ``--loss module:function``
takes your own ``loss_fn(model, batch)``. With ``--pipeline module:embed,module:layer,
module:head`` (``--layout pp``) the step is ``make_train_step(Stages(embed, layer, head))``
and the batch is token rows ``int32[ROWS, SEQ + 1]``, which ``embed`` shifts.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["main", "next_token_loss"]


def next_token_loss(model: Any, batch: dict) -> Any:
    """The default loss: cross-entropy of ``model(batch["inputs"])`` against ``batch["targets"]``.

    Args:
      model: A model whose call returns logits ``[rows, seq, vocab]``.
      batch: ``{"inputs": int[rows, seq], "targets": int[rows, seq]}``.

    Returns:
      The mean loss.
    """
    import optax

    logits = model(batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def _load(name: str, flag: str) -> Callable[..., Any]:
    module_name, sep, function = name.partition(":")
    if not sep or not module_name or not function:
        raise ValueError(f"{flag} {name!r}: expected module:function.")
    sys.path.insert(0, str(pathlib.Path.cwd()))
    try:
        return getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"{flag} {name!r}: {error}") from None


def _sizes(text: str | None) -> dict[str, int] | None:
    if text is None:
        return None
    sizes = {}
    for part in text.split(","):
        name, sep, size = part.partition("=")
        if not sep or not size.strip().isdigit():
            raise ValueError(f"--mesh {text!r}: expected name=size,... such as data=16,model=4.")
        sizes[name.strip()] = int(size)
    return sizes


def _batch(text: str, rows_only: bool) -> Any:
    import jax
    import jax.numpy as jnp

    rows, sep, seq = text.lower().partition("x")
    if not sep or not rows.isdigit() or not seq.isdigit():
        raise ValueError(f"--batch {text!r}: expected ROWSxSEQ, such as 32x8192.")
    if rows_only:
        return jax.ShapeDtypeStruct((int(rows), int(seq) + 1), jnp.int32)
    tokens = jax.ShapeDtypeStruct((int(rows), int(seq)), jnp.int32)
    return {"inputs": tokens, "targets": tokens}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m substrax_flax.compile", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--factory", required=True, help="module:function building your model")
    parser.add_argument("--target", required=True, help="a TPU slice: v5p:4x4x4 or v5p-128")
    parser.add_argument("--layout", required=True, help="a named layout (fsdp, fsdp+tp, ...)")
    parser.add_argument("--mesh", help="axis sizes, e.g. data=16,model=4 (one-axis layouts: all)")
    parser.add_argument("--batch", required=True, help="global batch ROWSxSEQ, e.g. 32x8192")
    parser.add_argument("--loss", help="module:function, loss_fn(model, batch)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--precision", choices=("f32", "mixed", "bf16"), default="f32")
    parser.add_argument(  # substrax.spmd.REMAT, not imported before JAX_PLATFORMS is set
        "--remat", choices=("none", "selective", "offload", "full"), default="none"
    )
    parser.add_argument("--microbatches", type=int, default=1)
    parser.add_argument("--pipeline", help="module:embed,module:layer,module:head (layout pp)")
    parser.add_argument("--stack", default="blocks", help="the pipeline's stacked attribute")
    parser.add_argument("--schedule", default="zb-h1", help="the pipeline's schedule")
    parser.add_argument("--repeats", type=int, default=1, help="the pipeline's chunks per stage")
    parser.add_argument("--json", type=pathlib.Path, help="also write the report as JSON here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line.

    Args:
      argv: The arguments (``sys.argv[1:]`` when None).

    Returns:
      The exit status: 0, or 2 for bad input or a program the compiler refuses (one line on
      stderr).
    """
    args = _parser().parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the target is compiled for, not run on
    import optax

    import substrax_flax as sf
    from substrax.target import CompileTarget

    try:
        factory = _load(args.factory, "--factory")
        tx = optax.adamw(1e-4) if args.optimizer == "adamw" else optax.sgd(1e-3)
        target = CompileTarget.parse(args.target)
        batch = _batch(args.batch, rows_only=args.pipeline is not None)
        options: dict[str, Any] = {"mesh": None, "axis_sizes": _sizes(args.mesh)}
        precision = None if args.precision == "f32" else args.precision
        if args.pipeline:
            embed, layer, head = (_load(n, "--pipeline") for n in args.pipeline.split(","))
            mesh = target.make_mesh(options.pop("axis_sizes") or {"pipe": target.chips})
            stages = sf.Stages(embed, layer, head, stack=args.stack, schedule=args.schedule,
                               repeats=args.repeats)  # fmt: skip
            step = sf.make_train_step(stages, mesh, microbatches=args.microbatches,
                                      remat=args.remat, precision=precision)  # fmt: skip
            options["mesh"] = mesh
        else:
            step = _load(args.loss, "--loss") if args.loss else next_token_loss
            options.update(remat=args.remat, microbatches=args.microbatches, precision=precision)
        report = sf.compile_for(
            factory, tx, step, batch, target=target, layout=args.layout, **options
        )
    except (ValueError, TypeError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(report.summary())
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_json(), indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
