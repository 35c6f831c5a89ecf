"""A published mixture-of-experts block, as its authors wrote it in Flax NNX, trained dropless.

Qwen2-MoE's sparse block at a small size: a linear router over every expert, a softmax, the
top-k weights as they are (``norm_topk_prob=False``), SwiGLU experts stacked in three
``[experts, ...]`` kernels, and one shared expert scaled by a sigmoid gate of its own. The
authors compute every expert for every token and mask (``reference``); the port replaces that
with :func:`substrax.spmd.experts` and nothing else.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import substrax_flax as sf
from substrax.layout import Layout
from substrax.spmd import experts

LECUN = nnx.initializers.lecun_normal()


@dataclasses.dataclass(frozen=True)
class Qwen2MoeConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    moe_intermediate_size: int = 16
    shared_expert_intermediate_size: int = 48
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.001


class SharedExpert(nnx.Module):
    def __init__(self, cfg, rngs):
        def dense(i, o, names):
            init = nnx.with_partitioning(LECUN, names)
            return nnx.Linear(i, o, use_bias=False, kernel_init=init, rngs=rngs)

        d, h = cfg.hidden_size, cfg.shared_expert_intermediate_size
        self.gate_proj = dense(d, h, ("embed", "mlp"))
        self.up_proj = dense(d, h, ("embed", "mlp"))
        self.down_proj = dense(h, d, ("mlp", "embed"))

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen2MoeSparseMoeBlock(nnx.Module):
    def __init__(self, cfg: Qwen2MoeConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d, h, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        router = nnx.with_partitioning(LECUN, ("embed", None))
        self.gate = nnx.Linear(d, e, use_bias=False, kernel_init=router, rngs=rngs)
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.gate_proj = nnx.Param(init(rngs.params(), (e, d, h)),
                                   out_sharding=("expert", "embed", "mlp"))  # fmt: skip
        self.up_proj = nnx.Param(init(rngs.params(), (e, d, h)),
                                 out_sharding=("expert", "embed", "mlp"))  # fmt: skip
        self.down_proj = nnx.Param(init(rngs.params(), (e, h, d)),
                                   out_sharding=("expert", "mlp", "embed"))  # fmt: skip
        self.shared_expert = SharedExpert(cfg, rngs)
        self.shared_expert_gate = nnx.Linear(d, 1, use_bias=False, kernel_init=router, rngs=rngs)

    def _shared(self, x):
        return jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def reference(self, x):
        """The authors' forward: every expert on every token, masked to the top k."""
        logits = self.gate(x).astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        weights, chosen = jax.lax.top_k(probs, self.cfg.num_experts_per_tok)
        if self.cfg.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdims=True)
        mask = jnp.sum(jax.nn.one_hot(chosen, self.cfg.num_experts) * weights[..., None], -2)
        gate = jax.nn.silu(jnp.einsum("btd,edh->bteh", x, self.gate_proj[...]))
        up = jnp.einsum("btd,edh->bteh", x, self.up_proj[...])
        out = jnp.einsum("bteh,ehd->bted", gate * up, self.down_proj[...])
        return jnp.einsum("bted,bte->btd", out, mask) + self._shared(x)

    def __call__(self, x):
        """The port: the same router and experts, dispatched by substrax, dropless."""
        y, stats = experts(
            x, self.gate.kernel[...], self.up_proj[...], self.down_proj[...],
            w_gate=self.gate_proj[...], top_k=self.cfg.num_experts_per_tok,
            routing="softmax", normalize=self.cfg.norm_topk_prob, activation=jax.nn.silu,
        )  # fmt: skip
        return y + self._shared(x), stats


class TinyQwen2Moe(nnx.Module):
    def __init__(self, cfg, rngs):
        self.cfg = cfg
        embed = nnx.with_partitioning(nnx.initializers.normal(1.0), ("vocab", "embed"))
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, embedding_init=embed,
                                      rngs=rngs)  # fmt: skip
        self.mlp = Qwen2MoeSparseMoeBlock(cfg, rngs)
        head = nnx.with_partitioning(LECUN, ("embed", "vocab"))
        self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False,
                                  kernel_init=head, rngs=rngs)  # fmt: skip

    def __call__(self, ids):
        x = self.embed_tokens(ids)
        y, stats = self.mlp(x)
        return self.lm_head(x + y), stats


def loss_fn(model, batch):
    logits, stats = model(batch[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    aux = model.cfg.num_experts_per_tok * stats.aux_loss  # Hugging Face's scale of the loss
    metrics = {"aux": aux, "tokens_per_expert": stats.counts}
    return ce + model.cfg.router_aux_loss_coef * aux, metrics


CONFIG = Qwen2MoeConfig()
BATCHES = np.random.default_rng(1).integers(0, CONFIG.vocab_size, (3, 16, 17)).astype(np.int32)


def test_the_port_computes_what_the_authors_block_computes():
    with nnx.use_eager_sharding(False):
        block = Qwen2MoeSparseMoeBlock(CONFIG, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 8, CONFIG.hidden_size))
    np.testing.assert_allclose(block(x)[0], block.reference(x), rtol=1e-5, atol=1e-6)


def _train(layout):
    model = sf.create_sharded_model(lambda: TinyQwen2Moe(CONFIG, nnx.Rngs(0)), layout=layout)
    optimizer = sf.create_sharded_optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    step = sf.make_train_step(loss_fn, has_aux=True)
    return [step(model, optimizer, batch) for batch in BATCHES], model


def test_published_moe_under_fsdp_ep_equals_one_device():
    """Its router, shared expert and aux loss, 3 steps over 2 x 4 devices as on one, to 1e-5."""
    reference, one = _train(Layout.named("dp", {"data": 1}))
    metrics, model = _train(Layout.named("fsdp+ep", {"data": 2, "expert": 4}))
    assert model.mlp.up_proj[...].sharding.spec[0] == "expert"
    for got, want in zip(metrics, reference, strict=True):
        np.testing.assert_allclose([got["loss"], got["aux"]], [want["loss"], want["aux"]],
                                   rtol=1e-5)  # fmt: skip
        np.testing.assert_array_equal(got["tokens_per_expert"], want["tokens_per_expert"])
        assert float(np.sum(got["tokens_per_expert"])) == 16 * 16 * 2
    got, want = nnx.state(model, nnx.Param), nnx.state(one, nnx.Param)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
