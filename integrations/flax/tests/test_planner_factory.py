"""The planner on a user's own Flax NNX model: leaves, the CLI's --factory, and its warnings."""

import json
import warnings

import jax
import numpy as np
import pytest
from flax import nnx
from flax_test_models import StackedTransformer, Transformer

import substrax_flax as sf
import substrax_flax._leaves as leaves_module
from substrax import ShardingWarning
from substrax import plan as plan_cli
from substrax.mesh import DeviceMeshManager, MeshRules
from substrax.planner import Hardware, Layout, Workload, config_from_leaves, evaluate


def _factory():
    return StackedTransformer(nnx.Rngs(0))


def test_planner_and_adapter_agree_on_a_users_model():
    leaves = sf.planner_leaves(_factory)
    config = config_from_leaves(leaves)
    assert (config.layers, config.d_model, config.heads, config.vocab) == (4, 32, 4, 64)
    layout = Layout(fsdp=4, tp=2)
    candidate = evaluate(config, leaves, layout, Workload(batch_tokens=64, seq=8),
                         Hardware(memory_bytes=2**30))  # fmt: skip
    mesh = DeviceMeshManager.create_device_mesh(layout.mesh)
    rules = MeshRules().extend(kv=None, **{k: v or None for k, v in layout.rules().items()})
    model = sf.create_sharded_model(_factory, mesh, rules)
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


def test_slow_unstacked_models_get_a_warning(monkeypatch):
    monkeypatch.setattr(leaves_module, "SLOW_EVAL_SHAPE_SECONDS", 0.0)
    with pytest.warns(ShardingWarning, match="Stack the layers with nnx.vmap"):
        sf.planner_leaves(lambda: Transformer(nnx.Rngs(0)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sf.planner_leaves(_factory)  # stacked: no warning
