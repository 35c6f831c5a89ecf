"""The eval step: metrics at the training step's layout, equal to XLA's whole-batch forward,
with the forward half of the training step's traffic."""

import dataclasses

import gpt
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax_test_models import unsharded
from jax.sharding import PartitionSpec as P

import substrax_flax as sf
from substrax.hlo import traffic_by_kind
from substrax.layout import Layout
from substrax.mesh import DeviceMeshManager

CONFIG = gpt.Config(vocab=256, d_model=64, heads=4, mlp=256, layers=2, seq=16)
BATCH = gpt.batch_at(7, 16, CONFIG.seq)


def metrics(model, batch):
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model(inputs)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    return {"loss": loss, "correct": (logits.argmax(-1) == targets).sum(), "logits": logits}


LAYOUTS = {
    "dp": lambda: Layout.named("dp", {"data": 8}),
    "fsdp": lambda: Layout.named("fsdp", {"data": 8}),
    "fsdp+tp": lambda: Layout.named("fsdp+tp", {"data": 4, "model": 2}),
    "zero1": lambda: Layout.named("zero1", {"data": 8}),
}


def _placed(layout, config=CONFIG):
    return sf.create_sharded_model(lambda: gpt.GPT(config, nnx.Rngs(0)), layout=layout)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_metrics_equal_xlas_whole_batch_forward_and_move_the_forward_half(name):
    layout = LAYOUTS[name]()
    model = _placed(layout)
    evaluate = sf.make_eval_step(metrics, sums=("correct",))
    got = evaluate(model, BATCH)
    assert evaluate.plan.path == "manual" and evaluate.plan.region_axes == layout.batch_axes
    want = nnx.jit(metrics)(model, jnp.asarray(BATCH))  # XLA partitions the whole batch
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)
    assert int(got["correct"]) == int(want["correct"])  # summed over the devices' rows
    assert got["logits"].shape == (16, CONFIG.seq, CONFIG.vocab)  # every row, in order
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
    # each parameter gathered at most as the training step gathers it (ZeRO-1's are whole:
    # its step gathers the updated shards), no gradient reduced: at most the forward half of
    # a training step's traffic, and the metrics' few bytes (an argmax over a tensor axis)
    evaluated = traffic_by_kind(evaluate.lower(model, BATCH).compile().as_text(), 8)
    optimizer = sf.create_sharded_optimizer(model, gpt.optimizer())
    step = sf.make_train_step(gpt.loss_fn)
    trained = traffic_by_kind(step.lower(model, optimizer, BATCH).compile().as_text(), 8)
    metric_bytes = 1024
    assert evaluated["all-gather"]["bytes"] <= trained["all-gather"]["bytes"] + metric_bytes
    if name in ("dp", "fsdp"):  # the gathers are the training step's forward, exactly
        assert evaluated["all-gather"]["bytes"] == trained["all-gather"]["bytes"]
    moved = sum(kind["bytes"] for kind in evaluated.values())
    assert moved <= sum(kind["bytes"] for kind in trained.values()) / 2 + metric_bytes


def test_a_plain_jit_forward_of_an_fsdp_model_moves_more_than_the_eval_step():
    model = _placed(LAYOUTS["fsdp"]())
    plain = jax.jit(lambda state, batch: metrics(nnx.merge(nnx.graphdef(model), state), batch))
    with jax.set_mesh(model.embedding[...].sharding.mesh):
        text = plain.lower(nnx.state(model), jnp.asarray(BATCH)).compile().as_text()
    theirs = sum(kind["bytes"] for kind in traffic_by_kind(text, 8).values())
    evaluate = sf.make_eval_step(metrics, sums=("correct",))
    ours = traffic_by_kind(evaluate.lower(model, BATCH).compile().as_text(), 8)
    assert sum(kind["bytes"] for kind in ours.values()) < theirs


