"""bench-head-ablation on the tiny model: records generated on the serving path (and kept), heads trained
per recipe over an fp32 target, match by depth reported; a second run reads the records back.

    .venv/bin/python -m pytest tests/benchmarks/test_head_ablation.py -q
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.head_ablation import format_report, merged, plot, run_ablation, write_figures
from benchmarks.settings import AblationSettings

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def tiny(tiny_model_dir, tmp_path, monkeypatch) -> AblationSettings:
    """What the runs on the tiny model share: eager, a data directory of the test's own, 2 held-out records
    scored after every step, the records kept in a file."""
    monkeypatch.setenv("ADAPTIVE_SPEC_COMPILE", "0")
    monkeypatch.setenv("ADAPTIVE_SPEC_DATA_DIR", str(tmp_path / "data"))
    return AblationSettings(
        target=str(tiny_model_dir), heldout_records=2, eval_every=1, records_file=tmp_path / "records.bin"
    )


def test_recipes_train_and_report_match_by_depth(tiny, tmp_path):
    settings = replace(
        tiny,
        recipes=("rank-64", "unroll-2-decay-0.5-rank-64"),
        train_records=4,
        max_new_tokens=8,
        steps=2,
        batch_tokens=256,
        depth=3,
        json=tmp_path / "ablation.json",
    )
    figures = run_ablation(settings)
    assert settings.records_file.stat().st_size > 0
    assert figures["train_records"] == 4 and figures["heldout_records"] == 2
    for name in settings.recipes:
        result = figures["recipes"][name]
        assert [point["step"] for point in result["curve"]] == [0, 1, 2]
        assert len(result["chain_match"]) == 3  # match by depth, 1..depth
        assert 0.0 <= result["match_1"] <= 1.0 and result["match_1"] == result["chain_match"][0]
    assert json.loads(settings.json.read_text())["recipes"].keys() == set(settings.recipes)
    assert "unroll-2-decay-0.5-rank-64" in format_report(figures)

    again = run_ablation(settings)  # the records are read back, not generated again
    assert again["train_tokens"] == figures["train_tokens"]


def test_a_prompt_file_and_a_subset_of_its_records(tiny, tmp_path):
    """--prompts FILE instead of a shipped domain; reading the records back with fewer --train-records trains
    on a subset of them, scored on the same held-out records (a learning curve over data)."""
    prompts = tmp_path / "questions.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"What is {n} + {n}?"}]}) + "\n" for n in range(12)
        )
    )
    settings = replace(
        tiny,
        prompts=prompts,
        recipes=("rank-16",),
        train_records=5,
        max_new_tokens=6,
        steps=1,
        batch_tokens=128,
        depth=2,
        eval_prompts=2,
    )
    whole = run_ablation(settings)
    assert whole["domain"] == "questions" and whole["train_records"] == 5 and whole["heldout_records"] == 2
    subset = run_ablation(replace(settings, train_records=2))
    assert subset["train_records"] == 2 and 0 < subset["train_tokens"] < whole["train_tokens"]
    assert subset["heldout_request_ids"] == whole["heldout_request_ids"]  # scored on the same held-out records
    assert len(set(whole["heldout_request_ids"])) == 2
    with pytest.raises(ValueError, match="none left to train on"):
        run_ablation(replace(settings, heldout_records=7))
    # the records read back name their prompts, whatever --domain says
    assert run_ablation(replace(settings, prompts=None, domain="chat", train_records=1))["domain"] == "questions"


def test_runs_on_different_record_counts_merge_by_count(tmp_path):
    """--from-json over a learning curve: one recipe trained on 88 and on 352 records stays two lines, a merged
    file merges again, and runs scored on other held-out records are refused."""

    def run(count: int, match: float, heldout: int = 24) -> Path:
        curve = [{"step": 0, "match_1": 0.0, "chain_match": [0.0], "accepted_per_round": 0.0}]
        result = {"curve": curve, "match_1": match, "chain_match": [match], "accepted_per_round": match}
        result |= {"train_s": 1.0, "recipe": "rank-16", "train_records": count, "train_tokens": 10 * count}
        figures = {"domain": "stdlib", "target": "m", "train_records": count, "heldout_records": heldout}
        figures |= {"train_tokens": 10 * count, "batch_tokens": 2048, "depth": 1, "recipes": {"rank-16": result}}
        path = tmp_path / f"{count}-{heldout}.json"
        path.write_text(json.dumps(figures))
        return path

    figures = merged([run(352, 0.56), run(88, 0.41)])
    assert {name: result["match_1"] for name, result in figures["recipes"].items()} == {
        "rank-16, 352 records": 0.56,
        "rank-16, 88 records": 0.41,
    }
    assert (figures["train_records"], figures["train_records_most"], figures["train_tokens"]) == (88, 352, None)
    plot(figures, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0
    assert merged([run(352, 0.56)])["recipes"].keys() == {"rank-16"}  # one run: names as they were

    again = tmp_path / "merged.json"
    write_figures(again, figures)
    assert merged([again, run(176, 0.5)])["recipes"].keys() == {
        "rank-16, 352 records",
        "rank-16, 88 records",
        "rank-16, 176 records",
    }
    with pytest.raises(ValueError, match="heldout_records differs"):
        merged([run(352, 0.56), run(88, 0.41, heldout=32)])
    with pytest.raises(ValueError, match="two of the files"):
        merged([again, run(88, 0.41)])
    with pytest.raises(ValueError, match="domain differs"):
        merged([run(352, 0.56), _renamed(run(88, 0.41), domain="python")])
    longer = _renamed(
        run(88, 0.41), curve=[{"step": 600, "match_1": 0.5, "chain_match": [0.5], "accepted_per_round": 0.5}]
    )
    assert "rank-16, 88 records, 600 steps" in merged([run(352, 0.56), longer])["recipes"]  # the same recipe, longer
    old = json.loads(again.read_text())  # a merge written before the recipes kept their counts
    for result in old["recipes"].values():
        del result["train_records"]
    again.write_text(json.dumps(old))
    with pytest.raises(ValueError, match="lack their counts"):
        merged([again])
    with pytest.raises(ValueError, match="not a bench-head-ablation result file"):
        merged([_renamed(run(88, 0.41), drop="recipes")])


def _renamed(path: Path, domain: str | None = None, curve: list | None = None, drop: str | None = None) -> Path:
    """The result file at `path` with its domain or its recipes' curves replaced, or a key dropped."""
    figures = json.loads(path.read_text())
    if domain:
        figures["domain"] = domain
    for result in figures["recipes"].values():
        result["curve"] = curve or result["curve"]
    figures.pop(drop or "", None)
    out = path.with_name(f"{path.stem}-{domain}-{bool(curve)}-{drop}.json")
    out.write_text(json.dumps(figures))
    return out
