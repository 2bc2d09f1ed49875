"""The package is whole (issue 30, item 9): a wheel built from the repository, installed in a fresh virtual
environment, serves /dashboard with its assets. Before, the page lived outside every package and an installed
server answered 404.

OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/ops/test_wheel.py -q -s   (about a minute: the
dependencies, torch included, are installed from the local indexes into the new environment)

The wheel is built from a copy of the working tree (no stale `build/` of the repository in it). The new
environment gets the wheel with --no-deps, then exactly the distributions `adaptive-spec[serve]` needs, at
the versions this environment has (torch==2.13.0, the local CPU build; never an unpinned torch). The
server runs from a directory outside the repository, so nothing is imported from the source tree.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from support import child_env

from launch.processes import Child, free_port

pytestmark = pytest.mark.slow  # builds and installs a package: `./run tests -m slow`

REPO = Path(__file__).resolve().parents[2]
SKIP = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", "tests")


def needed(name: str = "adaptive-spec", extras: tuple[str, ...] = ("serve",), found: dict | None = None) -> dict:
    """name -> version of every distribution `name[extras]` needs, as installed here."""
    found = {} if found is None else found
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:  # a marker's platform-only dependency
        return found
    for raw in dist.requires or []:
        requirement = Requirement(raw)
        wanted = requirement.marker is None or any(requirement.marker.evaluate({"extra": e}) for e in ("", *extras))
        key = requirement.name.lower().replace("_", "-")
        if wanted and key not in found and key != "adaptive-spec":
            try:
                found[key] = importlib.metadata.version(requirement.name)
            except importlib.metadata.PackageNotFoundError:
                continue
            needed(requirement.name, tuple(requirement.extras), found)
        elif wanted and key == "adaptive-spec":
            needed(name, tuple(requirement.extras), found)
    return found


def run(command: list, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, f"{command[:4]}: {done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done.stdout


def test_a_wheel_installed_in_a_fresh_environment_serves_the_dashboard(tmp_path, tiny_model_dir):
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=SKIP)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path, source])
    wheel = next(tmp_path.glob("adaptive_spec-*.whl"))

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv])
    pins = [f"{name}=={version.split('+')[0]}" for name, version in sorted(needed().items())]
    assert "torch==2.13.0" in pins
    run([venv / "bin" / "pip", "install", "-q", "--no-deps", "--disable-pip-version-check", wheel, *pins])
    where = run([venv / "bin" / "python", "-c", "import service, sys; print(service.__file__)"], cwd=tmp_path)
    assert where.strip().startswith(str(venv)), where  # the installed package, not the repository's

    port = free_port()
    serve = [venv / "bin" / "adaptive-spec", "serve", "--target", tiny_model_dir, "--draft", "early-exit:1"]
    server = Child(
        [*serve, "--port", str(port), "--data-dir", tmp_path / "data", "--dtype", "fp32", "--device", "cpu"],
        tmp_path / "serve.log",
        env=child_env(ADAPTIVE_SPEC_ADAPTER_POLL_S="0"),
        cwd=tmp_path,
    )
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_until(lambda: _ok(url + "/health"), 180, "/health")
        page = httpx.get(url + "/dashboard", timeout=30)
        assets = {
            name: httpx.get(f"{url}/dashboard/static/{name}", timeout=30)
            for name in ("dashboard.js", "dashboard.css", "vendor/uPlot.iife.min.js", "vendor/uPlot.min.css")
        }
    finally:
        server.stop()
    assert page.status_code == 200 and "<html" in page.text.lower(), page.text[:300]
    for name, answer in assets.items():
        assert answer.status_code == 200 and len(answer.content) > 100, name


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
