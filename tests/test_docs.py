"""The docs cannot drift: every public name is in the API reference, notebooks are stripped."""

import json
import os
import pathlib

import pytest

import substrax
import substrax.data
import substrax.distributed
import substrax.hlo
import substrax.launch
import substrax.layout
import substrax.mesh
import substrax.pipeline
import substrax.planner
import substrax.spmd
import substrax.target

ROOT = pathlib.Path(__file__).resolve().parent.parent
API = "\n".join(path.read_text() for path in (ROOT / "docs" / "api").glob("*.md"))
MODULES = [
    substrax,
    substrax.mesh,
    substrax.layout,
    substrax.spmd,
    substrax.hlo,
    substrax.launch,
    substrax.pipeline,
    substrax.planner,
    substrax.target,
    substrax.data,
]


def _public(module):
    return [name for name in module.__all__ if not name.startswith("__")]


def test_distributed_initialize_is_in_the_api_reference():
    assert "::: substrax.distributed.initialize\n" in API


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_every_public_name_is_in_the_api_reference(module):
    missing = [
        f"{module.__name__}.{name}"
        for name in _public(module)
        if f"::: {module.__name__}.{name}\n" not in API + "\n"
    ]
    assert missing == []


def test_every_adapter_name_is_in_the_api_reference():
    import substrax_flax
    import substrax_flax.compile
    import substrax_flax.planner

    missing = [n for n in substrax_flax.__all__ if f"::: substrax_flax.{n}\n" not in API + "\n"]
    for module in (substrax_flax.planner, substrax_flax.compile):
        missing += [n for n in module.__all__ if f"::: {module.__name__}.{n}\n" not in API + "\n"]
    assert missing == []


@pytest.mark.parametrize(
    "notebook", sorted((ROOT / "docs" / "tutorials").glob("*.ipynb")), ids=lambda p: p.name
)
def test_notebooks_are_stored_without_outputs(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    code = [cell for cell in cells if cell["cell_type"] == "code"]
    assert code, f"{notebook.name} has no code"
    assert all(cell["outputs"] == [] and cell["execution_count"] is None for cell in code)


def test_every_tutorial_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    for notebook in (ROOT / "docs" / "tutorials").glob("*.ipynb"):
        assert f"tutorials/{notebook.name}" in nav


def test_the_readme_first_code_block_runs_as_written(tmp_path):
    """A new user's first paste: the README's first Python block, in a fresh process."""
    import re
    import subprocess
    import sys

    text = (ROOT / "README.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert 'jax.config.update("jax_num_cpu_devices", 8)' in block  # runs on a laptop's CPU
    script = tmp_path / "first.py"
    script.write_text(block)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env={**env, "JAX_PLATFORMS": "cpu"}, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 2: loss" in out.stdout and "(manual step)" in out.stdout
    assert "Step plan:" in out.stdout and "reduce-scatter over ('data',)" in out.stdout


QUICK_STARTS = (
    "index",
    "evaluate",
    "data",
    "context",
    "experts",
    "pipeline",
    "pretrained",
    "targets",
)


def test_the_quick_start_of_each_docs_page_runs(tmp_path):
    """Each page's first Python block, as written, on 8 simulated CPU devices (one process,
    each block in its own namespace, compiled as the rest of the suite compiles)."""
    import re
    import subprocess
    import sys

    blocks = [re.search(r"```python\n(.*?)```", (ROOT / "docs" / f"{page}.md").read_text(),
                        re.S).group(1) for page in QUICK_STARTS]  # fmt: skip
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    runner = tmp_path / "run.py"
    runner.write_text(
        "import json, sys\nimport jax\njax.config.update('jax_num_cpu_devices', 8)\n"
        "for i, block in enumerate(json.load(open(sys.argv[1]))):\n"
        "    exec(compile(block, f'block{i}', 'exec'), {'__name__': '__main__'})\n"
        "    print(f'block {i} ran', flush=True)\n"
    )
    # The suite's fast-compile XLA_FLAGS (jax_setup.py) stay: they set how XLA:CPU compiles,
    # not what the blocks compute (the README's block above runs without them).
    out = subprocess.run([sys.executable, str(runner), str(tmp_path / "blocks.json")],
                         capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"},
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    ran = re.findall(r"^block (\d+) ran$", out.stdout, re.M)
    assert ran == [str(i) for i in range(len(QUICK_STARTS))]
    assert "on the manual step" in out.stdout and "gradient of the first layer" in out.stdout
    assert "4 variables from" in out.stdout  # the pretrained page's plan
    assert "compiled by XLA:TPU" in out.stdout  # the real-targets page's report
    assert "resumed at window 48" in out.stdout  # the data page's saved position