def test_a_model_in_training_mode_draws_and_keeps_xlas_partitioning_said_in_the_plan():
    config = dataclasses.replace(CONFIG, dropout=0.5)
    model = _placed(LAYOUTS["fsdp"](), config)
    evaluate = sf.make_eval_step(metrics)
    plan = evaluate.plan_for(model, BATCH)
    assert plan.path == "xla" and "the evaluation draws random numbers" in plan.reason
    assert "model.eval()" in str(plan)
    model.eval()  # dropout off: the manual region, and the same numbers as XLA's forward
    plan = evaluate.plan_for(model, BATCH)
    assert plan.path == "manual"
    got, want = evaluate(model, BATCH), nnx.jit(metrics)(model, jnp.asarray(BATCH))
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6)


def test_the_model_is_unchanged_and_a_second_call_does_not_compile_again():
    model = _placed(LAYOUTS["fsdp"]())
    before = jax.tree.map(np.asarray, nnx.state(model))
    evaluate = sf.make_eval_step(metrics)
    first = evaluate(model, BATCH)["loss"]
    plan = evaluate.plan
    assert float(evaluate(model, BATCH)["loss"]) == float(first)
    assert evaluate.plan is plan  # the same program
    after = jax.tree.map(np.asarray, nnx.state(model))
    jax.tree.map(np.testing.assert_array_equal, before, after)


def test_a_metric_that_is_not_a_scalar_or_per_row_is_named():
    model = _placed(LAYOUTS["fsdp"]())

    def per_token(model, batch):
        return {"per_word": model(batch[:, :-1]).mean(axis=(0, 1))}  # [vocab], not [rows]

    with pytest.raises(ValueError, match=r"fn returned \['per_word'\] of shape \(256,\)"):
        sf.make_eval_step(per_token)(model, BATCH)


def test_rows_that_do_not_split_over_the_batch_axes_are_named():
    model = _placed(LAYOUTS["fsdp"]())  # the manual forward: rows over the 8 devices
    with pytest.raises(ValueError, match=r"The batch's 12 rows do not split evenly over the 8 "):
        sf.make_eval_step(metrics)(model, BATCH[:12])


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"fn": "metrics"}, "fn must be a function fn(model, batch) -> metrics"),
        ({"fn": metrics, "sums": "correct"}, "sums must be a sequence of metric names"),
    ],
)
def test_bad_arguments_say_what_is_valid(arguments, message):
    with pytest.raises(TypeError) as error:
        sf.make_eval_step(**arguments)
    assert message in str(error.value)


def test_a_mesh_without_the_plans_axes_is_the_plans_to_hold():
    model = _placed(LAYOUTS["fsdp"]())
    plan = sf.plan_model(lambda: gpt.GPT(CONFIG, nnx.Rngs(0)), layout=LAYOUTS["fsdp"]())
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    with pytest.raises(TypeError, match="plan= holds the mesh"):
        sf.make_eval_step(metrics, mesh, plan=plan)
    assert sf.make_eval_step(metrics, plan=plan).plan_for(plan.create(), BATCH).path == "manual"
    del model


@pytest.mark.parametrize(
    ("experts", "layout"),
    [
        (4, lambda: Layout.named("fsdp+ep", {"data": 2, "expert": 4})),
        (0, lambda: Layout.named("fsdp+cp", {"data": 2, "context": 4})),
    ],
    ids=["fsdp+ep", "fsdp+cp"],
)
def test_experts_and_context_layouts_evaluate_the_training_steps_loss(experts, layout):
    config = dataclasses.replace(CONFIG, moe_experts=experts)
    model = _placed(layout(), config)
    batch = gpt.next_tokens(BATCH)  # shifted before the sequence is split
    evaluate = sf.make_eval_step(lambda model, batch: {"loss": gpt.loss_fn(model, batch)})
    got = float(evaluate(model, batch)["loss"])
    assert evaluate.plan.path == "manual"
    optimizer = sf.create_sharded_optimizer(model, gpt.optimizer())
    step = sf.make_train_step(gpt.loss_fn, donate=False)
    assert got == pytest.approx(float(step(model, optimizer, batch)["loss"]), rel=1e-6)


