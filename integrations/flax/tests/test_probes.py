"""substrax traces a model without jax's walk of the trace on each probe of a tracer's sharding."""

import threading

import gpt
import jax
import numpy as np
import pytest
from flax import nnx
from jax._src import core
from jax._src.interpreters import partial_eval

import substrax_flax as sf
from substrax_flax import _probes
from substrax_flax.planner import model_leaves

CONFIG = gpt.Config(vocab=64, d_model=16, heads=2, mlp=32, layers=2, seq=8, dropout=0.1)


def factory():
    return gpt.GPT(CONFIG, nnx.Rngs(0))


@pytest.fixture
def walks(monkeypatch):
    """How many times jax walked a trace for a tracer's origin (a list; its length counts)."""
    calls = []
    walk = partial_eval.JaxprStackFrame.find_progenitors

    def counted(self, tracer):
        calls.append(tracer)
        return walk(self, tracer)

    monkeypatch.setattr(partial_eval.JaxprStackFrame, "find_progenitors", counted)
    return calls


def test_this_jax_walks_the_trace_for_each_probe_outside_substrax(walks):
    """The workaround's reason: remove :mod:`substrax_flax._probes` once this fails."""
    assert _probes._SLOW is core.Tracer.__dict__["sharding"]
    with nnx.use_eager_sharding(False):
        nnx.eval_shape(factory)
    assert len(walks) >= 2 * CONFIG.layers  # one walk per Rngs draw at least


def test_planning_creating_stepping_and_decoding_a_dropout_model_walk_no_trace(walks):
    mesh = jax.make_mesh((8,), ("data",))
    plan = sf.plan_model(factory, mesh, layout="fsdp")
    model = plan.create()
    optimizer = sf.create_sharded_optimizer(model, gpt.optimizer())
    step = sf.make_train_step(gpt.loss_fn)
    batch = np.zeros((8, CONFIG.seq + 1), np.int32)
    assert np.isfinite(float(step(model, optimizer, batch)["loss"]))
    assert step.plan.draws is not None  # the step traced dropout's draws
    model.eval()
    sf.make_eval_step(gpt.loss_fn)(model, batch)
    decode = sf.make_decode_step(model, 8, CONFIG.seq)  # traces init_cache, then each call
    assert decode(model, batch[:, :4]).shape == (8, CONFIG.vocab)
    model_leaves(factory)
    assert walks == []
    assert core.Tracer.__dict__["sharding"] is _probes._SLOW  # restored after each block


def test_the_cheap_probe_is_an_attribute_error_and_nested_blocks_keep_it():
    def probe(x):
        with pytest.raises(AttributeError, match="'sharding' attribute is not available"):
            x.sharding  # noqa: B018
        return getattr(x, "sharding", "missing")

    with _probes.cheap_sharding_probes():
        with _probes.cheap_sharding_probes():
            assert core.Tracer.__dict__["sharding"] is _probes._CHEAP
        assert core.Tracer.__dict__["sharding"] is _probes._CHEAP  # the outer block's still
        out = []
        jax.make_jaxpr(lambda x: out.append(probe(x)) or x)(1.0)
        assert out == ["missing"]
    assert core.Tracer.__dict__["sharding"] is _probes._SLOW


def test_blocks_in_two_threads_restore_the_probe_when_the_last_ends():
    inside, release = threading.Event(), threading.Event()

    def hold():
        with _probes.cheap_sharding_probes():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    inside.wait(10)
    with _probes.cheap_sharding_probes():
        pass
    assert core.Tracer.__dict__["sharding"] is _probes._CHEAP  # the other thread's block
    release.set()
    thread.join(10)
    assert core.Tracer.__dict__["sharding"] is _probes._SLOW
