"""The planner on a user's own Flax NNX model: leaves, the CLI's --factory, and its warnings."""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from flax_test_models import EMBED, Plain, StackedTransformer

import substrax_flax as sf
from substrax import ShardingWarning
from substrax.layout import LAYOUTS, Layout
from substrax.planner import Hardware, Workload, config_from_leaves, evaluate
from substrax_flax import planner as plan_cli


def _factory():
    return StackedTransformer(nnx.Rngs(0))


def test_planner_and_adapter_agree_on_a_users_model():
    leaves = plan_cli.model_leaves(_factory)
    config = config_from_leaves(leaves)
    assert (config.layers, config.d_model, config.heads, config.vocab) == (4, 32, 4, 64)
    layout = Layout.from_degrees(fsdp=4, tp=2)
    candidate = evaluate(config, leaves, layout, Workload(batch_tokens=64, seq=8),
                         Hardware(memory_bytes=2**30))  # fmt: skip
    model = sf.create_sharded_model(_factory, layout=layout)
    report = sf.sharding_report(nnx.state(model, nnx.Param))
    assert candidate.params_per_device * 4 == report.bytes_per_device
    total = sum(np.prod(a.shape) for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert sum(np.prod(leaf.shape) for leaf in leaves) == total


def test_command_line_plans_a_factory(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_model.py").write_text(
        "from flax import nnx\nfrom flax_test_models import StackedTransformer\n\n\n"
        "def make():\n    return StackedTransformer(nnx.Rngs(0))\n"
    )
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "plan.json"
    status = plan_cli.main(["--factory", "my_model:make", "--devices", "8", "--memory", "1GB",
                            "--batch-tokens", "512", "--seq", "8", "--json", str(out)])  # fmt: skip
    assert status == 0, capsys.readouterr().err
    report = json.loads(out.read_text())
    assert report["model"] == "custom" and report["candidates"][0]["fits"]
    assert plan_cli.main(["--factory", "my_model", "--devices", "8", "--memory", "1GB",
                          "--batch-tokens", "512", "--seq", "8"]) == 2  # fmt: skip
    assert "expected module:function" in capsys.readouterr().err


MESHES = {"pp": {"pipe": 2, "data": 4}}


@pytest.mark.parametrize("name", LAYOUTS)
def test_planner_and_adapter_agree_on_every_leaf_of_every_named_layout(name):
    """The planner's per-leaf specs are the adapter's, through the one resolver."""
    layout = Layout.named(name, MESHES.get(name, {"data": 2, "model": 4}))
    leaves = plan_cli.model_leaves(_factory)
    workload, hardware = Workload(batch_tokens=64, seq=8), Hardware(memory_bytes=2**30)
    candidate = evaluate(config_from_leaves(leaves), leaves, layout, workload, hardware)
    plan = sf.plan_model(_factory, layout=layout)
    adapter = {row.path: tuple(row.spec) for row in plan.rows}
    assert candidate.leaves, "the planner saw no leaves"
    for leaf in candidate.leaves:
        planned = tuple(axes[0] if len(axes) == 1 else (axes or None) for axes in leaf.spec)
        assert planned == adapter[leaf.path], leaf.path
    # parameters whole on every device; context and expert axes shard them as FSDP axes do
    replicated = name in ("dp", "zero1", "zero2")
    assert any(any(axes) for leaf in candidate.leaves for axes in leaf.spec) != replicated


@pytest.mark.parametrize("name", ["fsdp", "fsdp+tp"])
def test_an_unannotated_model_plans_as_it_shards(name):
    """No logical names: the planner runs the layout's strategy, as the adapter does."""
    layout = Layout.named(name, {"data": 2, "model": 4})
    with pytest.warns(ShardingWarning, match=r"names no 'embed' dimension, so the planner takes"):
        leaves = plan_cli.model_leaves(lambda: Plain(nnx.Rngs(0)))
    assert all(set(leaf.names) == {None} for leaf in leaves) and leaves[0].layer
    config = config_from_leaves(leaves)
    assert config.d_model == EMBED  # the commonest dimension of its matrices
    workload, hardware = Workload(batch_tokens=64, seq=8), Hardware(memory_bytes=2**30)
    candidate = evaluate(config, leaves, layout, workload, hardware)
    rows = {row.path: row for row in sf.plan_model(lambda: Plain(nnx.Rngs(0)), layout=layout).rows}
    for leaf in candidate.leaves:  # bytes per leaf equal the adapter's
        assert leaf.params_per_device * 4 == rows[leaf.path].bytes_per_device, leaf.path
    assert any(any(axes) for leaf in candidate.leaves for axes in leaf.spec)


@pytest.mark.parametrize("name", ["tp", "fsdp+tp", "zero1+tp"])
def test_planner_and_adapter_agree_where_an_axis_moves(name):
    """4 heads on a tensor axis of 8: the adapter moves the axis to another dimension (the
    resolver's fourth rule) and the planner estimates the array as it is stored."""
    layout = Layout.named(name, {"data": 1, "model": 8})
    leaves = plan_cli.model_leaves(_factory)
    workload, hardware = Workload(batch_tokens=64, seq=8), Hardware(memory_bytes=2**30)
    candidate = evaluate(config_from_leaves(leaves), leaves, layout, workload, hardware)
    rows = {row.path: row for row in sf.plan_model(_factory, layout=layout).rows}
    moved = [path for path, row in rows.items() if any(r.kind == "moved" for r in row.reasons)]
    assert "blocks/wq" in moved, moved
    for leaf in candidate.leaves:
        planned = tuple(axes[0] if len(axes) == 1 else (axes or None) for axes in leaf.spec)
        assert planned == tuple(rows[leaf.path].spec), leaf.path
        assert leaf.params_per_device * 4 == rows[leaf.path].bytes_per_device, leaf.path
