import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from substrax.mesh import (
    MeshRules,
    Reason,
    create_named_sharding,
    data_parallel_rules,
    fsdp_rules,
    partition_spec_for_names,
)


def test_call_looks_up_each_name():
    rules = MeshRules(data="data", embed="model")
    assert rules("data", "embed", "mlp", None) == ("data", "model", None, None)


def test_rules_are_frozen_and_hashable():
    rules = MeshRules(data="data", extra={"vocab": "model"})
    assert hash(rules) == hash(MeshRules(data="data", extra=[("vocab", "model")]))
    assert {rules: 1}[MeshRules(data="data", extra={"vocab": "model"})] == 1
    with pytest.raises(AttributeError):
        rules.data = "x"


def test_fields_are_keyword_only():
    with pytest.raises(TypeError):
        MeshRules("data")


def test_extend_adds_names_beyond_the_four_fields():
    rules = fsdp_rules().extend(vocab="model", kv=None, layers=None, seq=None, experts="data")
    assert rules.logical_names == (
        "data",
        "embed",
        "mlp",
        "heads",
        "experts",
        "kv",
        "layers",
        "seq",
        "vocab",
    )
    assert partition_spec_for_names(rules, "vocab", "kv") == P("model", None)
    assert rules.extend(embed=None).embed is None


def test_tuple_rule_shards_over_several_axes():
    rules = MeshRules(data=("data", "model"))
    assert partition_spec_for_names(rules, "data", None) == P(("data", "model"), None)


def test_flax_pairs_round_trip():
    pairs = [("data", "data"), ("embed", "model"), ("vocab", ("data", "model")), ("kv", None)]
    rules = MeshRules.from_pairs(pairs)
    assert rules.embed == "model"
    assert dict(rules.to_pairs()) == {
        "data": "data",
        "embed": "model",
        "mlp": None,
        "heads": None,
        "kv": None,
        "vocab": ("data", "model"),
    }
    assert MeshRules.from_pairs(rules.to_pairs()) == rules


def test_first_dimension_keeps_a_shared_mesh_axis():
    rules = fsdp_rules()
    assert partition_spec_for_names(rules, "embed", "mlp") == P("model", None)
    assert partition_spec_for_names(rules, "mlp", "embed") == P("model", None)
    resolved = rules.resolve("embed", "mlp")
    assert resolved.requested == (("model",), ("model",))
    assert resolved.reasons == (
        Reason("axis_used", 1, "mlp", ("model",), "mesh axes ('model',) already shard an "
               "earlier dimension"),
    )  # fmt: skip


def test_resolve_keeps_the_longest_divisible_prefix_and_frees_the_rest(mesh_2x4):
    rules = MeshRules(embed=("model", "data"), mlp="data")
    # dim 0 (12) divides model (4) but not model x data (8): data is left out, and stays free
    resolved = rules.resolve("embed", "mlp", shape=(12, 6), mesh=mesh_2x4)
    assert resolved.spec == P("model", "data")
    assert [(r.kind, r.dim, r.axes) for r in resolved.reasons] == [("indivisible", 0, ("data",))]
    assert str(resolved.reasons[0]).startswith("dim 0 (embed): 12 is not divisible by mesh axes")


def test_resolve_replicates_unknown_names_only_when_asked():
    rules = fsdp_rules()
    with pytest.raises(ValueError, match="Unknown logical axis name 'vocab'"):
        rules.resolve("vocab", "embed")
    resolved = rules.resolve("vocab", "embed", unknown_names="replicate")
    assert resolved.spec == P(None, "model")
    assert resolved.of_kind("unknown_name")[0].logical_name == "vocab"


def test_gathered_rules_drop_the_fsdp_axes_but_keep_the_batchs():
    rules = MeshRules(data=("data", "model"), embed=("data", "model"), mlp="tensor")
    gathered = rules.gathered_over(("data", "model"))
    assert gathered.data == ("data", "model") and gathered.embed is None
    assert gathered.mlp == "tensor"


def test_tuple_rule_loses_only_the_used_axes():
    rules = MeshRules(data="data", embed=("data", "model"))
    assert partition_spec_for_names(rules, "data", "embed") == P("data", "model")


def test_none_is_a_replicated_dimension():
    assert partition_spec_for_names(fsdp_rules(), None, "embed") == P(None, "model")
    assert partition_spec_for_names(fsdp_rules()) == P()


def test_data_parallel_rules_map_only_data():
    rules = data_parallel_rules("batch_axis")
    assert rules("data", "embed", "mlp", "heads") == ("batch_axis", None, None, None)


def test_fsdp_rules_map_weights_to_the_model_axis():
    rules = fsdp_rules(data_axis="d", model_axis="m")
    assert rules("data", "embed", "mlp", "heads") == ("d", "m", "m", "m")


def test_validate_accepts_rules_whose_axes_exist(mesh_2x4):
    assert fsdp_rules().validate(mesh_2x4) == fsdp_rules()


def test_create_named_sharding(mesh_2x4):
    sharding = create_named_sharding(mesh_2x4, "data", None)
    assert isinstance(sharding, NamedSharding)
    assert sharding.spec == P("data", None)
    assert create_named_sharding(mesh_2x4).spec == P()
    assert create_named_sharding(mesh_2x4, ("data", "model")).spec == P(("data", "model"))
    x = jax.device_put(np.ones((8, 4)), create_named_sharding(mesh_2x4, ("data", "model")))
    assert x.addressable_shards[0].data.shape == (1, 4)


def test_a_tuple_entry_asks_for_each_names_axes_once():
    rules = MeshRules(data=("data", "model"), embed="model")
    resolved = rules.resolve(("data", "embed"), None, shape=(16, 4), mesh={"data": 2, "model": 4})
    assert resolved.spec == P(("data", "model"), None)
    assert resolved.requested == (("data", "model"), ())


def test_move_left_out_puts_an_axis_on_the_largest_free_dimension_it_divides():
    rules = MeshRules(data="fsdp").extend(expert="fsdp")
    sizes = {"fsdp": 8, "tp": 2}
    resolution = rules.resolve("expert", None, None, shape=(4, 24, 32), mesh=sizes)
    assert resolution.spec == P(None, None, None)  # 4 experts do not divide 8
    moved = resolution.move_left_out((4, 24, 32), sizes)
    assert moved.spec == P(None, None, "fsdp") and moved.moved_axes == ("fsdp",)
    (reason,) = moved.reasons
    assert (reason.kind, reason.dim, reason.logical_name) == ("moved", 0, "expert")
    assert "moved to dim 2 (32), now sharded fsdp" in reason.detail
    # no free dimension divides: a sharded one takes it next to its own axes
    tp = rules.extend(embed="tp").resolve("expert", "embed", shape=(4, 32), mesh=sizes)
    assert tp.move_left_out((4, 32), sizes).spec == P(None, ("tp", "fsdp"))
    # nowhere to go: the reason stays indivisible; a name in `stay` never moves
    stuck = rules.resolve("expert", None, shape=(4, 6), mesh=sizes).move_left_out((4, 6), sizes)
    assert [r.kind for r in stuck.reasons] == ["indivisible"] and stuck.moved_axes == ()
    kept = resolution.move_left_out((4, 24, 32), sizes, stay=("expert",))
    assert kept == resolution
