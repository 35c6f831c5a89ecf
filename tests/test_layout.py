"""Named layouts: the roles of a mesh's axes, and the rules, batch axes and strategy that follow."""

import pytest
from jax.sharding import PartitionSpec as P

from substrax.layout import LAYOUTS, Layout
from substrax.mesh import FSDPStrategy, MultiDimensionalStrategy, ShardingConfig

MESH = {"data": 2, "model": 4}


@pytest.mark.parametrize(
    ("name", "embed", "mlp", "batch", "label"),
    [
        ("dp", None, None, ("data", "model"), "dp 8"),
        ("fsdp", ("data", "model"), None, ("data", "model"), "fsdp 8"),
        ("hsdp", "model", None, ("data", "model"), "dp 2 x fsdp 4"),
        ("tp", None, "model", ("data",), "dp 2 x tp 4"),
        ("fsdp+tp", "data", "model", ("data",), "fsdp 2 x tp 4"),
        ("zero1", None, None, ("data", "model"), "zero1 dp 8"),
        ("zero2+tp", None, "model", ("data",), "zero2 dp 2 x tp 4"),
    ],
)
def test_named_layouts_give_rules_and_batch_axes(name, embed, mlp, batch, label):
    layout = Layout.named(name, MESH)
    rules = layout.param_rules
    assert (rules.embed, rules.mlp, layout.batch_axes) == (embed, mlp, batch)
    assert layout.name == name and layout.label == label
    assert layout.compute_rules.embed is None and layout.compute_rules.mlp == mlp
    assert layout.compute_rules.data == rules.data


def test_roles_follow_axis_names_before_positions():
    assert Layout.named("tp", {"model": 4, "data": 2}).tensor_axes == ("model",)
    assert Layout.named("tp", {"x": 2, "y": 4}).tensor_axes == ("y",)
    pp = Layout.named("pp", {"data": 2, "pipe": 4})
    assert pp.pipe_axes == ("pipe",) and pp.batch_axes == ("data",)
    assert dict(pp.param_rules.extra)["layers"] == "pipe"


def test_one_layout_from_a_name_a_config_and_degrees():
    config = ShardingConfig(data_parallel_size=2, tensor_parallel_size=4, fsdp_enabled=True)
    from_config = Layout.from_config(config)
    assert from_config.name == "fsdp+tp" and from_config.shape == {"pipe": 1, "data": 2, "model": 4}
    assert from_config.param_rules.resolve("embed", "mlp", shape=(8, 8), mesh=from_config.shape)
    assert from_config.sharding_config() == config
    degrees = Layout.from_degrees(fsdp=2, tp=4)
    assert degrees.shape == {"fsdp": 2, "model": 4} and degrees.name == "fsdp+tp"
    spec = degrees.param_rules.resolve("embed", "mlp", shape=(8, 8), mesh=degrees.shape).spec
    assert spec == P("fsdp", "model")


def test_strategies_for_unannotated_variables():
    assert Layout.named("dp", MESH).strategy() is None
    hsdp = Layout.named("hsdp", MESH).strategy()
    assert isinstance(hsdp, FSDPStrategy) and hsdp.axis_name == "model"
    fsdp = Layout.named("fsdp", MESH).strategy()
    assert isinstance(fsdp, MultiDimensionalStrategy)
    assert fsdp.resolve((4096, 16), MESH).spec == P(("data", "model"), None)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: Layout.named("zero3", MESH), "Unknown layout 'zero3'; choose one of dp, fsdp"),
        (lambda: Layout.named("hsdp", {"data": 8}), "needs a mesh of at least two axes"),
        (lambda: Layout(("data",), (8,)), "Mesh axis 'data' of size 8 has no role"),
        (
            lambda: Layout(("data",), (8,), data_axes=("data",), fsdp_axes=("data",)),
            "Mesh axis 'data' has two roles, 'data' and 'fsdp'",
        ),
        (lambda: Layout(("data",), (8,), tensor_axes=("model",)), "mesh axis 'model', which"),
        (lambda: Layout.from_degrees(tp=0), "The tensor degree must be a positive integer"),
        (lambda: Layout.from_degrees(dp=8, zero=3), "zero must be 0, 1 or 2 (ZeRO's stages)"),
        (lambda: Layout.named("dp", MESH).check_mesh(Layout.named("dp", {"data": 8}).make_mesh()),
         "is not the layout's"),
    ],
)  # fmt: skip
def test_bad_layouts_say_what_is_valid(call, message):
    with pytest.raises(ValueError) as info:
        call()
    assert message in str(info.value)


def test_every_named_layout_is_listed():
    assert LAYOUTS == (
        "dp", "fsdp", "hsdp", "tp", "fsdp+tp", "pp", "zero1", "zero2", "zero1+tp", "zero2+tp",
        "cp", "fsdp+cp", "ep", "fsdp+ep",
    )  # fmt: skip
    assert [Layout.named(name, MESH).name for name in LAYOUTS] == list(LAYOUTS)


def test_context_and_expert_roles_split_the_sequence_and_the_experts():
    cp = Layout.named("fsdp+cp", {"data": 2, "context": 4})
    assert (cp.context_axes, cp.fsdp_axes, cp.batch_axes, cp.label) == (
        ("context",),
        ("data",),
        ("data",),
        "fsdp 2 x cp 4",
    )
    assert cp.param_rules.as_dict()["seq"] == "context" and cp.cp == 4
    ep = Layout.named("fsdp+ep", {"data": 2, "expert": 4})
    # tokens are split over the expert axis too, but parameters are gathered over data only
    assert (ep.batch_axes, ep.gather_axes, ep.ep) == (("data", "expert"), ("data",), 4)
    rules = ep.compute_rules.as_dict()
    assert (rules["expert"], rules["embed"], rules["batch"]) == ("expert", None, ("data", "expert"))
    both = Layout.from_degrees(fsdp=2, ep=2, cp=2, tp=2)
    assert (both.axis_names, both.name) == (("fsdp", "expert", "context", "model"), "fsdp+ep+cp+tp")


def test_zero_shards_the_optimizer_state_on_a_free_dimension_that_divides():
    layout = Layout.named("zero1+tp", MESH)
    assert layout.optimizer_axes == ("data",) and Layout.named("tp", MESH).optimizer_axes == ()
    assert layout.optimizer_spec(P(None, "model"), (64, 256)) == (P("data", "model"), None)
    assert layout.optimizer_spec(P("model", None), (256, 64)) == (P("model", "data"), None)
    assert layout.optimizer_spec(P(None, None), (6, 32)) == (P(None, "data"), None)  # the larger
    spec, why = layout.optimizer_spec(P("model"), (8,))
    assert spec == P("model") and "no unsharded dimension of (8,)" in why
    planner = Layout.from_degrees(pp=16, dp=128, tp=8, zero=1)
    assert (planner.name, planner.label) == ("pp+zero1+tp", "pp 16 x zero1 dp 128 x tp 8")
