"""Pretrained weights in and out: safetensors checkpoints loaded into planned shardings."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from flax_test_models import StackedTransformer, Transformer, tokens

import substrax_flax as sf
from substrax.layout import Layout
from substrax_flax._plan import ModelPlan

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "examples"))
import llama

LAYOUTS = {
    "fsdp": Layout.named("fsdp", {"data": 8}),
    "fsdp+tp": Layout.named("fsdp+tp", {"data": 2, "model": 4}),
    "zero1": Layout.named("zero1", {"data": 8}),
}


def _params(model) -> dict[str, np.ndarray]:
    return {p: np.asarray(v) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _assert_bit_exact(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for path in want:
        assert got[path].dtype == want[path].dtype, path
        np.testing.assert_array_equal(got[path], want[path], err_msg=str(path))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Transformer created on fsdp and saved in several files (the sharded format)."""
    model = sf.create_sharded_model(lambda: Transformer(nnx.Rngs(0)), layout=LAYOUTS["fsdp"])
    directory = tmp_path_factory.mktemp("transformer")
    files = sf.save_weights(model, directory, shard_size="20KB")
    return model, directory, files


def test_saved_files_are_safetensors_the_reference_library_reads(saved):
    model, _, files = saved
    assert [f.name for f in files][-1] == "model.safetensors.index.json" and len(files) > 2
    read = {}
    for file in files[:-1]:
        read.update(safetensors.numpy.load_file(file))
    want = {".".join(map(str, p)): v for p, v in _params(model).items()}
    assert read.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(read[name], want[name])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_checkpoint_loads_bit_exact_onto_another_layout(saved, name):
    model, directory, _ = saved
    plan = sf.plan_weights(lambda: Transformer(nnx.Rngs(1)), source=directory, layout=LAYOUTS[name])
    assert not plan.problems and not [p for p in plan.initialised if "rngs" not in p]
    loaded = plan.load()
    _assert_bit_exact(_params(loaded), _params(model))
    for path, array in nnx.to_flat_state(nnx.state(loaded, nnx.Param)):  # the planned layout
        row = sf.sharding_report(loaded).row("/".join(map(str, path)))
        assert array.get_value().sharding.spec == row.spec
    # each distinct slice is read once, so a layout that replicates reads each byte once too
    assert plan.checkpoint.bytes_read == plan.checkpoint.nbytes


@pytest.mark.parametrize("harm", ["truncated", "corrupt header"])
def test_a_damaged_shard_is_refused_at_plan_time_naming_the_file(saved, tmp_path, harm):
    """The official reader checks a file when it is opened: nothing is read after the plan."""
    import shutil

    _, directory, files = saved
    shutil.copytree(directory, tmp_path / "ckpt")
    shard = tmp_path / "ckpt" / files[1].name
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if harm == "truncated" else b"\xff" * 8 + data[8:])
    with pytest.raises(ValueError, match=rf"{shard.name} is not a readable safetensors file "
                       r"\(.*\): the safetensors reader refuses it"):  # fmt: skip
        sf.plan_weights(lambda: Transformer(nnx.Rngs(1)), source=tmp_path / "ckpt",
                        layout=LAYOUTS["fsdp"])  # fmt: skip


def test_a_nan_in_a_checkpoint_tensor_is_named_when_it_is_read(tmp_path):
    reference = sf.create_sharded_model(lambda: Transformer(nnx.Rngs(3)), layout=LAYOUTS["fsdp"])
    flat = {".".join(map(str, p)): v for p, v in _params(reference).items()}
    name = sorted(flat)[0]
    flat[name] = flat[name].copy()
    flat[name].reshape(-1)[[0, 3]] = (np.nan, np.inf)
    safetensors.numpy.save_file(flat, tmp_path / "model.safetensors")
    with pytest.warns(sf.NonFiniteWeightsWarning, match=rf"Tensor '{name}' in model.safetensors "
                      r"holds non-finite values \(1 NaN, 1 inf in the slice read\)"):  # fmt: skip
        loaded = sf.load_weights(lambda: Transformer(nnx.Rngs(0)), source=tmp_path,
                                 layout=LAYOUTS["zero1"])  # fmt: skip
    got = {".".join(map(str, p)): v for p, v in _params(loaded).items()}
    assert np.isnan(got[name].reshape(-1)[0])  # loaded as it is
    with pytest.raises(ValueError, match=rf"Tensor '{name}' in model.safetensors holds non-"
                       r"finite values \(1 NaN, 1 inf in the slice read\); strict=True "
                       r"refuses them"):  # fmt: skip
        sf.load_weights(lambda: Transformer(nnx.Rngs(0)), source=tmp_path,
                        layout=LAYOUTS["zero1"], strict=True)  # fmt: skip


