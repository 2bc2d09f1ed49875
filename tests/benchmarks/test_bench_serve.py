"""`adaptive-spec bench-serve` end to end on the tiny model: it starts its own servers (one at a time,
batched target alone, batched speculative), runs closed-loop users, and writes the contract JSON
and the plot. Figures are not asserted (a benchmark, not a test); errors and identity are.

Run: .venv/bin/python -m pytest tests/benchmarks/test_bench_serve.py -q   (CPU, about a minute)
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # starts servers of its own for a while: `./run tests -m slow`

RUN_KEYS = {
    "config",
    "concurrency",
    "output_tok_s",
    "requests_per_s",
    "latency_p50_s",
    "latency_p99_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_s",
    "tpot_p99_s",
    "mean_acceptance_length",
    "tokens_verified_per_step",
    "acceptance_by_depth",
    "errors",
    "identical",
    "k",
    "batch_size",
}


def test_bench_serve_runs_every_configuration_and_writes_the_contract(tiny_model_dir, tmp_path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps({"messages": [{"role": "user", "content": text}]}) for text in ["hi there", "a b c", "xyz"]
        )
    )
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    command = [
        sys.executable,
        "-m",
        "cli",
        "bench-serve",
        "--target",
        str(tiny_model_dir),
        "--draft",
        "early-exit:1",
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        "--prompts",
        str(prompts),
        "--concurrency",
        "1,3",
        "--duration-s",
        "2",
        "--max-new-tokens",
        "8",
        "--max-batch",
        "4",
        "--long-prompt-tokens",
        "150",
        "--json",
        str(out),
        "--plot",
        str(png),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert {"runs", "identical", "prompts", "max_new_tokens", "draft", "adapter"} <= set(figures)
    assert figures["identical"] is True and figures["prompts"] == 3 and figures["adapter"] is None
    assert figures["rounds"] == 3  # each level visits every server three times, in alternating order
    assert [(r["config"], r["concurrency"]) for r in figures["runs"]] == [
        (config, users) for config in ("one_at_a_time", "batched_plain", "batched_speculative") for users in (1, 3)
    ]
    for run in figures["runs"]:
        assert set(run) >= RUN_KEYS, RUN_KEYS - set(run)
        assert run["errors"] == 0 and run["requests"] > 0 and run["output_tok_s"] > 0
        assert run["batch_size"] is not None
    one_at_a_time = {r["concurrency"]: r for r in figures["runs"] if r["config"] == "one_at_a_time"}
    batched = {r["concurrency"]: r for r in figures["runs"] if r["config"] == "batched_plain"}
    assert one_at_a_time[3]["batch_size"] == 1.0  # --max-batch 1 decodes one request at a time
    assert batched[3]["batch_size"] > 1.0  # three users share steps
    assert all(r["k"] == 0 for r in batched.values())  # the target alone drafts nothing
    assert all(r["tokens_verified_per_step"] == 0 and r["acceptance_by_depth"] == [] for r in batched.values())
    speculative = [r for r in figures["runs"] if r["config"] == "batched_speculative"]
    for run in speculative:  # from the replies' usage.spec_decode
        assert run["mean_acceptance_length"] >= 1.0 and run["tokens_verified_per_step"] > 0
        assert run["acceptance_by_depth"] and all(0 <= rate <= 1 for rate in run["acceptance_by_depth"])
    long = figures["long_prompt"]  # one prompt of 150 token ids among 3 short users on batched_speculative
    assert long["status"] == 200 and long["prompt_tokens"] == 150 and long["config"] == "batched_speculative"
    assert long["users"] == 3 and long["ttft_s"] > 0 and long["short_errors"] == 0
    assert long["short_tpot_p99_s_quiet"] > 0 and long["short_requests_during"] >= 0
    assert "long prompt of 150 tokens among 3 users" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "batched speculative" in result.stdout
