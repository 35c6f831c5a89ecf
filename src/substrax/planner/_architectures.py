"""Named architectures as abstract parameter trees with logical axis names (no allocation)."""

from __future__ import annotations

import dataclasses

__all__ = [
    "ARCHITECTURES",
    "Leaf",
    "TransformerConfig",
    "architecture",
    "config_from_leaves",
    "transformer_leaves",
]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter of an abstract model.

    Attributes:
      path: Its path, such as ``"layers/attn/wq"``.
      shape: Its global shape.
      names: One logical axis name (or None) per dimension; all None for a parameter
        without annotations, which the layout's strategy shards as the Flax adapter does.
      layer: The kind of layer holding it (``"Linear"``, ``"MultiHeadAttention.query"``),
        for the strategy of an unannotated parameter; None when unknown.
    """

    path: str
    shape: tuple[int, ...]
    names: tuple[str | None, ...]
    layer: str | None = None


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only transformer, its layers stacked (leading ``layers`` axis).

    Attributes:
      layers: Decoder layers.
      d_model: Model width.
      heads: Query heads.
      kv_heads: Key/value heads (grouped-query attention when fewer than ``heads``).
      head_dim: Width of one head.
      ffn: Hidden width of the MLP.
      vocab: Vocabulary size.
      gated: SwiGLU MLP (three matrices) rather than two.
      tied: Output head shares the embedding.
      biases: Linear layers have biases (GPT-2).
      positions: Learned position embeddings of this many positions (0: none).
      experts: Experts per mixture-of-experts MLP (0: dense MLPs). Each layer then has a
        router ``[embed, experts]`` and ``experts`` copies of the MLP's matrices (logical
        name ``expert`` on their leading dimension).
      top_k: Experts each token is routed to.
    """

    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    gated: bool = True
    tied: bool = False
    biases: bool = False
    positions: int = 0
    experts: int = 0
    top_k: int = 2


def transformer_leaves(c: TransformerConfig) -> list[Leaf]:
    """The parameters of ``c``, each with its logical axis names.

    The names are ``layers`` (the stacked layer axis), ``vocab``, ``embed``, ``heads``,
    ``kv_heads``, ``kv`` (head width), ``mlp`` and, for mixtures of experts, ``expert``.

    Args:
      c: The configuration.

    Returns:
      One :class:`Leaf` per parameter.
    """
    n, d = c.layers, c.d_model
    leaves = [Leaf("embedding", (c.vocab, d), ("vocab", "embed"))]
    if c.positions:
        leaves.append(Leaf("positions", (c.positions, d), (None, "embed")))
    layer = [
        ("attn_norm", (d,), ("embed",)),
        ("wq", (d, c.heads, c.head_dim), ("embed", "heads", "kv")),
        ("wk", (d, c.kv_heads, c.head_dim), ("embed", "kv_heads", "kv")),
        ("wv", (d, c.kv_heads, c.head_dim), ("embed", "kv_heads", "kv")),
        ("wo", (c.heads, c.head_dim, d), ("heads", "kv", "embed")),
        ("mlp_norm", (d,), ("embed",)),
        ("w_in", (d, c.ffn), ("embed", "mlp")),
        ("w_out", (c.ffn, d), ("mlp", "embed")),
    ]
    if c.gated:
        layer.append(("w_gate", (d, c.ffn), ("embed", "mlp")))
    if c.experts:  # every MLP matrix once per expert, and a router
        layer = [
            (name, (c.experts, *shape), ("expert", *names)) if name.startswith("w_")
            else (name, shape, names) for name, shape, names in layer
        ]  # fmt: skip
        layer.append(("router", (d, c.experts), ("embed", None)))
    if c.biases:
        layer += [
            ("bq", (c.heads, c.head_dim), ("heads", "kv")),
            ("bk", (c.kv_heads, c.head_dim), ("kv_heads", "kv")),
            ("bv", (c.kv_heads, c.head_dim), ("kv_heads", "kv")),
            ("bo", (d,), ("embed",)),
            ("b_in", (c.ffn,), ("mlp",)),
            ("b_out", (d,), ("embed",)),
            ("attn_norm_bias", (d,), ("embed",)),
            ("mlp_norm_bias", (d,), ("embed",)),
        ]
    leaves += [
        Leaf(f"layers/{name}", (n, *shape), ("layers", *names)) for name, shape, names in layer
    ]
    leaves.append(Leaf("norm", (d,), ("embed",)))
    if c.biases:
        leaves.append(Leaf("norm_bias", (d,), ("embed",)))
    if not c.tied:
        leaves.append(Leaf("head", (d, c.vocab), ("embed", "vocab")))
    return leaves


