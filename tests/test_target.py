import warnings

import jax
import pytest

from substrax.planner import HARDWARE
from substrax.spmd import OBSERVED_ON
from substrax.target import GENERATIONS, CompileTarget


@pytest.mark.parametrize(
    ("name", "grid"),
    [
        ("v5p:4x4x4", (4, 4, 4)),
        ("v5p-128", (4, 4, 4)),  # Cloud counts TensorCores on v5p: 128 cores, 64 chips
        ("v4-32", (2, 2, 4)),
        ("v5e-16", (4, 4)),  # and chips on v5e
        ("v6e:2x4", (2, 4)),
        (" v5p : 2x2x2 ", (2, 2, 2)),
    ],
)
def test_names_give_the_chip_grid(name, grid):
    target = CompileTarget.parse(name)
    assert target.grid == grid and target.chips == int(jax.numpy.prod(jax.numpy.array(grid)))
    assert CompileTarget.parse(target) is target
    assert CompileTarget.parse(target.name) == target and target.platform == "tpu"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("v7x:2x2x2", "GENERATION one of v4, v5p, v5e, v6e"),
        ("h100-8", "Unknown target 'h100-8'"),
        ("v5p:4x4", "a v5p slice has 3 grid dimensions (2x2x2), got '4x4'"),
        ("v5p-100", "choose one of v5p-16, v5p-32"),
        ("v5p-9", "not a v5p slice Cloud names"),
    ],
)
def test_bad_names_say_what_is_valid(name, message):
    with pytest.raises(ValueError) as error:
        CompileTarget.parse(name)
    assert message in str(error.value)


def test_each_generation_has_a_hardware_profile():
    for name, generation in GENERATIONS.items():
        profile = HARDWARE[generation.hardware]
        assert profile.memory_bytes > 0 and profile.flops > 0, name
    assert CompileTarget.parse("v5p-16").memory_bytes == 95 * 10**9


def test_mesh_over_the_slice_needs_every_chip():
    target = CompileTarget.parse("v5p:2x2x2")
    mesh = target.make_mesh({"data": 2, "model": 4})
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert {d.platform for d in mesh.devices.flat} == {"tpu"} and len(target.devices()) == 8
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2
    with pytest.raises(ValueError, match="has 6 devices; target v5p:2x2x2 has 8 chips"):
        target.make_mesh({"data": 2, "model": 3})


def test_workarounds_were_observed_on_the_installed_jax():
    # Each entry of substrax.spmd's workaround list (region_obstacle, looped_region_obstacle)
    # was seen on this jax, on XLA:CPU and (where they say) XLA:TPU: when jax moves, recheck
    # them (docs/targets.md says how) and update OBSERVED_ON.
    assert jax.__version__ == OBSERVED_ON, (
        f"jax is {jax.__version__}; the workaround list was observed on {OBSERVED_ON}"
    )


def test_compiling_for_the_slice_bypasses_the_persistent_cache():
    """The suite runs with jax's persistent cache on (tests/jax_setup.py): a deviceless
    executable is written to it but cannot be read back, so a second compile outside
    ``compiling()`` warns; inside, it compiles quietly and the cache is back on after."""
    target = CompileTarget.parse("v5p:2x2x2")
    mesh = target.make_mesh({"data": 8})
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x = jax.ShapeDtypeStruct((64, 24), jax.numpy.float32, sharding=sharding)

    def program(x):
        return (jax.numpy.tanh(x) * 3.0).sum(axis=0)

    step = jax.jit(program)
    for _ in range(2):
        jax.clear_caches()  # each compile past jax's in-memory caches, to the persistent one
        with target.compiling():
            assert "all-reduce" in step.lower(x).compile().as_text()
    assert jax.config.jax_enable_compilation_cache
    for _ in range(2):  # written to the cache, then read from it
        jax.clear_caches()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            step.lower(x).compile()
    assert any("Error reading persistent compilation cache" in str(w.message) for w in seen)


def test_xla_tpu_compiles_ragged_dot_to_a_grouped_kernel():
    """What native_grouped_matmul's docstring says of TPU: active FLOPs, no dense temporary.

    (XLA:GPU with jax 0.11.2 compiles it densely, every row times every expert: measured in
    benchmarks/results/gpu.md; XLA:CPU too, hence the blocked loop there.)
    """
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from substrax.hlo import compiled_flops
    from substrax.spmd import native_grouped_matmul

    target = CompileTarget.parse("v5p:2x2x2")
    whole = NamedSharding(target.make_mesh({"data": 8}), P())
    experts, rows, width, hidden = 16, 2048, 256, 512
    args = (
        jax.ShapeDtypeStruct((rows, width), jnp.bfloat16, sharding=whole),
        jax.ShapeDtypeStruct((experts, width, hidden), jnp.bfloat16, sharding=whole),
        jax.ShapeDtypeStruct((experts,), jnp.int32, sharding=whole),
    )
    with target.compiling():
        compiled = jax.jit(jax.lax.ragged_dot).lower(*args).compile()
    assert native_grouped_matmul("tpu") and not native_grouped_matmul("cpu")
    assert compiled_flops(compiled) == 2 * rows * width * hidden  # the active products only
    dense = experts * rows * width * 2  # the [experts, rows, width] operand a dense product needs
    assert compiled.memory_analysis().temp_size_in_bytes < dense / 8
    assert "tpu_custom_call" in compiled.as_text()