def test_a_file_the_reference_library_wrote_loads(tmp_path):
    reference = sf.create_sharded_model(lambda: Transformer(nnx.Rngs(3)), layout=LAYOUTS["fsdp"])
    flat = {".".join(map(str, p)): v for p, v in _params(reference).items()}
    safetensors.numpy.save_file(flat, tmp_path / "model.safetensors")
    loaded = sf.load_weights(lambda: Transformer(nnx.Rngs(0)), source=tmp_path,
                             layout=LAYOUTS["fsdp+tp"])  # fmt: skip
    _assert_bit_exact(_params(loaded), _params(reference))


STACK = {f"blocks.{{i}}.{name}": f"blocks/{name.replace('.', '/')}" for name in (
    "norm1", "wq", "wk", "wv", "wo", "norm2", "up.kernel", "up.bias", "down.kernel", "down.bias",
)}  # fmt: skip
STACK.update({"embed.embedding": "embed/embedding", "norm": "norm", "head": "head"})


def test_per_layer_tensors_stack_into_a_scanned_model_and_write_back(saved, tmp_path):
    """An unstacked model's checkpoint loads into nnx.scan's stack and computes the same."""
    model, directory, _ = saved
    stacked = sf.load_weights(lambda: StackedTransformer(nnx.Rngs(0), layers=2), source=directory,
                              layout=LAYOUTS["fsdp"], key_map=STACK)  # fmt: skip
    wq = np.asarray(stacked.blocks.wq[...])
    np.testing.assert_array_equal(wq[1], np.asarray(model.blocks[1].wq[...]))
    batch = tokens()
    # the same weights; scan and the loop round differently (float32)
    np.testing.assert_allclose(np.asarray(stacked(batch)), np.asarray(model(batch)), atol=2e-6)
    sf.save_weights(stacked, tmp_path, key_map=STACK)  # split back per layer
    back = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    original = {".".join(map(str, p)): v for p, v in _params(model).items()}
    assert back.keys() == original.keys()
    for name in original:
        np.testing.assert_array_equal(back[name], original[name])


def test_every_mismatch_is_reported_at_once_before_anything_is_read(saved, tmp_path):
    _, directory, _ = saved
    wrong = {f"blocks.{i}.{name}": f"blocks/{i}/{name.replace('.', '/')}" for i in range(2)
             for name in ("norm1", "wq", "wv", "norm2", "up.kernel", "up.bias", "down.kernel",
                          "down.bias")}  # fmt: skip
    wrong.update({
        "blocks.0.wo": "blocks/1/wo",  # given twice (with blocks.1.wo)
        "blocks.1.wo": "blocks/1/wo",
        "embed.embedding": sf.Target("embed/embedding", "v e -> e v"),  # transposed: shape
        "norm": "norm/scale",  # no such variable
        "head": "head",
    })  # fmt: skip
    plan = sf.plan_weights(lambda: Transformer(nnx.Rngs(0)), source=directory,
                           layout=LAYOUTS["fsdp"], key_map=wrong)  # fmt: skip
    with pytest.raises(sf.WeightsMismatch) as info:
        plan.load()
    message = str(info.value)
    assert f"({len(plan.problems)} problems; nothing was read)" in message
    assert "checkpoint tensors the key map does not name" in message and "blocks.0.wk" in message
    assert "'blocks/1/wo' is given by several tensors: blocks.0.wo, blocks.1.wo" in message
    shape = "-> 'embed/embedding': shape (32, 64) (from the checkpoint's (64, 32)), the model's"
    assert f"{shape} is (64, 32)" in message
    assert "norm -> 'norm/scale': the model has no such variable" in message
    assert "model parameters are not in the checkpoint" in message and "blocks/0/wo" in message
    assert plan.checkpoint.bytes_read == 0


