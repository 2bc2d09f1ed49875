"""The core library works on its own (DESIGN.md, STYLE.md §15): with Redis, FastAPI, MLflow and the
packages above it impossible to import, every module of `adaptive_spec` imports and `Engine.generate`
runs speculative decoding on a tiny model, equal to the target alone.

    .venv/bin/python -m pytest tests/adaptive_spec/test_core_alone.py -q

It runs in a subprocess that marks those packages missing (`sys.modules[name] = None`: `import redis`
raises ImportError and `importlib.util.find_spec("redis")` answers None, as after `pip install
adaptive-spec` without extras), so nothing this test process imported can hide an import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HELPERS = Path(__file__).resolve().parents[1] / "helpers"  # tiny.py, for the child process
ROOT = HELPERS.parents[1]
BLOCKED = ("redis", "fastapi", "uvicorn", "starlette", "mlflow", "prometheus_client", "service", "trainer", "registry")

SCRIPT = f"""
import json, pkgutil, importlib, sys
for name in {BLOCKED!r}:
    sys.modules[name] = None
sys.path.insert(0, {str(HELPERS)!r})
import adaptive_spec
modules = [m.name for m in pkgutil.walk_packages(adaptive_spec.__path__, "adaptive_spec.")]
for name in modules:
    importlib.import_module(name)
from tiny import tiny_target
from adaptive_spec import Engine
engine = Engine(tiny_target(0), "early-exit:1", eos_token_id=[])
prompt = [5, 17, 33, 8, 5, 17, 33, 8]
speculative = engine.generate(prompt, max_new_tokens=12, k=2)
plain = engine.generate(prompt, max_new_tokens=12, speculative=False)
print(json.dumps({{"modules": modules, "speculative": speculative.token_ids, "plain": plain.token_ids,
                  "drafted": speculative.stats.drafted}}))
"""


def test_the_core_imports_and_generates_without_redis_fastapi_or_mlflow():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"adaptive_spec.engine", "adaptive_spec.formats.adapters", "adaptive_spec.contracts"} <= set(
        outcome["modules"]
    )
    assert outcome["drafted"] > 0 and outcome["speculative"] == outcome["plain"]
