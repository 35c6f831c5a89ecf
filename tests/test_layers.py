"""Layers point down: the core imports and works without flax, and never names the adapter."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORE = ROOT / "src" / "substrax"

# Blocks flax and the adapter, imports every core module, and runs each layer once.
WITHOUT_FLAX = r"""
import importlib, pkgutil, sys

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("flax", "substrax_flax", "optax", "orbax"):
            raise ImportError(f"{name} is blocked: the core must not need it")

sys.meta_path.insert(0, Block())
import jax
jax.config.update("jax_num_cpu_devices", 8)
import substrax
modules = [m.name for m in pkgutil.walk_packages(substrax.__path__, "substrax.")]
for name in modules:
    if not name.endswith("__main__"):
        importlib.import_module(name)
from substrax.layout import Layout
from substrax.planner import Hardware, Workload, plan
layout = Layout.named("fsdp+tp", {"data": 2, "model": 4})
mesh = layout.make_mesh()
assert layout.param_rules.resolve("embed", "mlp", shape=(64, 64), mesh=mesh).spec == (
    jax.sharding.PartitionSpec("data", "model"))
best = plan("gpt2-small", 8, Hardware(memory_bytes=10**10), Workload(2**14, 256)).best
assert best.layout.make_mesh().devices.size == 8
assert not any(m.split(".")[0] in ("flax", "substrax_flax") for m in sys.modules)
print(len(modules), "modules")
"""


def test_the_core_imports_and_works_without_flax():
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_FLAX], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split()[0]) >= 15


def test_no_core_module_names_the_adapter():
    offenders = [
        str(path.relative_to(ROOT))
        for path in CORE.rglob("*.py")
        if "substrax_flax" in path.read_text() or "substrax-flax" in path.read_text()
    ]
    assert offenders == []


def test_no_private_core_name_is_imported_by_the_adapter():
    adapter = ROOT / "integrations" / "flax" / "src" / "substrax_flax"
    offenders = []
    for path in adapter.rglob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] == ["from"] and words[1].startswith("substrax."):
                module = words[1]
                names = line.split(" import ", 1)[1]
                if "._" in module or any(n.strip().startswith("_") for n in names.split(",")):
                    offenders.append(f"{path.name}: {line.strip()}")
    assert offenders == []


def _adapter_imports() -> dict[str, set[str]]:
    """Each adapter module's imports of other adapter modules, at any depth in its code."""
    import ast

    adapter = ROOT / "integrations" / "flax" / "src" / "substrax_flax"
    graph = {}
    for path in adapter.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "substrax_flax."
            ):
                found.add(node.module.split(".")[1])
        graph[path.stem] = found - {"__init__"}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (a path that returns to its start), or []."""
    done, path = set(), []

    def visit(node):
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return []
        path.append(node)
        for other in sorted(graph.get(node, ())):
            found = visit(other)
            if found:
                return found
        path.pop()
        done.add(node)
        return []

    for node in sorted(graph):
        found = visit(node)
        if found:
            return found
    return []


def test_the_adapter_has_no_import_cycle_even_inside_functions():
    graph = _adapter_imports()
    assert {"_plan", "_train", "_optimizer", "_report"} <= set(graph)
    assert _cycle(graph) == []
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # it can fail
