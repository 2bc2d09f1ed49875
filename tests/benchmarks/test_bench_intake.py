"""The intake benchmark end to end on the tiny model (tests/conftest.py `tiny_model_dir`), a few dozen
records through a real redis-server: every record read and acknowledged once by each part, every
figure positive and finite. No timing is asserted: the machine is shared.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/benchmarks/test_bench_intake.py -x -q
"""

import json
import math

import numpy as np
import pytest

import cli
from adaptive_spec.formats.record import CorrectionRecord
from benchmarks.settings import IntakeBenchSettings
from benchmarks.synthetic import synthetic_record

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]

RECORDS = 48


def test_synthetic_records_have_the_servers_shape():
    settings = IntakeBenchSettings(prompt_tokens=(100, 200), output_tokens=64, topk=16)
    rng = np.random.default_rng(0)
    for _ in range(20):
        record = synthetic_record(rng, settings, vocab=49152, draft_id="early-exit:4")
        record.validate()  # ids in the vocabulary, accepted tokens equal to their proposals
        assert 100 <= len(record.prompt_ids) <= 200 and len(record.output_ids) == 64
        assert record.target_topk_ids.shape == (64, 16)
        assert (record.target_topk_ids[:, 0] == record.output_ids).all()  # greedy: the target's top-1 is the output
        assert all(len(set(row)) == 16 for row in record.target_topk_ids.tolist())
        logprobs = record.target_topk_logprobs.astype(np.float64)  # [64, 16]
        assert (np.diff(logprobs, axis=1) <= 0).all() and (np.exp(logprobs).sum(axis=1) <= 1.01).all()
        assert record.proposed[0] == -1 and any(record.accepted)  # the prefill's token was never drafted
        assert CorrectionRecord.decode(record.encode()) == record
    assert 4500 < record.encoded_size < 5100  # the size the module docstring gives, about 4.8 kB


def main(argv: list[str]) -> int:
    """`adaptive-spec bench-intake ARGV` (cli/studies.py)."""
    return cli.main(["bench-intake", *argv])


def test_a_short_run_acknowledges_every_record_once_and_reports_every_figure(
    tiny_model_dir, redis_url, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("REDIS_URL", redis_url)  # a stream of its own, deleted at the end
    path = tmp_path / "intake.json"
    argv = [
        "--target",
        str(tiny_model_dir),
        "--draft",
        "early-exit:1",
        "--records",
        str(RECORDS),
        "--prompt-tokens",
        "8,16",
        "--output-tokens",
        "24",
        "--topk",
        "8",
        "--loop-minutes",
        "0.5",
        "--json",
        str(path),
    ]
    assert main(argv) == 0
    figures = json.loads(path.read_text())

    assert figures["records"] == RECORDS
    for part in ("intake", "loop"):  # each part's consumer group read and acknowledged every entry exactly once
        assert figures[f"{part}_records"] == RECORDS
        assert figures[f"{part}_entries_read"] == RECORDS
        assert figures[f"{part}_acknowledged"] == RECORDS
        assert figures[f"{part}_pending"] == 0
    assert figures["intake_rounds"] == 0 and figures["rounds"] >= 1  # 48 records of 24 tokens: enough for a round
    for key in ("intake_records_s", "loop_records_s", "round_s", "round_train_s", "intake_s", "loop_s"):
        assert math.isfinite(figures[key]) and figures[key] > 0, key
    assert len(figures["load_average_start"]) == len(figures["load_average_end"]) == 3
    assert "synthetic records of real shape" in figures["synthetic"]
    table = capsys.readouterr().out
    assert "intake alone" in table and "trainer loop" in table and "synthetic records of real shape" in table


def test_help_says_what_is_measured(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "intake alone" in text and "adaptive-spec train" in text and "--loop-minutes" in text


def test_a_draft_with_nothing_to_train_is_refused_before_anything_starts(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--draft", "ngram"])
    assert exit_info.value.code == 2 and "--draft ngram" in capsys.readouterr().err
