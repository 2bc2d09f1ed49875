"""The house keeps its shape (docs/layout.md): modules that fit on a few screens, a core whose folders show
its floors, and CI that runs every group. `lint-imports` checks the arrows; this checks the rest.

    .venv/bin/python -m pytest tests/ops/test_layout.py -q -n 0
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("adaptive_spec", "trainer", "service", "registry", "launch", "cli", "benchmarks")
MAX_LINES = 450  # a module longer than this holds more than one job: split it by job
MAX_TOP_MODULES = 12  # the core's top floor: the engine a user holds, and what every floor shares


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_is_longer_than_450_lines(package: str) -> None:
    lines = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines()) for path in _modules(package)}
    assert lines, f"no modules found in {package}/"
    long = {path: n for path, n in lines.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def test_the_core_is_floors_of_subpackages_with_few_modules_at_its_top() -> None:
    core = ROOT / "adaptive_spec"
    subpackages = sorted(path.parent.name for path in core.glob("*/__init__.py"))
    top = sorted(path.name for path in core.glob("*.py"))
    assert len(subpackages) >= 4, subpackages
    assert len(top) <= MAX_TOP_MODULES, top
    assert "engine.py" in top  # the one object a user holds stays at the top
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    floors = [c for c in contracts if c["type"] == "layers" and c.get("containers") == ["adaptive_spec"]]
    assert len(floors) == 1, "one layers contract names the core's floors"
    named = {part.strip() for layer in floors[0]["layers"] for part in re.split(r"[|:]", layer)}
    assert set(subpackages) <= named, (
        f"sub-packages missing from the core's layers contract: {set(subpackages) - named}"
    )
    acyclic = next(c for c in contracts if c["type"] == "acyclic_siblings")
    assert {f"adaptive_spec.{name}" for name in subpackages} <= set(acyclic["ancestors"])


def test_ci_runs_the_readme_test_command_and_that_runs_every_group() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^exec \./run tests$", ci, re.M), ".ci/run calls exactly the README's test command"
    assert "./run tests " in (ROOT / "README.md").read_text()
    run = (ROOT / "run").read_text()
    groups = re.search(r"^TEST_GROUPS=\(\n(.*?)^\)", run, re.M | re.S)
    assert groups is not None, "run names the groups `./run tests` runs"
    names = re.findall(r'^\s+"(\w+):', groups.group(1), re.M)
    markers = {
        line.split(":")[0]
        for line in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    }
    assert {"default", "compiled", "slow", "vllm", "cuda"} <= set(names), names
    assert set(names) - {"default"} <= markers, "every group but the default one is a pytest marker"