def test_dtype_conversion_is_asked_for_never_silent(tmp_path):
    bf16 = {"w": np.ones((8, 4), ml_dtypes.bfloat16)}
    sf.save_tensors(tmp_path, bf16)

    class One(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros((8, 4)), out_sharding=("embed", None))

    layout = LAYOUTS["fsdp"]
    with pytest.raises(sf.WeightsMismatch, match=r"w -> 'w': dtype bfloat16, the model's is "
                       r"float32 \(pass dtype= to convert\)"):  # fmt: skip
        sf.load_weights(One, source=tmp_path, layout=layout)
    as_f32 = sf.load_weights(One, source=tmp_path, layout=layout, dtype=jnp.float32)
    assert as_f32.w[...].dtype == jnp.float32 and float(as_f32.w[...].sum()) == 32.0
    as_bf16 = sf.load_weights(One, source=tmp_path, layout=layout, dtype=jnp.bfloat16)
    assert as_bf16.w[...].dtype == jnp.bfloat16  # stored as asked (a frozen base for LoRA)
    assert sf.sharding_report(as_bf16).row("w").bytes_total == 8 * 4 * 2
    # each conversion is listed in the plan; one that changes kind needs more than dtype=
    plan = sf.plan_weights(One, source=tmp_path, layout=layout, dtype=jnp.float32)
    assert plan.conversions == ["1 tensor(s) bfloat16 -> float32"] and "converted: 1" in str(plan)
    sf.save_tensors(tmp_path / "f32", {"w": np.ones((8, 4), np.float32)})
    narrow = sf.plan_weights(One, source=tmp_path / "f32", layout=layout, dtype=jnp.bfloat16)
    assert narrow.conversions == ["1 tensor(s) float32 -> bfloat16 (narrower: rounded)"]
    sf.save_tensors(tmp_path / "ids", {"w": np.ones((8, 4), np.int32)})
    with pytest.raises(sf.WeightsMismatch, match=r"w -> 'w': dtype int32 into a float32 variable: "
                       r"dtype= converts between floating dtypes only"):  # fmt: skip
        sf.load_weights(One, source=tmp_path / "ids", layout=layout, dtype=jnp.float32)


def test_no_initialiser_runs_and_only_the_shards_are_allocated(saved, monkeypatch):
    _, directory, _ = saved

    def refuse(self):
        raise AssertionError("an initialiser ran")

    monkeypatch.setattr(ModelPlan, "_create_values", refuse)
    before = {id(a) for a in jax.live_arrays()}
    loaded = sf.load_weights(lambda: Transformer(nnx.Rngs(0)), source=directory,
                             layout=LAYOUTS["fsdp"])  # fmt: skip
    new = {id(a) for a in jax.live_arrays() if id(a) not in before}
    leaves = dict(nnx.to_flat_state(nnx.state(loaded)))
    # what the load left on the devices is the model's arrays, each one its planned shards
    assert new <= {id(v.get_value()) for v in leaves.values()}
    report = sf.sharding_report(loaded)
    for path, variable in leaves.items():
        row = report.row("/".join(map(str, path)))
        shards = variable.get_value().addressable_shards
        assert max(s.data.nbytes for s in shards) == row.bytes_per_device


def test_variables_not_in_the_checkpoint_keep_their_initialisers_when_allowed(saved):
    _, directory, _ = saved

    class WithProbe(Transformer):
        def __init__(self, rngs):
            super().__init__(rngs)
            self.probe = nnx.Param(jnp.full((EMBED_PROBE,), 7.0))

    with pytest.raises(sf.WeightsMismatch, match=r"are not in the checkpoint .*: probe"):
        sf.load_weights(lambda: WithProbe(nnx.Rngs(0)), source=directory, layout=LAYOUTS["fsdp"])
    plan = sf.plan_weights(lambda: WithProbe(nnx.Rngs(0)), source=directory,
                           layout=LAYOUTS["fsdp"], allow_missing=["probe"])  # fmt: skip
    assert "probe" in plan.initialised and "probe" in str(plan)
    assert float(plan.load().probe[...].sum()) == 7.0 * EMBED_PROBE


