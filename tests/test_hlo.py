import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from substrax.hlo import (
    KINDS,
    Collective,
    collectives,
    compiled_flops,
    conditional_branches,
    dot_flops,
    loop_runs,
    traffic_by_kind,
)


def _hlo(f, *args):
    return jax.jit(f).lower(*args).compile().as_text()


def test_psum_in_shard_map_is_one_all_reduce_of_known_bytes(mesh_2x4):
    f = jax.shard_map(
        lambda x: jax.lax.psum(x, "model"),
        mesh=mesh_2x4,
        in_specs=P("data", "model"),
        out_specs=P("data"),
    )
    ops = collectives(_hlo(f, jnp.ones((4, 1024), jnp.float32)))
    # Each device holds a (2, 256) float32 block: 2048 bytes, summed over groups of 4.
    assert ops == [
        Collective("all-reduce", ops[0].computation, 2048, 4, 2 * 2048 * 3 / 4, 1, (0, 1, 2, 3))
    ]
    assert ops[0].axes({"data": 2, "model": 4}) == ("model",)


def test_all_gather_traffic_by_kind(mesh_2x4):
    x = jax.device_put(jnp.ones((8, 64)), NamedSharding(mesh_2x4, P(("data", "model"))))
    hlo = _hlo(lambda x: jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh_2x4, P())), x)
    table = traffic_by_kind(hlo)
    assert set(table) == set(KINDS)
    gathered = 8 * 64 * 4
    assert table["all-gather"]["count"] >= 1
    assert table["all-gather"]["bytes"] >= gathered * 7 / 8 - 1e-6
    assert table["all-reduce"] == {"count": 0, "bytes": 0.0}


def test_collective_permute_and_loop_bodies(mesh_2x4):
    def ring(x):
        def body(_, x):
            return jax.lax.ppermute(x, "model", [(i, (i + 1) % 4) for i in range(4)])

        return jax.lax.fori_loop(0, 3, body, x)

    f = jax.shard_map(
        ring, mesh=mesh_2x4, in_specs=P("data", "model"), out_specs=P("data", "model")
    )
    ops = collectives(_hlo(f, jnp.ones((2, 16), jnp.float32)))
    assert [op.kind for op in ops] == ["collective-permute"]
    assert ops[0].traffic_bytes == ops[0].result_bytes == 4 * 4
    assert ops[0].computation != "main"  # inside the loop body, named as such
    assert ops[0].runs == 3  # the fori_loop's trip count
    once, runs = (traffic_by_kind(_hlo(f, jnp.ones((2, 16))), trips=t) for t in (False, True))
    assert runs["collective-permute"] == {
        "count": 3,
        "bytes": 3 * once["collective-permute"]["bytes"],
    }


def test_nested_loops_multiply_their_trip_counts(mesh_2x4):
    def rings(x):
        def inner(_, x):
            return jax.lax.ppermute(x, "model", [(i, (i + 1) % 4) for i in range(4)])

        return jax.lax.fori_loop(0, 2, lambda _, x: jax.lax.fori_loop(0, 5, inner, x), x)

    f = jax.shard_map(
        rings, mesh=mesh_2x4, in_specs=P("data", "model"), out_specs=P("data", "model")
    )
    text = _hlo(f, jnp.ones((2, 16), jnp.float32))
    (op,) = collectives(text)
    assert op.runs == 10
    assert sorted(loop_runs(text).values()) == [2, 10]


