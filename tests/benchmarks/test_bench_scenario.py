"""bench-drift --scenario end to end on a tiny model: real servers, a real trainer process, Redis and
MLflow on sqlite, phases that come back, the JSON contract of DESIGN.md, and the plot.

Run: .venv/bin/python -m pytest tests/benchmarks/test_bench_scenario.py -q   (about a minute)
"""

from __future__ import annotations

import json
import sys

import pytest

from adaptive_spec.outputs.prompts import PromptFileError
from benchmarks.scenario import MIX, Phase, ScenarioSettings, parse_scenario, run_scenario
from benchmarks.scenario_report import format_report, plot

pytestmark = [pytest.mark.redis, pytest.mark.slow]  # it starts a redis-server of its own


def prompt_file(path, letters: str, count: int = 14):
    rows = [
        {"messages": [{"role": "user", "content": f"{letters[i % len(letters)]} {i}"}], "domain": path.stem}
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def tiny_scenario(model_dir, phases: str, **fields) -> ScenarioSettings:
    return ScenarioSettings(
        phases=tuple(parse_scenario(phases)),
        target=str(model_dir),
        draft="early-exit:1",
        k=2,  # a fixed k: the untrained tiny draft drafts every step, so every window has an acceptance
        dtype="fp32",
        device="cpu",
        max_new_tokens=8,
        eval_prompts=2,
        window_s=3.0,
        max_batch=2,
        trainer_args=("--min-new-records", "4", "--gate-min-positions", "16", "--round-steps", "3"),
        cli=(sys.executable, "-m", "cli"),
        **fields,
    )


def test_a_short_scenario_reports_every_phase_and_the_contract_keys(tiny_model_dir, tmp_path):
    a, b = prompt_file(tmp_path / "alpha.jsonl", "abc"), prompt_file(tmp_path / "beta.jsonl", "xyz")
    settings = tiny_scenario(tiny_model_dir, f"{a}:8,{b}:6,{a}:6,mix:5")
    lines = []
    result = run_scenario(settings, log=lines.append)

    assert set(result) >= {"phases", "overall", "first_promotion_s", "identical"}
    assert result["identical"] is True
    assert [p["name"] for p in result["phases"]] == ["alpha", "beta", "alpha", "mix"]
    for phase in result["phases"]:
        assert set(phase) >= {
            "name",
            "start_s",
            "end_s",
            "recover_s",
            "plateau_acceptance",
            "heldout_acceptance",
            "static_acceptance",
        }
        assert phase["end_s"] > phase["start_s"]
        assert 0 <= phase["static_acceptance"] <= 1 and 0 <= phase["heldout_acceptance"] <= 1
    starts = [p["start_s"] for p in result["phases"]]
    assert starts == sorted(starts)
    assert "return_ratio" in result["phases"][2] and "return_ratio" not in result["phases"][1]
    assert set(result["overall"]) >= {"adaptive_acceptance", "static_acceptance", "adaptive_tok_s", "static_tok_s"}
    assert result["overall"]["requests"] > 0 and result["overall"]["static_tok_s"] > 0
    assert result["overall"]["target_alone_ratio"] > 0 and result["overall"]["speedup_net_of_processes"] > 0
    served = sum(w["adaptive"]["requests"] for w in result["windows"])
    assert served == sum(w["static"]["requests"] for w in result["windows"]) == result["overall"]["requests"]
    json.dumps(result)  # the JSON the CLI writes

    report = format_report(result)
    assert "alpha" in report and "identical" in report
    plot(result, tmp_path / "scenario.png")
    assert (tmp_path / "scenario.png").stat().st_size > 10_000
    assert any("trainer" in line for line in lines)


def test_scenarios_are_parsed_or_refused_with_the_part_that_is_wrong(tmp_path):
    a = prompt_file(tmp_path / "alpha.jsonl", "abc")
    assert parse_scenario(f"python:600, {a}:30,mix:10") == [
        Phase("python", parse_scenario("python:1")[0].source, 600.0),
        Phase("alpha", a, 30.0),
        Phase(MIX, None, 10.0),
    ]
    for bad, says in (
        ("python", "is not NAME:SECONDS"),
        ("python:ten", "is not a number"),
        ("python:0", "must be positive"),
        ("mix:60", "name at least one"),
    ):
        with pytest.raises(ValueError, match=says):
            parse_scenario(bad)
    with pytest.raises(PromptFileError, match="no shipped prompt set"):
        parse_scenario("nosuchdomain:60")


def test_a_scenario_from_a_start_version_serves_it_on_both_servers_the_static_one_frozen(tiny_model_dir, tmp_path):
    """--start-version: the adaptive server drafts with the version from its first reply (registered as
    the run's champion, the trainer trains on from it), the static one serves the same version frozen."""
    from adapter_files import write_adapter
    from tiny import tiny_target

    warm = write_adapter(
        tiny_target(0), 1, tmp_path / "warm", seed=3, target_id=str(tiny_model_dir), draft_id="early-exit:1", version=7
    )
    a = prompt_file(tmp_path / "alpha.jsonl", "abc")
    settings = tiny_scenario(tiny_model_dir, f"{a}:6", start_adapter=warm, start_version="7")
    result = run_scenario(settings, log=lambda line: None)
    assert result["identical"] is True
    assert result["start_version"] == "7" and result["static"] == "version 7, frozen"
    assert result["first_adapter_versions"] == {"adaptive": "1", "static": "7"}  # the run's registry calls it 1
    assert "static: version 7, frozen" in format_report(result)
