"""The public API matches the reference and every public name is documented Google-style."""

import inspect

import pytest
from docstring_checks import check_google_docstring, public_callables

import substrax.mesh as mesh_module

# name -> {method: signature string} as the reference lists them.
REFERENCE = {
    "DeviceMeshManager": {
        "create_device_mesh": "(mesh_shape, devices=None, *, axis_types=None)",
        "create_data_parallel_mesh": "(num_devices=None)",
        "create_model_parallel_mesh": "(num_devices)",
        "create_hybrid_mesh": "(data_parallel_size, model_parallel_size)",
        "get_mesh_info": "(mesh)",
    },
    "MeshRules": {
        "__init__": "(self, *, data=None, embed=None, mlp=None, heads=None, extra=())",
        "__call__": "(self, *keys)",
    },
    "DataParallelStrategy": {
        "__init__": "(self, axis_name, mesh_axis)",
        "get_partition_spec": "(self, tensor_shape)",
        "apply_sharding": "(self, array, mesh)",
    },
    "FSDPStrategy": {
        # keyword-only additions (issues 12, 24): shard="largest", opt-in, and min_elements;
        # the reference's positional signature and default behaviour are unchanged
        "__init__": (
            "(self, axis_name, mesh_axis, min_weight_size=1024, *, shard='first', min_elements=0)"
        ),
        "should_shard_weight": "(self, weight)",
        "get_partition_spec": "(self, tensor_shape)",
        "get_gradient_partition_spec": "(self, tensor_shape)",
        "apply_sharding": "(self, array, mesh)",
    },
    "MultiDimensionalStrategy": {
        "__init__": "(self, strategies, config)",
        "get_combined_partition_spec": "(self, tensor_name, tensor_shape)",
        "resolve_sharding_conflicts": "(self, tensor_name, proposed_specs)",
    },
    "ParallelismConfig": {
        "__init__": "(self, mesh_shape, mesh_axis_names, sharding_config)",
        "is_valid": "(self)",
        "from_sharding_config": "(config)",
    },
    "PipelineParallelStrategy": {
        "__init__": "(self, axis_name, mesh_axis, num_stages)",
        "assign_layers_to_stages": "(self, num_layers)",
        "get_partition_spec": "(self, tensor_shape)",
        "get_forward_communication_pattern": "(self)",
        "get_backward_communication_pattern": "(self)",
        "apply_sharding": "(self, array, mesh)",
    },
    "ShardingConfig": {
        "__init__": (
            "(self, data_parallel_size=1, tensor_parallel_size=1, pipeline_parallel_size=1, "
            "fsdp_enabled=False, fsdp_min_weight_size=1024)"
        ),
        "get_total_device_count": "(self)",
        "from_device_count": "(device_count)",
    },
    "ShardingStrategy": {
        "__init__": "(self, axis_name, mesh_axis)",
        "get_partition_spec": "(self, tensor_shape)",
        "apply_sharding": "(self, array, mesh)",
    },
    "TensorParallelStrategy": {
        "__init__": "(self, axis_name, mesh_axis, shard_dimension=None)",
        "get_partition_spec": "(self, tensor_shape)",
        "get_linear_weight_spec": "(self)",
        "get_attention_qkv_spec": "(self)",
        "get_attention_output_spec": "(self)",
        "apply_sharding": "(self, array, mesh)",
    },
    "create_named_sharding": "(mesh, *axis_names)",
    "data_parallel_rules": "(data_axis='data')",
    "fsdp_rules": "(data_axis='data', model_axis='model')",
    "partition_spec_for_names": "(rules, *logical_names)",
}

STRATEGY_BASES = (
    "DataParallelStrategy",
    "FSDPStrategy",
    "PipelineParallelStrategy",
    "TensorParallelStrategy",
)


def _plain(signature):
    return str(
        signature.replace(
            return_annotation=inspect.Signature.empty,
            parameters=[
                p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()
            ],
        )
    )


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_reference_names_and_signatures(name):
    assert name in mesh_module.__all__
    obj = getattr(mesh_module, name)
    expected = REFERENCE[name]
    if isinstance(expected, str):
        assert _plain(inspect.signature(obj)) == expected
        return
    for method, signature in expected.items():
        assert _plain(inspect.signature(getattr(obj, method))) == signature, method


@pytest.mark.parametrize("name", STRATEGY_BASES)
def test_strategies_derive_from_sharding_strategy(name):
    assert issubclass(getattr(mesh_module, name), mesh_module.ShardingStrategy)


def test_abstract_methods():
    assert mesh_module.ShardingStrategy.__abstractmethods__ == {
        "get_partition_spec",
        "apply_sharding",
    }


@pytest.mark.parametrize(
    ("name", "obj"),
    list(public_callables(mesh_module)),
    ids=lambda v: v if isinstance(v, str) else getattr(v, "__qualname__", type(v).__name__),
)
def test_every_public_name_has_a_google_docstring(name, obj):
    check_google_docstring(name, obj)


@pytest.mark.parametrize("package", ["substrax.mesh", "substrax.spmd", "substrax.pipeline"])
def test_lazy_packages_export_exactly_their_listed_names(package):
    """A package's ``TYPE_CHECKING`` block (what type checkers and the API reference read) is
    what it exports on first use: the same names as ``__all__``, each its module's object."""
    import importlib

    from substrax import _lazy

    module = importlib.import_module(package)
    listed = _lazy._re_exports(module.__file__)
    assert set(listed) == set(module.__all__)
    for name, (source, original) in listed.items():
        assert getattr(module, name) is getattr(importlib.import_module(source), original)
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match=rf"module '{package}' has no attribute 'nonesuch'"):
        module.nonesuch  # noqa: B018
    names: dict = {}
    exec(f"from {package} import *", names)
    assert set(module.__all__) <= set(names)


def test_a_lazy_package_without_listed_names_is_refused(tmp_path):
    from substrax import _lazy

    init = tmp_path / "__init__.py"
    init.write_text("from substrax.mesh._resolve import as_axes as as_axes\n")
    with pytest.raises(ValueError, match="lists no re-exports under 'if TYPE_CHECKING:'"):
        _lazy.attach("somepkg", str(init))