def test_text_formats_of_replica_groups():
    lines = [
        "ENTRY %main (p: f32[4]) -> f32[4] {",
        "  %a = f32[16]{0} all-gather(f32[4]{0} %p), replica_groups=[2,4]<=[8], dimensions={0}",
        "  %b = bf16[8]{0} all-reduce(bf16[8]{0} %p), replica_groups={{0,1},{2,3}}, to_apply=%s",
        "  %c = f32[2]{0} reduce-scatter(f32[8]{0} %p), replica_groups=mesh['x'=2,'y'=4] {'y'}",
        "  %d = (f32[4]{0}, f32[16]{0}) all-gather-start(f32[4]{0} %p), replica_groups=[2,4]<=[8]",
        "  %f = f32[8]{0} all-reduce(f32[8]{0} %p), replica_groups=mesh['x'=4,'y'=2], "
        "device_ids=([2,4]T(1,0)) {'x'}, to_apply=%s",
        "  %e = f32[16]{0} all-gather-done(%d)",
        "}",
    ]
    ops = collectives("\n".join(lines))
    assert [(op.kind, op.result_bytes, op.group_size) for op in ops] == [
        ("all-gather", 64, 4),
        ("all-reduce", 16, 2),
        ("reduce-scatter", 8, 4),
        ("all-gather", 64, 4),
        ("all-reduce", 32, 4),  # the axes after a device order
    ]
    assert [op.traffic_bytes for op in ops] == [48.0, 16.0, 24.0, 48.0, 48.0]
    assert {op.computation for op in ops} == {"main"}
    assert [op.group for op in ops] == [(0, 1, 2, 3), (0, 1), (0, 1, 2, 3), (0, 1, 2, 3),
                                        (0, 1, 2, 3)]  # fmt: skip
    # the ids are the program's devices: on a program mesh {"a": 2, "b": 4}, 0-3 vary b only
    assert ops[4].axes({"a": 2, "b": 4}) == ("b",) and ops[1].axes({"a": 4, "b": 2}) == ("b",)
    transposed = "replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%s"
    (op,) = collectives(f"ENTRY %m {{\n  %g = f32[8]{{0}} all-reduce(%p), {transposed}\n}}")
    assert op.group == (0, 2, 4, 6) and op.axes({"a": 4, "b": 2}) == ("a",)


def test_tpu_fused_reduce_scatter_counts_as_one():
    """XLA:TPU's ``all-reduce-scatter`` fusion: an all-reduce and its slice are a reduce-scatter."""
    text = "\n".join([
        "%all-reduce-scatter (input: f32[32,4]) -> f32[8,4] {",
        "  %ar = f32[32,4]{1,0} all-reduce(%input), replica_groups={{0,1,2,3}}, to_apply=%s",
        "  ROOT %ds = f32[8,4]{1,0} dynamic-slice(%ar, %i, %j), dynamic_slice_sizes={8,4}",
        "}",
        "ENTRY %main (p: f32[32,4]) -> f32[8,4] {",
        "  %b = f32[32,4]{1,0} all-reduce(%p), replica_groups={{0,1,2,3}}, to_apply=%s",
        "  ROOT %f = f32[8,4]{1,0} fusion(%p), kind=kCustom, calls=%all-reduce-scatter",
        "}",
    ])  # fmt: skip
    fused, whole = collectives(text)
    assert (fused.kind, fused.result_bytes, fused.traffic_bytes) == ("reduce-scatter", 128, 384.0)
    assert (whole.kind, whole.traffic_bytes) == ("all-reduce", 768.0)  # a real all-reduce


def _jax_011_groups(*axes):
    refs = ", ".join(f'#stablehlo.axis_ref<name = "{a}">' for a in axes)
    return f"replica_groups = #stablehlo.replica_group_mesh_axes<mesh = @mesh_0, axes = [{refs}]>"


# Collectives as jax 0.11.2 lowers them (seen on the lent GPU machine's jax): groups named by
# the mesh axes they span, where jax 0.10 lists the device ids.
JAX_011_LOWERED = f"""
  sdy.mesh @mesh_0 = <["data"=2, "model"=4]> {{stablehlo.mesh = {{axes = []}}}}
  func.func public @main(%arg0: tensor<4x1024xbf16>) -> (tensor<4x1024xbf16>) {{
      %1 = "stablehlo.all_gather"(%arg1) <{{all_gather_dim = 1 : i64, {_jax_011_groups("model")},
        use_global_device_ids}}> : (tensor<2x256xbf16>) -> tensor<2x1024xbf16>
      %2 = "stablehlo.reduce_scatter"(%1) <{{{_jax_011_groups("model")}, scatter_dimension = 1}}>({{
      }}) : (tensor<2x1024xbf16>) -> tensor<2x256xbf16>
      %3 = "stablehlo.all_reduce"(%2) <{{{_jax_011_groups("data", "model")}}}> ({{
      }}) : (tensor<2x256xbf16>) -> tensor<2x256xbf16>
"""