EMBED_PROBE = 16
CONFIGS = {
    "untied": llama.LlamaConfig(),
    "tied": llama.LlamaConfig(tie_word_embeddings=True, num_key_value_heads=1),
}


def _reference_logits(tensors: dict, config: llama.LlamaConfig, ids: np.ndarray) -> np.ndarray:
    """Hugging Face Llama's forward pass in float64 numpy, from the checkpoint's tensors."""
    t = {k: v.astype(np.float64) for k, v in tensors.items()}
    h, kv, dh = config.num_attention_heads, config.num_key_value_heads, config.head_dim

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + config.rms_norm_eps) * w

    def rope(x):  # [b, t, heads, dh], rotate_half
        inv = 1.0 / config.rope_theta ** (np.arange(0, dh, 2) / dh)
        ang = np.arange(x.shape[1])[:, None] * inv[None]
        ang = np.concatenate([ang, ang], -1)[None, :, None]
        rot = np.concatenate([-x[..., dh // 2 :], x[..., : dh // 2]], -1)
        return x * np.cos(ang) + rot * np.sin(ang)

    x = t["model.embed_tokens.weight"][ids]
    b, n = ids.shape
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        y = norm(x, t[p + "input_layernorm.weight"])
        q = rope((y @ t[p + "self_attn.q_proj.weight"].T).reshape(b, n, h, dh))
        k = rope((y @ t[p + "self_attn.k_proj.weight"].T).reshape(b, n, kv, dh))
        v = (y @ t[p + "self_attn.v_proj.weight"].T).reshape(b, n, kv, dh)
        k, v = np.repeat(k, h // kv, axis=2), np.repeat(v, h // kv, axis=2)
        scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(dh)
        scores = np.where(np.tril(np.ones((n, n), bool)), scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        out = np.einsum("bhts,bshd->bthd", weights, v).reshape(b, n, h * dh)
        x = x + out @ t[p + "self_attn.o_proj.weight"].T
        y = norm(x, t[p + "post_attention_layernorm.weight"])
        gate, up = y @ t[p + "mlp.gate_proj.weight"].T, y @ t[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ t[p + "mlp.down_proj.weight"].T
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    return norm(x, t["model.norm.weight"]) @ head.T


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_hugging_face_llama_checkpoint_gives_the_reference_logits(tmp_path, kind):
    config = CONFIGS[kind]
    tensors = llama.write_random_checkpoint(tmp_path, config, shard_size="40KB")
    model = llama.from_pretrained(tmp_path, layout=LAYOUTS["fsdp+tp"])
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (2, 12))
    want = _reference_logits(tensors, config, ids)
    np.testing.assert_allclose(np.asarray(model(ids)), want, rtol=1e-5, atol=1e-5)
    # and back in Hugging Face's names and layouts, bit for bit
    sf.save_weights(model, tmp_path / "out", key_map=llama.key_map(config))
    back = safetensors.numpy.load_file(tmp_path / "out" / "model.safetensors")
    assert back.keys() == tensors.keys()
    for name, value in tensors.items():
        np.testing.assert_array_equal(back[name], value)


class _Split(nnx.Module):
    """Separate q, k, v kernels that a checkpoint stores fused as one ``[3 * out, in]`` matrix."""

    def __init__(self, rngs):
        self.q = nnx.Param(rngs.params.normal((16, 2, 4)), out_sharding=("embed", "heads", "kv"))
        self.k = nnx.Param(rngs.params.normal((16, 1, 4)), out_sharding=("embed", "kv_heads", "kv"))
        self.v = nnx.Param(rngs.params.normal((16, 1, 4)), out_sharding=("embed", "kv_heads", "kv"))


FUSED = {
    "qkv.weight": [
        sf.Target("q", "(h d) e -> e h d", {"h": 2}, take=(0, 0, 8)),
        sf.Target("k", "(h d) e -> e h d", {"h": 1}, take=(0, 8, 12)),
        sf.Target("v", "(h d) e -> e h d", {"h": 1}, take=(0, 12, 16)),
    ]
}


def test_a_fused_tensor_splits_over_several_variables_and_fuses_back(tmp_path):
    fused = np.arange(16 * 16, dtype=np.float32).reshape(16, 16)
    sf.save_tensors(tmp_path / "in", {"qkv.weight": fused})
    layout = Layout.named("fsdp+tp", {"data": 2, "model": 4})
    model = sf.load_weights(lambda: _Split(nnx.Rngs(0)), source=tmp_path / "in", layout=layout,
                            key_map=FUSED)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(model.k[...])[:, 0, :], fused[8:12].T)
    np.testing.assert_array_equal(np.asarray(model.q[...])[:, 1, :], fused[4:8].T)
    sf.save_weights(model, tmp_path / "out", key_map=FUSED)
    back = safetensors.numpy.load_file(tmp_path / "out" / "model.safetensors")
    np.testing.assert_array_equal(back["qkv.weight"], fused)


def test_any_slice_reads_its_own_bytes_from_the_file(tmp_path):
    """Run by run (few runs) or from a mapping (many): each slice, and only its bytes."""
    from substrax_flax._safetensors import Checkpoint

    rng = np.random.default_rng(0)
    tensors = {
        "few": rng.normal(size=(7, 5, 3)).astype(np.float32),  # <= 64 runs: os.pread
        "many": rng.normal(size=(100, 8)).astype(ml_dtypes.bfloat16),  # columns: 100 runs
        "scalar": np.array(3.5, np.float64),
        "bytes": rng.integers(0, 9, (4, 6)).astype(np.int8),
    }
    sf.save_tensors(tmp_path, tensors)
    checkpoint = Checkpoint(tmp_path)
    for name, tensor in tensors.items():
        for _ in range(50):
            index = []
            for n in tensor.shape:
                start = int(rng.integers(n))
                index.append(slice(start, int(rng.integers(start + 1, n + 1))))
            before = checkpoint.bytes_read
            got, want = checkpoint.read(name, tuple(index)), tensor[tuple(index)]
            assert got.dtype == want.dtype and np.array_equal(got, want), (name, index)
            assert checkpoint.bytes_read - before == want.nbytes


@pytest.mark.parametrize(
    ("pattern", "shape", "sizes"),
    [("o i -> i o", (6, 4), {}), ("(h d) e -> e h d", (12, 5), {"h": 3}),
     ("e (h d) -> h d e", (5, 12), {"h": 4}), ("a b c -> c (b a)", (2, 3, 4), {}),
     ("(a b) c -> (a c) b", (6, 5), {"a": 2}), ("a (b c) d -> (d b) (c a)", (2, 6, 3), {"b": 3})],
)  # fmt: skip
def test_a_rearranged_slice_reads_as_the_whole_rearranged_then_sliced(pattern, shape, sizes):
    from substrax_flax._rearrange import Pattern, Source, arrange, lazy_arrange

    rng = np.random.default_rng(0)
    tensor = rng.normal(size=shape).astype(np.float32)
    parsed = Pattern.parse(pattern, sizes)
    whole = arrange(tensor, parsed)
    lazy = lazy_arrange(Source("t", shape, tensor.dtype, lambda _, i: tensor[i].copy()), parsed)
    for _ in range(40):
        index = []
        for n in whole.shape:
            start = int(rng.integers(n))
            index.append(slice(start, int(rng.integers(start + 1, n + 1))))
        np.testing.assert_array_equal(lazy.read(tuple(index)), whole[tuple(index)])
    np.testing.assert_array_equal(arrange(whole, parsed.inverse(shape)), tensor)


def test_bad_patterns_and_key_maps_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"'a \.\.\. -> a': '\.' is not an axis name"):
        sf.Target("w", "a ... -> a")
    with pytest.raises(ValueError, match="each axis must appear once on each side"):
        sf.Target("w", "a b -> a")
    with pytest.raises(ValueError, match=r"has no axis \['z'\]"):
        sf.Target("w", "a b -> b a", {"z": 2})
    sf.save_tensors(tmp_path, {"qkv.weight": np.zeros((16, 16), np.float32)})
    with pytest.raises(TypeError, match=r"key map entry 'qkv.weight' is a variable path, a Target"):
        sf.plan_weights(lambda: _Split(nnx.Rngs(0)), source=tmp_path, key_map={"qkv.weight": 3})
