"""The core installs alone, as the README says: the project's wheel in a fresh virtual environment
with only the core's dependencies (pyproject `dependencies`; torch==2.13.0 from the machine's local
index) has no Redis, MLflow or FastAPI, and `from adaptive_spec import Engine` generates on a tiny
model, chat and a forced tool call included. The extras name the floors above.

    .venv/bin/python -m pytest tests/adaptive_spec/test_core_wheel.py -q   (about 1-2 minutes: the install)

test_core_alone.py blocks those packages inside this environment; this test shows the packaging
itself: what the wheel holds and what `pip install adaptive-spec` pulls in.
"""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from wheels import fresh_venv, install, project_wheel

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
ABOVE_THE_CORE = ("redis", "mlflow", "fastapi", "uvicorn", "starlette", "prometheus_client", "httpx")

pytestmark = pytest.mark.slow  # builds and installs a package: `./run tests -m slow`

SCRIPT = f"""
import importlib.util, json, sys
sys.path.insert(0, {str(HELPERS)!r})  # the tiny models and tokenizer builders, plain transformers code
missing = [name for name in {ABOVE_THE_CORE!r} if importlib.util.find_spec(name) is None]
from adaptive_spec import Engine
from adaptive_spec.outputs.tools import ToolUse
from tiny import tiny_target
from tiny_bytes import tiny_byte_tokenizer
engine = Engine(tiny_target(0, positions=1024), "early-exit:1", tiny_byte_tokenizer(), k=3)
messages = [{{"role": "user", "content": "Go."}}]
speculative = engine.generate(messages, max_new_tokens=12)
plain = engine.generate(messages, max_new_tokens=12, speculative=False)
tools = [{{"type": "function", "function": {{"name": "pick", "parameters": {{"type": "object",
          "properties": {{"room": {{"enum": ["hall", "den"]}}}}, "required": ["room"], "additionalProperties": False}}}}}}]
use = ToolUse.of(tools, "required", False, messages)
prompt, template_tools = use.prompt(messages, engine.tokenizer)
called = engine.generate(prompt, max_new_tokens=80, response_format=use.response_format())
print(json.dumps({{"missing": missing, "speculative": speculative.token_ids, "plain": plain.token_ids,
                  "drafted": speculative.stats.drafted, "calls": [c.arguments for c in use.parser.parse(called.text)[1]],
                  "module": __import__("adaptive_spec").__file__}}))
"""


@pytest.fixture(scope="module")
def wheel() -> Path:
    return project_wheel()


def test_the_wheel_holds_every_package_and_the_prompt_sets_and_its_extras_name_the_floors(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for package in (
        "adaptive_spec",
        "adaptive_spec/outputs/tools",
        "registry",
        "trainer",
        "service",
        "launch",
        "benchmarks",
        "cli",
    ):
        assert f"{package}/__init__.py" in names, package
    assert {"benchmarks/prompts/tool_calls.jsonl", "benchmarks/prompts/templates/tool_calls.json"} <= set(names)
    assert not [n for n in names if n.startswith("tests/")]
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    requires = Parser().parsestr(zipfile.ZipFile(wheel).read(metadata).decode()).get_all("Requires-Dist")
    core = [r for r in requires if "extra ==" not in r]
    assert "torch==2.13.0" in core and not any(r.startswith(ABOVE_THE_CORE) for r in core)
    extra = {}  # extra -> the requirements it adds, e.g. "serve" -> ["fastapi>=0.115", ...]
    for requirement in requires:
        if "extra ==" in requirement:
            name, marker = (part.strip() for part in requirement.split(";", 1))
            extra.setdefault(marker.split("==")[1].strip(" '\""), []).append(name)
    assert {"fastapi>=0.115", "uvicorn>=0.30", "redis>=5.0"} <= set(extra["serve"]), extra
    assert "mlflow==3.17.2" in extra["train"] and "all" in extra


def test_the_core_installs_alone_and_generates_without_redis_mlflow_or_fastapi(wheel, tmp_path):
    python = fresh_venv(tmp_path / "venv")
    install(python, str(wheel))
    result = subprocess.run(
        [str(python), "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # not the source tree: the installed package must be the one imported
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert str(tmp_path / "venv") in outcome["module"]
    assert sorted(outcome["missing"]) == sorted(ABOVE_THE_CORE)
    assert outcome["drafted"] > 0 and outcome["speculative"] == outcome["plain"]
    assert [json.loads(arguments)["room"] in ("hall", "den") for arguments in outcome["calls"]] == [True]