def _one_device_generation(prompt, new_tokens, temperature, top_k, seed):
    """The reference: the same model on one device, the same buffer and keys, plain jax."""
    model = unsharded(lambda: gpt.GPT(CONFIG, nnx.Rngs(0)))
    sample = sf.sampler(temperature, top_k)
    forward = jax.jit(lambda state, tokens: nnx.merge(nnx.graphdef(model), state)(tokens))
    rows, length = prompt.shape
    tokens = np.zeros((rows, length + new_tokens), np.int32)
    tokens[:, :length] = prompt
    for i in range(new_tokens):
        logits = forward(nnx.state(model), tokens)[:, length + i - 1]
        tokens[:, length + i] = sample(logits, jax.random.fold_in(jax.random.key(seed), i))
    return tokens


@pytest.mark.parametrize("name", ["dp", "fsdp", "fsdp+tp"])
def test_generated_tokens_are_one_devices_greedy_and_sampled(name):
    """With the KV cache (the decoder has init_cache) and over the whole window."""
    model = _placed(LAYOUTS[name]())
    prompt = BATCH[:8, :6]
    for temperature, top_k in ((0.0, None), (1.0, 20)):
        want = _one_device_generation(prompt, 6, temperature, top_k, seed=3)
        for cache in (None, False):
            got = sf.generate(model, prompt, 6, temperature=temperature, top_k=top_k, seed=3,
                              cache=cache)  # fmt: skip
            np.testing.assert_array_equal(got, want)
            assert (got[:, :6] == prompt).all() and got.shape == (8, 12)


#: Each layout's key/value cache spec: rows over the batch axes, heads over the tensor axes.
CACHE_SPECS = {
    "dp": P("data", None, None, None),
    "fsdp": P("data", None, None, None),
    "fsdp+tp": P("data", None, "model", None),
}


@pytest.mark.parametrize("name", list(CACHE_SPECS))
def test_the_kv_cache_is_sharded_and_sized_as_planned(name):
    model = _placed(LAYOUTS[name]())
    step = sf.make_decode_step(model, 8, 12)
    rows = {row.path: row for row in step.rows}
    assert sorted(rows) == sorted(
        f"blocks/{i}/{v}" for i in range(2) for v in ("cache_index", "cached_key", "cached_value")
    )
    key = rows["blocks/0/cached_key"]
    assert key.logical_names == ("data", "seq", "heads", "kv") and key.spec == CACHE_SPECS[name]
    leaves = dict(_paths(step.cache))
    for path, row in rows.items():  # what each device holds is what the plan says
        assert leaves[path].sharding.spec == row.spec, path
        assert {s.data.nbytes for s in leaves[path].addressable_shards} == {row.bytes_per_device}
    whole = 8 * 12 * CONFIG.heads * CONFIG.head_dim * 4  # one layer's keys, float32
    # every device holds an eighth: rows over 8 (dp, fsdp), or rows over 4 x heads over 2
    assert key.bytes_per_device == whole // 8
    assert step.bytes_per_device == sum(row.bytes_per_device for row in rows.values())
    logits = step(model, BATCH[:8, :6])  # the prefill fills 6 positions, a step one more
    step(model, np.asarray(logits.argmax(-1))[:, None])
    index = _paths(step.cache)
    assert int(dict(index)["blocks/1/cache_index"]) == 7


class _ExplicitCacheGPT(gpt.GPT):
    """The example decoder with its cache written as an Explicit-style model writes it."""

    def init_cache(self, batch_size: int, max_length: int) -> None:
        spec = P("data", None, "model", None)  # the mesh's axes, not logical names
        for block in self.blocks:
            shape = (batch_size, max_length, *block.wk.shape[1:])
            block.cached_key = nnx.Cache(jnp.zeros(shape), out_sharding=spec)
            block.cached_value = nnx.Cache(jnp.zeros(shape), out_sharding=spec)
            block.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))