def test_stablehlo_groups_named_by_mesh_axes_have_those_axes_size():
    ops = collectives(JAX_011_LOWERED)
    assert [(op.kind, op.result_bytes, op.group_size) for op in ops] == [
        ("all-gather", 4096, 4), ("reduce-scatter", 1024, 4), ("all-reduce", 1024, 8)
    ]  # fmt: skip


def test_lowered_stablehlo_keeps_the_dtype_the_program_asks_for(mesh_2x4):
    def gather_and_scatter(x):
        full = jax.lax.all_gather(x, "model", axis=1, tiled=True)  # (2, 1024) per device
        return jax.lax.psum(jax.lax.psum_scatter(full, "model", scatter_dimension=1, tiled=True),
                            "data")  # fmt: skip

    f = jax.jit(
        jax.shard_map(
            gather_and_scatter,
            mesh=mesh_2x4,
            in_specs=P("data", "model"),
            out_specs=P("data", "model"),
            check_vma=False,
        )
    )
    lowered = f.lower(jnp.ones((4, 1024), jnp.bfloat16))
    full = 2 * 1024 * 2  # bf16 bytes of the gathered block
    ops = collectives(lowered.as_text())
    assert [(op.kind, op.result_bytes, op.group_size) for op in ops] == [
        ("all-gather", full, 4), ("reduce-scatter", full // 4, 4), ("all-reduce", full // 4, 2)
    ]  # fmt: skip
    assert ops[0].traffic_bytes == full * 3 / 4 and ops[1].traffic_bytes == full * 3 / 4
    # XLA's CPU compiler widens the bf16 collectives to f32: twice the bytes once compiled
    compiled = traffic_by_kind(lowered.compile().as_text())
    assert compiled["all-gather"]["bytes"] == 2 * ops[0].traffic_bytes


# A matrix product as XLA:GPU compiles it (jax 0.11.2 on an H200): a cuBLAS call whose result
# is a tuple with its workspace and whose dimensions are in its backend config.
GPU_GEMM = """ENTRY %main (a: bf16[16384,1536], b: bf16[1536,6144]) -> bf16[16384,6144] {
  %a = bf16[16384,1536]{1,0} parameter(0)
  %b = bf16[1536,6144]{1,0} parameter(1)
  %custom-call.2 = (bf16[16384,6144]{1,0}, s8[33554432]{0}) custom-call(%a, %b), \
custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"alpha_real":1,\
"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],\
"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]},"epilogue":"DEFAULT"}}
  ROOT %get-tuple-element = bf16[16384,6144]{1,0} get-tuple-element(%custom-call.2), index=0
}
"""


def test_dot_flops_count_a_cublas_call_as_its_product():
    assert dot_flops(GPU_GEMM) == 2 * 16384 * 1536 * 6144


def test_compiled_flops_count_every_trip_of_a_scanned_product():
    """cost_analysis counts the loop body once; compiled_flops counts its 6 trips."""
    w = jnp.ones((6, 32, 32))

    def program(x, w):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

    compiled = jax.jit(program).lower(jnp.ones((16, 32)), w).compile()
    one = 2 * 16 * 32 * 32
    assert 6 * one <= compiled_flops(compiled) < 7 * one  # the tanh's and the loop's few more


def test_conditional_branches_name_the_computations_a_cond_runs(mesh_2x4):
    """The psum in the taken branch sits in a branch computation; the one outside does not."""

    def f(x):
        total = jax.lax.psum(x.sum(), "model")
        return jax.lax.cond(total > 0, lambda: x + jax.lax.psum(x, "model"), lambda: x)

    region = jax.shard_map(
        f, mesh=mesh_2x4, in_specs=P("data", "model"), out_specs=P("data", "model")
    )
    hlo = _hlo(region, jnp.ones((4, 1024), jnp.float32))
    branches = conditional_branches(hlo)
    reduced_in = [op.computation for op in collectives(hlo) if op.kind == "all-reduce"]
    assert len(branches) == 2 and all(
        f"\n{name} " in hlo or f"%{name} " in hlo for name in branches
    )
    assert sum(name in branches for name in reduced_in) == 1 < len(reduced_in), reduced_in
    assert conditional_branches(_hlo(lambda x: x * 2, jnp.ones(4))) == set()
