"""This project as a wheel, and fresh virtual environments to install it in, for tests of what a
user gets from `pip install adaptive-spec` (the core alone, or with extras).

    wheel = project_wheel()                        # built once per test process (about 10 s)
    venv = fresh_venv(tmp_path / "venv")           # `python -m venv`, with pip, no site-packages
    install(venv, f"{wheel}")                      # pip as the machine is set up (torch==2.13.0 from its local index)

The wheel is built from a copy of the working tree (so no `build/` lands in it) with the build
backend already in the test environment (`pip wheel --no-deps --no-build-isolation`): nothing is
fetched to build it.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What a source tree holds besides the sources: environments, caches, state, build output.
_NOT_SOURCES = shutil.ignore_patterns(
    ".venv", ".git", ".adaptive-spec", "*_cache", "__pycache__", "build", "dist", "*.egg-info", "mlruns"
)


@functools.cache
def project_wheel() -> Path:
    """The project's wheel, built once per process into a temporary directory."""
    out = Path(tempfile.mkdtemp(prefix="adaptive-spec-wheel-"))
    source = Path(tempfile.mkdtemp(prefix="adaptive-spec-src-")) / "src"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCES)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    shutil.rmtree(source.parent, ignore_errors=True)
    (wheel,) = out.glob("adaptive_spec-*.whl")
    return wheel


def fresh_venv(path: Path) -> Path:
    """A new virtual environment at `path` (with pip, without the system's site-packages); its python."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, capture_output=True, timeout=300)
    return path / "bin" / "python"


def install(python: Path, *requirements: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`pip install` into the environment of `python`, as this machine's pip is configured."""
    return subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *requirements],
        check=True,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