def test_a_cache_that_names_mesh_axes_is_planned_on_them_as_parameters_are():
    """The cache's names go through the parameters' resolver: mesh axes mean those axes."""
    layout, prompt = LAYOUTS["fsdp+tp"](), BATCH[:8, :4]
    model = sf.create_sharded_model(lambda: _ExplicitCacheGPT(CONFIG, nnx.Rngs(0)), layout=layout)
    step = sf.make_decode_step(model, 8, 8)
    key = next(row for row in step.rows if row.path == "blocks/0/cached_key")
    assert key.spec == CACHE_SPECS["fsdp+tp"] and key.rule == "data->data, model->model"
    np.testing.assert_array_equal(sf.generate(model, prompt, 3),
                                  sf.generate(_placed(layout), prompt, 3))  # fmt: skip


def test_a_model_written_for_auto_axes_decodes_on_a_jax_make_mesh_mesh_as_on_one_device():
    """jax.make_mesh makes Explicit axes; the decode step takes the train step's Auto twin."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    model = sf.create_sharded_model(lambda: gpt.GPT(CONFIG, nnx.Rngs(0)), mesh,
                                    layout=Layout.named("fsdp+tp", mesh))  # fmt: skip
    step = sf.make_decode_step(model, 8, 9)
    assert step.mesh_decision.value == "Auto twin of the Explicit mesh"
    prompt = BATCH[:8, :4]
    np.testing.assert_array_equal(sf.generate(model, prompt, 5),
                                  _one_device_generation(prompt, 5, 0.0, None, seed=0))  # fmt: skip


#: The stacked decoder's cache spec: its layers dimension where the layout puts the stack's.
STACKED_CACHE = {
    "fsdp": (Layout.named("fsdp", {"data": 8}), P(None, "data", None, None, None)),
    "pp x dp": (Layout.from_degrees(pp=2, dp=4), P("pipe", "data", None, None, None)),
    "pp x fsdp x tp": (Layout.from_degrees(pp=2, fsdp=2, tp=2),
                       P("pipe", "fsdp", None, "model", None)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(STACKED_CACHE))
def test_the_stacked_decoder_decodes_with_its_cache_wherever_its_layers_lie(name):
    """StackedGPT's cache is stacked like its layers (over the stages under a pipeline): the
    tokens are those of the whole-window forward on one device."""
    layout, spec = STACKED_CACHE[name]
    prompt = BATCH[:8, :4]
    model = sf.create_sharded_model(lambda: gpt.StackedGPT(CONFIG, nnx.Rngs(0)), layout=layout)
    step = sf.make_decode_step(model, 8, 7)
    key = next(row for row in step.rows if row.path == "blocks/cached_key")
    assert key.spec == spec and key.logical_names == ("layers", "data", "seq", "heads", "kv")
    one_device = sf.create_sharded_model(
        lambda: gpt.StackedGPT(CONFIG, nnx.Rngs(0)), layout=Layout.named("dp", {"data": 1})
    )
    np.testing.assert_array_equal(sf.generate(model, prompt, 3),
                                  sf.generate(one_device, prompt, 3, cache=False))  # fmt: skip


@dataclasses.dataclass
class _PlainConfig:  # eq without frozen: unhashable, as published models' configs are
    width: int = 64


def test_a_model_holding_a_plain_dataclass_config_generates_and_reuses_its_steps(monkeypatch):
    from substrax_flax import _generate

    model = _placed(LAYOUTS["fsdp"]())
    model.settings = _PlainConfig()  # hash(nnx.graphdef(model)) now raises
    prompt = BATCH[:8, :4]
    first = [sf.generate(model, prompt, 3, cache=cache) for cache in (None, False)]
    monkeypatch.setattr(_generate, "make_decode_step", None)  # a second build would fail
    monkeypatch.setattr(_generate, "make_eval_step", None)
    for cache, want in zip((None, False), first, strict=True):
        np.testing.assert_array_equal(sf.generate(model, prompt, 3, cache=cache), want)


def test_generate_reuses_its_decode_step_and_a_changed_model_needs_a_new_one(monkeypatch):
    from substrax_flax import _generate

    model = _placed(LAYOUTS["fsdp"]())
    prompt = BATCH[:8, :4]
    first = sf.generate(model, prompt, 3)
    monkeypatch.setattr(_generate, "make_decode_step", None)  # a second build would fail
    np.testing.assert_array_equal(sf.generate(model, prompt, 3), first)  # the cache reset
    step = sf.make_decode_step(model, 8, 8)
    model.scale = nnx.Param(jnp.ones(()))  # a variable added: another graph
    with pytest.raises(ValueError, match="structure changed since its decode step was made"):
        step(model, prompt)


def test_the_llama_example_decodes_with_its_cache_as_over_the_whole_window():
    """Grouped-query attention (2 key/value heads for 4) and rotary positions after the cache."""
    import llama

    config = llama.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2)  # fmt: skip
    model = sf.create_sharded_model(lambda: llama.Llama(config, nnx.Rngs(0)),
                                    layout=LAYOUTS["fsdp+tp"]())  # fmt: skip
    prompt = BATCH[:8, :5] % 128
    cached = sf.generate(model, prompt, 6, temperature=1.0, seed=1)
    np.testing.assert_array_equal(cached, sf.generate(model, prompt, 6, temperature=1.0, seed=1,
                                                      cache=False))  # fmt: skip
    step = sf.make_decode_step(model, 8, 11)
    key = next(row for row in step.rows if row.path == "layers/0/cached_key")
    assert key.shape == (8, 11, 2, 8) and key.spec == P("data", None, "model", None)


def _paths(state):
    return [("/".join(str(k) for k in path), v.get_value()) for path, v in nnx.to_flat_state(state)]


def test_bad_decode_arguments_say_what_is_valid():
    model = _placed(LAYOUTS["dp"]())
    # 6 rows over 8 devices: the axis moves to the one dimension it divides, as a parameter's
    # would, and the row says so; the step's logits are those of the same rows among 8
    uneven = sf.make_decode_step(model, 6, 10)
    key = next(row for row in uneven.rows if row.path == "blocks/0/cached_key")
    assert key.spec == P(None, None, None, "data") and key.bytes_per_device == key.bytes_total // 8
    (moved,) = [reason for reason in key.reasons if reason.kind == "moved"]
    assert moved.axes == ("data",) and "moved to dim 3 (16)" in moved.detail
    even = sf.make_decode_step(model, 8, 10)(model, BATCH[:8, :3])
    np.testing.assert_allclose(uneven(model, BATCH[:6, :3]), even[:6], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="max_length must be a positive integer, got 0"):
        sf.make_decode_step(model, 8, 0)
    step = sf.make_decode_step(model, 8, 10)
    with pytest.raises(ValueError, match=r"tokens must be int\[8, length\] .* got \[4, 2\]"):
        step(model, BATCH[:4, :2])
    windowed = _placed(LAYOUTS["dp"](), dataclasses.replace(CONFIG, layers=1))
    windowed.init_cache = None  # a model without a cache
    with pytest.raises(TypeError, match=r"needs a model with init_cache\(batch_size, max_len"):
        sf.make_decode_step(windowed, 8, 10)


def test_bad_generation_arguments_say_what_is_valid():
    model = _placed(LAYOUTS["dp"]())
    with pytest.raises(ValueError, match=r"prompt must be int token rows \[rows, length\], got"):
        sf.generate(model, BATCH[0], 2)
    with pytest.raises(ValueError, match="new_tokens must be a positive integer, got 0"):
        sf.generate(model, BATCH[:8, :4], 0)
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or positive, got -1"):
        sf.sampler(-1)
    with pytest.raises(ValueError, match="top_k must be a positive integer or None, got 0"):
        sf.sampler(1.0, 0)


def test_generation_in_a_multi_process_run_is_refused_with_the_alternative(monkeypatch):
    model = _placed(LAYOUTS["dp"]())
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match=r"generate runs in one process .* make_eval_step"):
        sf.generate(model, BATCH[:8, :4], 2)
