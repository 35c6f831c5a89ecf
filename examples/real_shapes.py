"""Real-size layer shapes, without annotations, built abstractly only (nnx.eval_shape).

Written from the published configurations (sizes only): a 0.6B Qwen3-style decoder (d 1024,
16 heads of 128, 8 KV heads, MLP 3072, vocab 151936, 28 layers, tied embeddings), a 1B
Gemma3-style decoder (d 1152, 4 heads of 256, 1 KV head, MLP 6912, vocab 262144, 26 layers),
ResNet-50 and ViT-B/16. Decoder kernels are heads-first einsum weights, as public NNX code
writes them.
"""

import jax.numpy as jnp
from flax import nnx


def _p(rngs, *shape):
    return nnx.Param(jnp.zeros(shape))


class DecoderLayer(nnx.Module):
    def __init__(self, d, heads, kv, head_dim, mlp, rngs):
        self.q = _p(rngs, heads, d, head_dim)
        self.k = _p(rngs, kv, d, head_dim)
        self.v = _p(rngs, kv, d, head_dim)
        self.o = _p(rngs, heads, head_dim, d)
        self.q_norm, self.k_norm = _p(rngs, head_dim), _p(rngs, head_dim)
        self.pre_norm, self.post_norm = _p(rngs, d), _p(rngs, d)
        self.gate, self.up, self.down = _p(rngs, d, mlp), _p(rngs, d, mlp), _p(rngs, mlp, d)


class Decoder(nnx.Module):
    def __init__(self, d, heads, kv, head_dim, mlp, vocab, layers, rngs):
        self.embed = _p(rngs, vocab, d)
        self.layers = nnx.List(
            [DecoderLayer(d, heads, kv, head_dim, mlp, rngs) for _ in range(layers)]
        )
        self.norm = _p(rngs, d)


def qwen_like(rngs):
    return Decoder(1024, 16, 8, 128, 3072, 151936, 28, rngs)


def gemma_like(rngs):
    return Decoder(1152, 4, 1, 256, 6912, 262144, 26, rngs)


class Bottleneck(nnx.Module):
    def __init__(self, cin, width, stride_conv, rngs):
        cout = 4 * width
        self.conv1 = nnx.Conv(cin, width, (1, 1), use_bias=False, rngs=rngs)
        self.bn1 = nnx.BatchNorm(width, rngs=rngs)
        self.conv2 = nnx.Conv(width, width, (3, 3), use_bias=False, rngs=rngs)
        self.bn2 = nnx.BatchNorm(width, rngs=rngs)
        self.conv3 = nnx.Conv(width, cout, (1, 1), use_bias=False, rngs=rngs)
        self.bn3 = nnx.BatchNorm(cout, rngs=rngs)
        if stride_conv:
            self.proj = nnx.Conv(cin, cout, (1, 1), use_bias=False, rngs=rngs)
            self.proj_bn = nnx.BatchNorm(cout, rngs=rngs)


class ResNet50(nnx.Module):
    def __init__(self, rngs):
        self.stem = nnx.Conv(3, 64, (7, 7), use_bias=False, rngs=rngs)
        self.stem_bn = nnx.BatchNorm(64, rngs=rngs)
        blocks, cin = [], 64
        for width, count in ((64, 3), (128, 4), (256, 6), (512, 3)):
            for i in range(count):
                blocks.append(Bottleneck(cin, width, i == 0, rngs))
                cin = 4 * width
        self.blocks = nnx.List(blocks)
        self.fc = nnx.Linear(2048, 1000, rngs=rngs)


class EncoderBlock(nnx.Module):
    def __init__(self, rngs):
        self.ln1 = nnx.LayerNorm(768, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(12, 768, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(768, rngs=rngs)
        self.fc1 = nnx.Linear(768, 3072, rngs=rngs)
        self.fc2 = nnx.Linear(3072, 768, rngs=rngs)


class ViTB(nnx.Module):
    def __init__(self, rngs):
        self.patch = nnx.Conv(3, 768, (16, 16), strides=(16, 16), rngs=rngs)
        self.cls = nnx.Param(jnp.zeros((1, 1, 768)))
        self.pos = nnx.Param(jnp.zeros((1, 197, 768)))
        self.blocks = nnx.List([EncoderBlock(rngs) for _ in range(12)])
        self.ln = nnx.LayerNorm(768, rngs=rngs)
        self.head = nnx.Linear(768, 1000, rngs=rngs)


REAL = {
    "qwen3-0.6b-like": (qwen_like, 1.05),
    "gemma3-1b-like": (gemma_like, 1.05),
    "resnet-50": (ResNet50, 1.15),
    "vit-b-16": (ViTB, 1.05),
}
