import warnings

import jax
import numpy as np
import pytest
from flax import nnx
from flax_test_models import EMBED, MLP, VOCAB, Plain, StackedTransformer, Transformer, unsharded
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import substrax_flax as sf
from substrax import ShardingWarning
from substrax.mesh import DeviceMeshManager, FSDPStrategy, MeshRules, fsdp_rules

RULES = fsdp_rules().extend(vocab="model", kv=None, layers=None)


@pytest.fixture(scope="module")
def mesh():
    return DeviceMeshManager.create_device_mesh({"data": 2, "model": 4})


def _specs(state):
    leaves = jax.tree_util.tree_leaves_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): leaf.get_value()
        for path, leaf in leaves
    }


def test_plan_resolves_flax_annotations(mesh):
    plan = sf.plan_model(lambda: Transformer(nnx.Rngs(0)), mesh, RULES)
    specs = _specs(plan.specs)
    assert specs["embed/embedding"] == P("model", None)  # vocab first, embed loses 'model'
    assert specs["blocks/0/wq"] == P("model", None, None)
    assert specs["blocks/0/wo"] == P("model", None, None)  # heads first
    assert specs["blocks/0/up/kernel"] == P("model", None)
    assert specs["blocks/0/up/bias"] == P("model")
    assert specs["head"] == P("model", None)
    row = sf.sharding_report(plan).row("blocks/0/up/kernel")
    assert row.logical_names == ("embed", "mlp")
    assert row.rule == "embed->model, mlp->model"
    assert row.bytes_total == EMBED * MLP * 4 and row.bytes_per_device == EMBED * MLP
    assert [(r.kind, r.dim, r.axes) for r in row.reasons] == [("axis_used", 1, ("model",))]


def test_plan_state_trees_match_the_model(mesh):
    plan = sf.plan_model(lambda: Transformer(nnx.Rngs(0)), mesh, RULES)
    model = plan.create()
    state = nnx.state(model)
    assert jax.tree.structure(plan.specs) == jax.tree.structure(state)
    for (path, value), sharding, abstract in zip(
        jax.tree_util.tree_leaves_with_path(state),
        jax.tree.leaves(plan.shardings),
        jax.tree.leaves(plan.abstract_state),
        strict=True,
    ):
        assert isinstance(sharding, NamedSharding)
        assert value.sharding == sharding, path
        assert abstract.shape == value.shape and abstract.dtype == value.dtype
        assert abstract.sharding == sharding


def test_flax_style_pairs_and_mesh_rules_agree(mesh):
    pairs = RULES.to_pairs()
    by_pairs = sf.get_shardings(unsharded(lambda: Transformer(nnx.Rngs(0))), mesh, list(pairs))
    by_rules = sf.get_shardings(unsharded(lambda: Transformer(nnx.Rngs(0))), mesh, RULES)
    assert jax.tree.leaves(by_pairs) == jax.tree.leaves(by_rules)


def test_older_metadata_keys_are_read(mesh):
    class Old(nnx.Module):
        def __init__(self):
            self.a = nnx.Param(np.ones((8, 4), np.float32), sharding_names=("embed", None))
            self.b = nnx.Param(np.ones((4, 8), np.float32), sharding=(None, "mlp"))

    with pytest.warns(DeprecationWarning):
        specs = _specs(sf.plan_model(Old, mesh, RULES).specs)
    assert specs == {"a": P("model", None), "b": P(None, "model")}


