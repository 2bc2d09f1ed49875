"""bench-drift --compare-drafts end to end on the tiny model: each draft's whole run, side by side in one
JSON with its draft cost, and the command-line errors that stop it before anything runs.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/benchmarks/test_bench_compare.py -x -q
"""

from __future__ import annotations

import json
import math

import pytest

from cli import main

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "tiny.jsonl"
    lines = [json.dumps({"prompt": f"Item {i}: add {i} and {2 * i + 1}."}) for i in range(24)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_two_drafts_side_by_side_with_their_cost(tiny_model_dir, prompts, redis_url, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REDIS_URL", redis_url)  # each draft gets a stream of its own, deleted after
    monkeypatch.setenv("ADAPTIVE_SPEC_DATA_DIR", str(tmp_path / "data"))
    out, png = tmp_path / "compare.json", tmp_path / "compare.png"
    argv = ["bench-drift", "--target", str(tiny_model_dir), "--compare-drafts", "head@tree:6,early-exit:1"]
    argv += ["--prompts", str(prompts), "--eval-prompts", "4", "--max-new-tokens", "8", "--budget-minutes", "0.5"]
    argv += ["--train-tail-s", "2", "--window-s", "1", "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    result = json.loads(out.read_text())

    assert [d["draft"] for d in result["drafts"]] == ["head@tree:6", "early-exit:1"] and result["identical"] is True
    for draft in result["drafts"]:
        for phase in ("before", "after"):
            assert {"acceptance_rate", "mean_acceptance_length", "speedup_vs_target"} <= set(draft[phase])
            assert isinstance(draft[phase]["acceptance_by_depth"], list)
            assert draft[phase]["tokens_verified_per_step"] is None or draft[phase]["tokens_verified_per_step"] >= 0
            assert draft[phase]["identical"] is True
        assert draft["domain"] == "tiny" and draft["eval_prompts"] == 4
        assert draft["traffic_prompts_served"] > 0 and draft["records_written"] > 0
        for key in ("records_consumed", "tokens_consumed", "train_s", "adapters_promoted", "budget_minutes"):
            assert key in draft
        fraction = draft["draft_step_fraction"]
        assert isinstance(fraction, float) and math.isfinite(fraction) and fraction > 0, draft
        assert fraction == pytest.approx(draft["draft_step_ms"] / draft["target_step_ms"])
        assert draft["draft_forwards_timed"] > 0 and draft["target_forwards_timed"] > 0
        assert sum(window["requests"] for window in draft["live"]) == draft["traffic_prompts_served"]
    printed = capsys.readouterr().out
    assert (
        "draft step / target step" in printed
        and "tokens verified / step" in printed
        and "head@tree:6" in printed
        and "early-exit:1" in printed
    )
    assert png.stat().st_size > 0


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--draft", "head", "--compare-drafts", "head,early-exit:1"], "not allowed with argument --draft"),
        (["--compare-drafts", "head,early-exit:x"], "'early-exit:x' is not a draft spec"),
        (["--compare-drafts", "head,ngram"], "'ngram' is not a draft bench-drift trains"),
        (["--compare-drafts", "head,./no-such-draft"], "'./no-such-draft' is not a draft bench-drift trains"),
        (["--compare-drafts", "head"], "name at least two drafts"),
        (["--compare-drafts", "head,early-exit:1,head"], "'head' is named twice"),
        (["--compare-drafts", "head,head@tree:0"], "'head@tree:0': @tree:N needs a node budget N >= 1"),
        (["--compare-drafts", "head,early-exit:1@tree:8"], "only a head draft builds trees"),
    ],
)
def test_bad_draft_lists_are_argparse_errors(extra, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench-drift", *extra])
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_an_early_exit_the_target_cannot_hold_fails_before_any_run(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The tiny target has 4 layers: early-exit:4 is refused once the first draft's target is loaded,
    before its run starts (no redis-server is started either: REDIS_URL names nothing that listens)."""
    monkeypatch.setenv("ADAPTIVE_SPEC_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    argv = ["bench-drift", "--target", str(tiny_model_dir), "--compare-drafts", "head,early-exit:4"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "'early-exit:4' does not fit the target: early-exit:N needs 1 <= N < 4" in err
    assert main([*argv, "--scenario", "python:60"]) == 2
    assert "--compare-drafts does not apply to --scenario" in capsys.readouterr().err