def test_a_grouped_kernel_in_a_loop_counts_every_trip_and_its_gradient_is_not_dense():
    """compiled_flops counts a TPU kernel (by its own cost estimate) as often as its loop
    runs, as it counts dots; and the experts' weight gradient (grouped_matmul on TPU) runs
    tile by tile, where ragged_dot's own transpose is a dense product over every expert."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from substrax.hlo import compiled_flops
    from substrax.spmd import _grouped

    target = CompileTarget.parse("v5p:2x2x2")
    whole = NamedSharding(target.make_mesh({"data": 8}), P())
    experts, rows, width, hidden, trips = 8, 2048, 256, 512, 4
    args = (
        jax.ShapeDtypeStruct((trips, rows, width), jnp.bfloat16, sharding=whole),
        jax.ShapeDtypeStruct((experts, width, hidden), jnp.bfloat16, sharding=whole),
        jax.ShapeDtypeStruct((experts,), jnp.int32, sharding=whole),
    )

    def loss(product):
        def scanned(xs, w, sizes):
            step = lambda total, x: (total + jnp.sum(product(x, w, sizes)), None)  # noqa: E731
            return jax.lax.scan(step, jnp.zeros((), jnp.bfloat16), xs)[0]

        return scanned

    one = 2 * rows * width * hidden
    with target.compiling():
        forward = jax.jit(loss(jax.lax.ragged_dot)).lower(*args).compile()
        tiled = jax.jit(jax.grad(loss(_grouped._ragged), (0, 1))).lower(*args).compile()
        dense = jax.jit(jax.grad(loss(jax.lax.ragged_dot), (0, 1))).lower(*args).compile()
    assert compiled_flops(forward) == pytest.approx(trips * one, rel=0.001)  # and the sums
    # the input's gradient, and the weights' over 4 + 8 - 1 pairs of a 512-row tile and an
    # expert (the forward product is not needed: the loss is its sum)
    assert compiled_flops(tiled) == pytest.approx(trips * (one + one * 11 / 4), rel=0.01)
    assert compiled_flops(dense) > 0.99 * trips * (one + experts * one)  # every expert's rows


def test_xla_tpu_allocates_its_heap_peak_not_its_temporaries():
    """What peak_bytes says of XLA:TPU: a scanned, rematerialised program compiles although its
    arguments and temp_size_in_bytes exceed the chip's HBM; its heap peak (the buffer
    assignment) fits, and the program the compiler refuses is one whose heap would not."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from substrax.hlo import peak_bytes

    target = CompileTarget.parse("v5p:2x2x2")
    whole = NamedSharding(target.make_mesh({"data": 8}), P())
    layers, width = 8, 1024

    def layer(x, w):
        return x + (jax.nn.silu(x @ w[0]) * (x @ w[1])) @ w[2].T, None

    def loss(weights, x):
        y, _ = jax.lax.scan(jax.checkpoint(layer), x, weights)
        return jnp.mean(y.astype(jnp.float32) ** 2)

    def compile_for(tokens):
        weights = jax.ShapeDtypeStruct((layers, 3, width, 4 * width), jnp.bfloat16, sharding=whole)
        x = jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16, sharding=whole)
        with target.compiling():
            return jax.jit(jax.grad(loss)).lower(weights, x).compile()

    memory = compile_for(3 * 2**19).memory_analysis()
    hbm = 95.74 * 2**30  # v5p's, in the compiler's refusal below
    outside = memory.argument_size_in_bytes + memory.output_size_in_bytes
    assert outside + memory.temp_size_in_bytes > 1.15 * hbm  # 114.2 GiB measured
    assert peak_bytes(memory, "tpu") == memory.peak_memory_in_bytes < 0.9 * hbm  # 81.4 GiB
    assert (
        peak_bytes(memory, "cpu")
        == outside - memory.alias_size_in_bytes + memory.temp_size_in_bytes
    )
    with pytest.raises(Exception, match=r"HLO temporaries \([0-9.]+G\) exceeds available HBM"):
        compile_for(4 * 2**19)  # a heap of about 108 GiB
    with pytest.raises(ValueError, match="choose one of cpu, gpu, tpu"):
        peak_bytes(memory, "TPU")