def test_rules_none_means_names_are_mesh_axes(mesh):
    class Direct(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(np.ones((8, 4), np.float32), out_sharding=("model", "data"))

    assert _specs(sf.plan_model(Direct, mesh).specs) == {"w": P("model", "data")}


def test_unannotated_model_follows_the_strategy(mesh):
    strategy = FSDPStrategy("model", 1, min_weight_size=32)
    plan = sf.plan_model(lambda: Plain(nnx.Rngs(0)), mesh, strategy=strategy)
    specs = _specs(plan.specs)
    assert specs["up/kernel"] == P("model", None)
    assert specs["down/kernel"] == P("model", None)
    assert specs["attn/query/kernel"] == P("model", None, None)
    assert specs["up/bias"] == P("model")
    assert specs["down/bias"] == P("model")  # (32,): 32 >= min_weight_size
    reason = sf.sharding_report(plan).row("attn/out/kernel").reasons[0]
    assert reason.kind == "below_threshold" and "below min_weight_size" in str(reason)
    # in the report's words (as its rule column), not the strategy's class name
    assert (
        str(reason).startswith("fsdp over model: ")
        and "Strategy" not in sf.sharding_report(plan).table()
    )


def test_unannotated_without_strategy_is_replicated_and_says_so(mesh):
    report = sf.sharding_report(sf.plan_model(lambda: Plain(nnx.Rngs(0)), mesh))
    row = report.row("up/kernel")
    assert row.spec == P(None, None) and row.rule == "none"
    assert [(r.kind, str(r)) for r in row.reasons] == [
        ("no_annotation", "no annotation and no strategy: replicated")
    ]
    # honest: a model left replicated on 8 devices holds 8x its share on each
    assert report.ratio_to_ideal == 8.0 and report.devices_sharded_over == 1
    assert report.ratio_over_used_axes == 1.0 and report.devices == 8
    assert report.replicated_bytes == report.bytes_total
    assert any(
        w.startswith("fully replicated variables hold 100% of the bytes") for w in report.warnings
    )


def test_stacked_layers_keep_their_layer_axis(mesh):
    plan = sf.plan_model(lambda: StackedTransformer(nnx.Rngs(0)), mesh, RULES)
    specs = _specs(plan.specs)
    assert specs["blocks/up/kernel"] == P(None, "model", None)
    assert sf.sharding_report(plan).row("blocks/up/kernel").logical_names == (
        "layers",
        "embed",
        "mlp",
    )
    on_layers = RULES.extend(layers="data")
    stacked = _specs(sf.plan_model(lambda: StackedTransformer(nnx.Rngs(0)), mesh, on_layers).specs)
    assert stacked["blocks/wq"] == P("data", "model", None, None)


def test_no_mesh_creates_an_annotated_model_on_one_device():
    model = sf.create_sharded_model(lambda: Transformer(nnx.Rngs(0)), None, RULES)
    kernel = model.blocks[0].up.kernel[...]
    assert len(kernel.sharding.device_set) == 1
    reference = unsharded(lambda: Transformer(nnx.Rngs(0)))
    np.testing.assert_array_equal(kernel, reference.blocks[0].up.kernel[...])
    plain = sf.create_sharded_model(lambda: Transformer(nnx.Rngs(0)), None)
    assert len(plain.head[...].sharding.device_set) == 1


def test_shard_model_moves_a_live_model(mesh):
    model = unsharded(lambda: Transformer(nnx.Rngs(0)))
    before = np.asarray(model.head[...])
    assert sf.shard_model(model, mesh, RULES) is model
    assert model.head[...].sharding.spec == P("model", None)
    np.testing.assert_array_equal(model.head[...], before)
    assert sf.sharding_report(model).row("head").rule == "embed->model, vocab->model"


def test_report_totals_and_warnings(mesh):
    class Big(nnx.Module):
        def __init__(self):
            self.big = nnx.Param(np.zeros((512, 1024), np.float32))
            self.sharded = nnx.Param(np.zeros((8, 4), np.float32), out_sharding=("embed", None))

    with pytest.warns(ShardingWarning, match=r"keeps 1 large one\(s\) whole .*big \(512, 1024\)"):
        report = sf.sharding_report(
            sf.plan_model(Big, mesh, RULES)
        )  # said at creation, and in the report
    assert report.bytes_total == (512 * 1024 + 32) * 4
    assert report.bytes_per_device == 512 * 1024 * 4 + 32
    assert report.devices_sharded_over == 4 and report.devices == 8
    assert report.ideal_bytes_per_device == report.bytes_total / 8
    assert report.ratio_to_ideal == pytest.approx(report.bytes_per_device * 8 / report.bytes_total)
    assert report.ratio_over_used_axes == pytest.approx(
        report.bytes_per_device * 4 / report.bytes_total
    )
    assert len(report.warnings) == 2 and report.warnings[0].startswith("big (2.00 MiB)")
    assert report.warnings[1].startswith("fully replicated variables hold 100% of the bytes")
    text = str(report)
    assert "warning: big (2.00 MiB) is fully replicated" in text
    assert "2 variables: total 2.00 MiB" in report.summary() and "ratio" in text
    assert report.summary() in report.table(full=True).splitlines()
    assert "<table>" in report._repr_html_() and "big" in report._repr_html_()


def test_sharding_report_of_a_state_and_of_abstract_values(mesh):
    model = sf.create_sharded_model(lambda: Transformer(nnx.Rngs(0)), mesh, RULES)
    report = sf.sharding_report(nnx.state(model))
    assert report.row("head").spec == P("model", None)
    assert report.row("head").bytes_per_device == EMBED * VOCAB
    plan_report = sf.sharding_report(sf.plan_model(lambda: Transformer(nnx.Rngs(0)), mesh, RULES))
    assert plan_report.bytes_per_device == report.bytes_per_device


def test_mesh_rules_object_is_reused(mesh):
    plan = sf.plan_model(lambda: Transformer(nnx.Rngs(0)), mesh, RULES)
    assert isinstance(plan.rules, MeshRules) and plan.rules == RULES
    assert repr(plan).startswith("ModelPlan(")


def test_a_pipeline_layout_on_an_unstacked_model_is_refused_with_the_page_named():
    mesh = DeviceMeshManager.create_device_mesh({"pipe": 2, "data": 4})
    with pytest.raises(ValueError, match=r"no variable of the model has a 'layers'.*docs/pipeline"):
        sf.plan_model(lambda: Transformer(nnx.Rngs(0)), mesh, layout="pp")
    plan = sf.plan_model(lambda: StackedTransformer(nnx.Rngs(0)), mesh, layout="pp")
    assert plan.shardings["blocks"]["wq"].get_value().spec[0] == "pipe"


class _WideTable(nnx.Module):
    """A 2 MiB table whose names the fsdp layout maps to no axis, and a small sharded one."""

    def __init__(self, rngs):
        init = nnx.initializers.normal()
        self.table = nnx.Param(init(rngs.params(), (1024, 512)), out_sharding=("vocab", "mlp"))
        self.proj = nnx.Param(init(rngs.params(), (64, 64)), out_sharding=("embed", "mlp"))


def test_a_large_variable_left_whole_by_a_sharding_layout_is_said_once():
    mesh = DeviceMeshManager.create_device_mesh({"data": 8})
    with pytest.warns(ShardingWarning) as record:
        sf.plan_model(lambda: _WideTable(nnx.Rngs(0)), mesh, layout="fsdp")
    assert len(record) == 1
    message = str(record[0].message)
    assert "keeps 1 large one(s) whole" in message and "table (1024, 512) (2.00 MiB" in message
    with warnings.catch_warnings():  # dp replicates everything by design: nothing to say
        warnings.simplefilter("error")
        sf.plan_model(lambda: _WideTable(nnx.Rngs(0)), mesh, layout="dp")
