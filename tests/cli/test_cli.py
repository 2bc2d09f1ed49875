"""The command line loads what each command needs and nothing more: `generate` and `bench` run on the
core library alone, with no Redis, FastAPI or MLflow module imported (DESIGN.md "Packages").

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/cli/test_cli.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICE_MODULES = ("redis", "fastapi", "uvicorn", "starlette", "mlflow", "prometheus_client")


def run_command(argv: list[str], tmp_path: Path) -> tuple[dict, subprocess.CompletedProcess]:
    """`adaptive-spec ARGV` in a fresh interpreter; returns its exit code and which of SERVICE_MODULES it loaded."""
    script = (
        "import json, sys\n"
        "from cli import main\n"
        f"code = main({argv!r})\n"
        f"loaded = sorted(m for m in {SERVICE_MODULES!r} if m in sys.modules)\n"
        "print(json.dumps({'code': code, 'loaded': loaded}), file=sys.stderr)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ADAPTIVE_SPEC_DATA_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stderr.strip().splitlines()[-1]), result


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "--raw", "Name a river."],
        ["generate", "--json", "--prompts", "{prompts}"],
        ["bench", "--prompts", "{prompts}", "--num-prompts", "1"],
    ],
    ids=["generate", "generate-json", "bench"],
)
def test_generate_and_bench_import_no_redis_fastapi_or_mlflow(tiny_model_dir, tmp_path, command):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Name three rivers."}]}) + "\n")
    argv = [part.format(prompts=prompts) for part in command]
    argv += ["--target", str(tiny_model_dir), "--draft", "early-exit:1", "--max-new-tokens", "4"]
    outcome, result = run_command(argv, tmp_path)
    assert outcome == {"code": 0, "loaded": []}, result.stderr[-3000:]


def test_a_command_that_needs_redis_does_load_it(tmp_path):
    """The same check sees service code when a command uses it: `adapters list` on an empty sqlite store."""
    outcome, result = run_command(["adapters", "list", "--data-dir", str(tmp_path)], tmp_path)
    assert outcome["code"] == 0 and "mlflow" in outcome["loaded"], result.stderr[-3000:]


BAD_ARGUMENTS = [
    (["train", "--gate-confidence", "1.5"], "--gate-confidence: must be at least 0.5 and below 1"),
    (["train", "--gate-confidence", "high"], "--gate-confidence: expected a number"),
    (["bench-drift", "--scenario", "python"], "'python' is not NAME:SECONDS"),
    (["bench-drift", "--scenario", "python:0"], "the duration must be positive"),
    (["bench-drift", "--scenario", "nosuchset:60"], "no shipped prompt set 'nosuchset'"),
    (["bench-drift", "--scenario", "mix:60"], "name at least one"),
    (["bench-drift", "--plot", "drift.png"], "--plot draws a --scenario run"),
    (["adapters", "promote", "1", "--domain", "no way"], "argument --domain: a domain in an alias name"),
    (["adapters", "list", "--domain", "x" * 65], "argument --domain: a domain name is at most 64"),
]


def test_bad_arguments_exit_2_saying_what_is_wrong_before_loading_anything(tmp_path):
    """Each command line in one fresh interpreter (argparse's errors exit, ours return 2)."""
    script = (
        "import contextlib, io, json, sys\n"
        "from cli import main\n"
        "out = []\n"
        f"for argv in {[argv for argv, _ in BAD_ARGUMENTS]!r}:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        try:\n"
        "            code = main(argv)\n"
        "        except SystemExit as exc:\n"
        "            code = exc.code\n"
        "    out.append([code, err.getvalue()])\n"
        "print(json.dumps(out))\n"
    )
    env = {**os.environ, "ADAPTIVE_SPEC_DATA_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads(result.stdout.strip().splitlines()[-1])
    for (argv, says), (code, stderr) in zip(BAD_ARGUMENTS, outcomes, strict=True):
        assert code == 2 and says in stderr and "Traceback" not in stderr, (argv, code, stderr)


@pytest.mark.parametrize("command", ["serve", "up"])
def test_the_model_flags_a_child_server_gets_are_flags_serve_and_up_take(command, tmp_path, monkeypatch):
    """bench-serve and the scenario start `serve` with ModelOptions.argv(): every flag it writes (compile,
    trees, k) must parse and reach the server's settings, as the environment's values would."""
    from adaptive_spec.options import ModelOptions
    from cli import build_parser
    from cli.serving import serving_settings

    options = ModelOptions(k=3, compile=False, tree_budget=16)
    args = build_parser().parse_args([command, "--data-dir", str(tmp_path), *options.argv()])
    assert serving_settings(args).models == options
    monkeypatch.delenv("ADAPTIVE_SPEC_COMPILE", raising=False)
    monkeypatch.delenv("ADAPTIVE_SPEC_TREE_BUDGET", raising=False)
    unset = serving_settings(build_parser().parse_args([command, "--data-dir", str(tmp_path)]))
    assert (unset.compile, unset.tree_budget) == (None, None)  # neither given nor set: the core's defaults
