"""bench-drift end to end on a tiny model: before, traffic through real Redis with the trainer
running, after, and the extra fixed-k measurements, all within the budget."""

import subprocess
import sys

import numpy as np
import pytest
from tiny import llama

from adaptive_spec import Engine
from adaptive_spec.contracts import sqlite_tracking_uri
from adaptive_spec.outputs.prompts import PromptItem
from benchmarks.bench import run_bench
from benchmarks.drift import DriftBenchSettings, format_report, run_drift, split_prompts

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]


@pytest.mark.parametrize("draft", ["early-exit:1", "head"])
def test_a_short_run_reports_every_figure(draft, redis_url, tmp_path, monkeypatch):
    monkeypatch.setenv("REDIS_URL", redis_url)  # a stream of its own, deleted at the end
    engine = Engine(llama(0, vocab=64), draft, eos_token_id=[], record_topk=8)
    rng = np.random.default_rng(0)
    items = [PromptItem(rng.integers(0, 16, 8).tolist()) for _ in range(40)]
    settings = DriftBenchSettings(
        budget_minutes=0.75,
        eval_prompts=6,
        max_new_tokens=12,
        traffic_new_tokens=20,  # traffic answers longer than the measurements'
        train_tail_s=5,
        gate_min_positions=50,
        after_k=(2,),
    )
    figures = run_drift(engine, items, "tiny", settings, redis_url, tmp_path, progress=False)

    assert figures["before"]["identical"] is True and figures["after"]["identical"] is True
    assert set(figures["after_fixed_k"]) == {"2"} and figures["after_fixed_k"]["2"]["identical"] is True
    assert 0 < figures["traffic_prompts_served"] <= len(items) - 6
    assert figures["records_written"] + figures["records_dropped"] == figures["traffic_prompts_served"]
    assert figures["records_consumed"] <= figures["records_written"]
    assert figures["elapsed_minutes"] <= settings.budget_minutes + 0.25
    for key in ("domain", "records_consumed", "tokens_consumed", "train_s", "adapters_promoted", "budget_minutes"):
        assert key in figures
    assert "after at fixed k=2" in format_report(figures)
    assert figures["draft_step_fraction"] > 0 and figures["draft_forwards_timed"] > 0  # timed, after training
    assert figures["records_consumed"] > 0  # the trainer read the traffic for this draft
    # no end-of-sequence token: every traffic answer runs its 20 tokens (the measurements their 12)
    assert figures["tokens_consumed"] == 20 * figures["records_consumed"]
    assert figures["traffic_new_tokens"] == 20 and figures["max_new_tokens"] == 12


def test_a_bf16_server_trains_its_draft_over_an_fp32_target_of_the_trainers_own(
    tiny_model_dir, redis_url, tmp_path, monkeypatch, caplog
):
    """The default path serves in bf16 where the CPU has it, and the trainer trains in fp32: lending it the
    server's bf16 target crashed the head's first round (float != BFloat16), so nothing ever trained."""
    monkeypatch.setenv("REDIS_URL", redis_url)
    engine = Engine.from_pretrained(
        str(tiny_model_dir), "head", device="cpu", dtype="bf16", compile=False, eos_token_id=[], record_topk=8
    )
    assert engine.dtype_name == "bf16"
    rng = np.random.default_rng(0)
    # The first round waits for 4 held-out records and gate_min_positions held-out positions, and which
    # records are held out follows a hash of their random request ids (20%). With 26 traffic records of
    # 12 tokens against 50 positions, 1 run in 5 had no round ("36 positions in 3 records now"; a
    # fresh-clone run failed so); 76 records against 24 positions leave it without one at odds of 6e-5.
    items = [PromptItem(rng.integers(3, 60, 8).tolist()) for _ in range(80)]
    settings = DriftBenchSettings(
        budget_minutes=1.0, eval_prompts=4, max_new_tokens=12, train_tail_s=5, gate_min_positions=24
    )
    figures = run_drift(engine, items, "tiny", settings, redis_url, tmp_path, progress=False)
    assert figures["before"]["identical"] is True and figures["after"]["identical"] is True
    assert figures["records_consumed"] > 0
    assert figures["train_s"] > 0, "no round trained"  # the crash came in the first round
    assert "trainer stopped with an error" not in caplog.text


def test_a_run_from_a_start_version_serves_it_from_the_first_measurement_and_trains_on_from_it(
    tiny_model_dir, redis_url, tmp_path, monkeypatch
):
    """--start-version (a deployment that ran `distill` first): the version is the run's registry's champion,
    the "before" measurement drafts with it, the trainer adopts it as the champion it trains from, and what
    the trainer promotes is registered after it."""
    from adapter_files import write_adapter
    from tiny import tiny_target

    from registry.client import AdapterRegistry

    monkeypatch.setenv("REDIS_URL", redis_url)
    warm = write_adapter(  # shaped as the trainer's own LoRA (rank 16): one it can train on from
        tiny_target(0),
        1,
        tmp_path / "warm",
        3,
        rank=16,
        target_id=str(tiny_model_dir),
        draft_id="early-exit:1",
        version=7,
        domain="tiny",  # a domain's adapter starts a run as the general champion all the same
    )
    engine = Engine.from_pretrained(
        str(tiny_model_dir), "early-exit:1", device="cpu", dtype="fp32", compile=False, eos_token_id=[], record_topk=8
    )
    rng = np.random.default_rng(0)
    items = [PromptItem(rng.integers(3, 60, 8).tolist()) for _ in range(80)]
    settings = DriftBenchSettings(
        budget_minutes=1.0,
        eval_prompts=4,
        max_new_tokens=12,
        k=2,  # a fixed k: the held-out counts depend on the draft's weights alone
        train_tail_s=5,
        gate_min_positions=24,
        start_adapter=warm,
        start_version="7",
    )
    held_out = split_prompts(items, settings.eval_prompts, settings.seed)[0]
    base = run_bench(engine, held_out, settings.max_new_tokens, settings.k, hf=False, progress=False)
    workdir = tmp_path / "run"
    figures = run_drift(engine, items, "tiny", settings, redis_url, workdir, progress=False)

    assert figures["before"]["identical"] is True and figures["after"]["identical"] is True
    assert (figures["before"]["drafted"], figures["before"]["accepted"]) != (base["drafted"], base["accepted"])
    assert figures["adoptions"] == 1  # the trainer took the start version as its champion
    assert figures["records_consumed"] > 0 and figures["versions_not_registered"] == 0
    assert figures["start_version"] == "7" and "started warm from --start-version 7" in format_report(figures)
    registry = AdapterRegistry(sqlite_tracking_uri(workdir), data_dir=workdir)
    try:
        # The start version is the registry's 1; the trainer trains one general adapter from it, and each
        # promotion, registered in turn, was trained from the one before (a candidate whose parent is not
        # the champion would have been registered without promoting it: trainer/promotion/pending.py).
        assert registry.served().version == str(1 + figures["adapters_promoted"])
        assert registry.champions() == {None: registry.served().version}  # no domain lineage
    finally:
        registry.close()


def test_start_version_does_not_apply_to_compare_drafts():
    run = subprocess.run(
        [sys.executable, "-m", "cli", "bench-drift", "--start-version", "3", "--compare-drafts", "head,ngram+head"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "--start-version does not apply to --compare-drafts" in run.stderr