ARCHITECTURES = {
    "gpt2-small": TransformerConfig(
        layers=12, d_model=768, heads=12, kv_heads=12, head_dim=64, ffn=3072, vocab=50257,
        gated=False, tied=True, biases=True, positions=1024,
    ),
    "llama3-8b": TransformerConfig(
        layers=32, d_model=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256
    ),
    "llama3-70b": TransformerConfig(
        layers=80, d_model=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672, vocab=128256
    ),
    "llama3-405b": TransformerConfig(
        layers=126, d_model=16384, heads=128, kv_heads=8, head_dim=128, ffn=53248, vocab=128256
    ),
    # Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", arXiv:2401.04088, and its
    # released config): 32 layers, 8 SwiGLU experts of 14336, top 2, 32k vocabulary; 46.7B
    # parameters, 12.9B active per token.
    "mixtral-8x7b": TransformerConfig(
        layers=32, d_model=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=32000,
        experts=8, top_k=2,
    ),
}  # fmt: skip
"""The built-in architectures, by name."""


def architecture(name: str) -> TransformerConfig:
    """A built-in architecture by name.

    Args:
      name: One of :data:`ARCHITECTURES`.

    Returns:
      Its configuration.

    Raises:
      ValueError: For an unknown name; the message lists the known ones.
    """
    if name not in ARCHITECTURES:
        raise ValueError(f"Unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}.")
    return ARCHITECTURES[name]


def config_from_leaves(leaves: list[Leaf]) -> TransformerConfig:
    """A transformer configuration read off a model's logical dimension sizes.

    For the planner's closed forms (activations, FLOPs) on a model that is not built in: the
    sizes of the dimensions named ``layers``, ``embed``, ``heads``, ``kv_heads``, ``kv``,
    ``mlp`` and ``vocab``; a missing name falls back to 1 layer, one head, ``kv`` =
    ``embed / heads``, ``mlp`` = 4 x ``embed``, ``vocab`` = 0 and no experts (``expert``).
    A model that names no ``embed`` dimension (unannotated) gets the commonest dimension
    of its matrices as its width (:func:`inferred_width`).

    Args:
      leaves: The model's parameters with their logical names.

    Returns:
      The configuration (an approximation: state bytes always come from the leaves).

    Raises:
      ValueError: If there is neither an ``embed`` dimension nor a matrix.
    """
    sizes: dict[str, int] = {}
    for leaf in leaves:
        for name, size in zip(leaf.names, leaf.shape, strict=True):
            if name is not None:
                sizes.setdefault(name, size)
    if "embed" not in sizes:
        width = inferred_width(leaves)
        if width is None:
            raise ValueError(
                "The model names no dimension 'embed' and has no matrix to read its width "
                f"from; the planner needs it for activations and FLOPs. Names: {sorted(sizes)}."
            )
        sizes["embed"] = width
    d, heads = sizes["embed"], sizes.get("heads", 1)
    return TransformerConfig(
        layers=sizes.get("layers", 1), d_model=d, heads=heads,
        kv_heads=sizes.get("kv_heads", heads), head_dim=sizes.get("kv", max(d // heads, 1)),
        ffn=sizes.get("mlp", 4 * d), vocab=sizes.get("vocab", 0), gated=False,
        experts=sizes.get("expert", 0),
    )  # fmt: skip


def inferred_width(leaves: list[Leaf]) -> int | None:
    """The commonest dimension size among a model's matrices: its width, when unnamed.

    Args:
      leaves: The model's parameters.

    Returns:
      The size (the larger on a tie), or None when no parameter has two dimensions.
    """
    counts: dict[int, int] = {}
    for leaf in leaves:
        if len(leaf.shape) >= 2:
            for size in leaf.shape:
                counts[size] = counts.get(size, 0) + 1
    return max(counts, key=lambda size: (counts[size], size)) if counts else None
