"""The online trainer end to end: a real redis-server, records from a tiny random Llama served by the Engine.

Run: .venv/bin/python -m pytest tests/trainer/test_online.py -q   (CPU, one thread, about 20 s)

What must hold:

- fed a narrow domain's traffic through the stream, the trainer promotes an adapter: a PEFT
  directory whose checksum verifies and whose metadata holds the gate figures; on held-out
  records it drafts clearly better than the base draft, while an lr = 0 trainer promotes nothing
  (its candidate is the champion) and a rejected round leaves the champion's weights in place;
- a promoted version ships the n-gram index of its lineage's outputs, covered by its checksum; a
  server loads it with the adapter, and `ngram+` drafts copy from it (more accepted tokens per
  target forward on prompts seen before, the same greedy output);
- entries are acknowledged only by a checkpoint that contains them (at once without one);
- a trainer killed before acknowledging loses nothing: the entries come back to its consumer
  name at once and to any other consumer once idle;
- a trainer built on the same checkpoint_dir has the same buffer, held-out set, champion,
  counters and next version number.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import torch
from polling import wait_for

# pytest --import-mode=importlib adds no test dir; the tiny models live with the engine tests.
from tiny import llama
from traffic import greedy_records

from adaptive_spec import Engine
from adaptive_spec.contracts import METADATA_FILE, NGRAMS_FILE, TRAINER_STATUS_KEY
from adaptive_spec.drafters.early_exit import build_early_exit
from adaptive_spec.drafters.ngram_index import MAX_ENTRIES
from adaptive_spec.formats.adapters import AdapterDir, AdapterError, sha256_file
from adaptive_spec.formats.record import CorrectionRecord
from service.correction_log import CorrectionLogWriter
from trainer.evaluation.decision import StatisticalGate
from trainer.evaluation.gate import Gate, GateFigures, draft_agreement
from trainer.intake.stream import CorrectionStream
from trainer.learning.distill import LoraSettings
from trainer.loop.online import OnlineSettings, OnlineTrainer, RoundResult
from trainer.promotion.versions import AdapterVersion

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]

VOCAB = 64
DOMAIN_TOKENS = 16  # prompts use tokens 0..15 only: a narrow domain, so a 1-layer draft can learn it
PROMPT_LEN, NEW_TOKENS, TOP_M = 8, 16, 8
RECORDS = 128
DOMAINS = ("json", "sql", None)
SETTINGS = LoraSettings(batch_tokens=512)  # the default lr (1e-3), r = 16 on all 7 projections
# A quarter of the records held out gives ~500 positions; 300 lets the first round run after ~3 polls.
GATE = Gate(min_positions=300)
NEVER = 10**9  # min_new_records for trainers that must not train


@pytest.fixture(scope="module")
def target():
    return llama(0, vocab=VOCAB)


@pytest.fixture(scope="module")
def records(target) -> list[CorrectionRecord]:
    """Greedy traffic served by the Engine (k = 1, early-exit:1), logged with the target's top-8."""
    return greedy_records(
        target,
        RECORDS,
        domains=DOMAINS,
        domain_tokens=DOMAIN_TOKENS,
        prompt_len=PROMPT_LEN,
        new_tokens=NEW_TOKENS,
        top_m=TOP_M,
    )


def append(client: redis.Redis, stream: str, records: list[CorrectionRecord]) -> None:
    pipe = client.pipeline()
    for record in records:
        pipe.xadd(stream, {"r": record.encode()})
    pipe.execute()


def make_trainer(
    target, client: redis.Redis, stream: str, consumer: str, root: Path, on_promote=None, **options
) -> OnlineTrainer:
    defaults = dict(
        lora=SETTINGS,
        gate=GATE,
        holdout_fraction=0.25,
        min_new_records=16,
        round_steps=40,
        read_count=32,
        checkpoint_dir=root / "checkpoint",
        target_id="tiny-llama",
        draft_id="early-exit:1",
        max_domains=0,  # one general adapter: these tests are about its loop (per-domain: test_domains.py)
    )
    options = defaults | options
    options.setdefault("max_round_steps", options["round_steps"])  # fixed rounds, unless a test says otherwise
    settings = OnlineSettings(root / "adapters", **options)
    stream = CorrectionStream(client, stream=stream, consumer=consumer)
    return OnlineTrainer(build_early_exit(target, 1), stream, settings, on_promote=on_promote)


def kept(trainer: OnlineTrainer) -> int:
    return len(trainer.buffer) + len(trainer.holdout)


# ---------------------------------------------------------------- learning and promotion


@dataclass
class Learned:
    trainer: OnlineTrainer
    client: redis.Redis
    stream: str
    root: Path
    results: list[RoundResult]
    promoted: list[AdapterVersion]
    written: int
    pending_after: int


@pytest.fixture(scope="module")
def learned(target, records, redis_url, tmp_path_factory) -> Learned:
    """The whole traffic written through the service's CorrectionLogWriter, then consumed 32 records
    a poll with a round after each poll (the first polls are skipped: too few held-out positions)."""
    client, stream, root = redis.Redis.from_url(redis_url), "test:online:learn", tmp_path_factory.mktemp("learn")
    client.delete(stream)
    writer = CorrectionLogWriter(redis_url, stream=stream)
    for record in records:
        writer.submit(record)
    writer.close(timeout=5)
    promoted: list[AdapterVersion] = []
    trainer = make_trainer(
        target, client, stream, "learner", root, on_promote=promoted.append, base_version="tiny-base"
    )
    results = []
    while trainer.poll(block_ms=0):
        results.append(trainer.train_round())
    trainer.checkpoint()
    yield Learned(trainer, client, stream, root, results, promoted, writer.written, trainer.stream.pending_count())
    client.close()


def test_trainer_promotes_an_adapter_that_beats_the_base_draft_on_held_out_traffic(learned, target):
    trainer = learned.trainer
    trained = [result for result in learned.results if result.trained]
    print(f"\n{len(learned.results)} polls, {len(trained)} rounds in {trainer.train_s:.1f} s:")
    for result in learned.results:
        print(
            f"  {result.reason}"
            if not result.trained
            else f"  round {result.round}: loss {result.first_loss:.3f} -> {result.last_loss:.3f}, greedy match "
            f"{result.champion.greedy_match:.3f} -> {result.candidate.greedy_match:.3f} over "
            f"{result.candidate.positions} positions, promoted {result.promoted}"
        )
    assert learned.written == RECORDS
    assert trainer.records_consumed == RECORDS and kept(trainer) == RECORDS
    assert trainer.tokens_consumed == RECORDS * NEW_TOKENS
    assert not learned.results[0].trained and "held-out set has" in learned.results[0].reason
    assert trainer.rounds == len(trained) >= 1 and trainer.adapters_promoted == len(learned.promoted) >= 1
    assert trainer.champion_version == learned.promoted[-1].version == len(learned.promoted)
    assert [v.version for v in learned.promoted] == list(range(1, len(learned.promoted) + 1))
    assert learned.promoted[0].parent_version is None and trainer.next_version == trainer.champion_version + 1

    # The champion served on a plain draft (transformers' load_adapter) against the base draft, on the
    # final held-out set (~32 records, ~500 positions). Measured: 0.08 -> 0.33 greedy match.
    heldout = trainer.holdout.records
    base = draft_agreement(build_early_exit(target, 1), heldout)
    served = build_early_exit(target, 1)
    served.load_adapter(str(trainer.champion_path), adapter_name="champion")
    served.set_adapter("champion")
    champion = draft_agreement(served, heldout)
    print(f"held-out {base.positions} positions: base {base}\n  champion v{trainer.champion_version:04d} {champion}")
    assert champion.positions == base.positions >= GATE.min_positions
    assert champion.greedy_match >= base.greedy_match + 0.1
    assert champion.expected_acceptance > base.expected_acceptance
    assert champion == draft_agreement(trainer.trainer.model, heldout)  # the trainer holds the champion


def test_version_directory_is_a_peft_adapter_with_gate_figures_and_a_checksum_that_verifies(learned, tmp_path):
    version = learned.promoted[0]
    path = version.path
    assert path == learned.root / "adapters" / "v0001" and version.name == "v0001"
    assert {"adapter_config.json", "adapter_model.safetensors", METADATA_FILE, "checksum.sha256"} <= {
        p.name for p in path.iterdir()
    }
    assert not list(path.parent.glob(".*"))  # no temporary directory left behind

    digest = hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()
    listed = (path / "checksum.sha256").read_text().splitlines()  # the weights, then the n-gram index
    assert listed[0] == f"{digest}  adapter_model.safetensors"
    metadata = AdapterDir(path).metadata().to_dict()
    assert metadata["adapter_sha256"] == digest == version.sha256 and AdapterDir(path).verify()

    assert metadata["version"] == 1 and metadata["parent_version"] is None and metadata["base_version"] == "tiny-base"
    assert metadata["target_id"] == "tiny-llama" and metadata["draft_id"] == "early-exit:1"
    assert GateFigures(**metadata["gate"]["candidate"]) == version.candidate
    assert GateFigures(**metadata["gate"]["champion"]) == version.champion
    assert version.candidate.greedy_match >= version.champion.greedy_match + GATE.margin
    assert metadata["gate"]["margin"] == GATE.margin and "greedy match" in metadata["gate"]["reason"]
    assert math.isfinite(metadata["loss"]) and metadata["loss"] == version.loss
    assert set(metadata["domain_mix"]) == {"json", "sql", "untagged"} and metadata["domain_mix"] == version.domain_mix
    assert sum(metadata["domain_mix"].values()) <= RECORDS

    tampered = tmp_path / "v0001"
    tampered.mkdir()
    for name in ("adapter_model.safetensors", "checksum.sha256", METADATA_FILE):
        (tampered / name).write_bytes((path / name).read_bytes())
    weights = bytearray((tampered / "adapter_model.safetensors").read_bytes())
    weights[-1] ^= 0xFF
    (tampered / "adapter_model.safetensors").write_bytes(weights)
    with pytest.raises(AdapterError, match="checksum"):
        AdapterDir(tampered).verify()


def test_a_promoted_version_ships_the_n_gram_index_of_its_outputs_and_a_server_copies_from_it(learned, target):
    """draft_ngrams.json: what at least two of the lineage's buffered outputs agree on after each
    n-gram, covered by the checksum; loaded into the adapter's slot, it gives `ngram+early-exit:1`
    free proposals on prompts seen before, and greedy output stays the target's."""
    trainer, path = learned.trainer, learned.trainer.champion_path
    version = AdapterDir(path)
    index = version.ngrams(VOCAB)
    assert index and len(index) <= MAX_ENTRIES
    assert version.checksums()[NGRAMS_FILE] == version.metadata().ngrams_sha256 == sha256_file(version.ngrams_file)
    buffered = trainer.buffer.recent_outputs(RECORDS * NEW_TOKENS)  # (prompt, output), newest first: all of them
    assert len(buffered) == len(trainer.buffer) and all(len(output) == NEW_TOKENS for _, output in buffered)
    for ngram, continuation in index.items():
        assert 2 <= len(continuation) <= 8 and occurrences(buffered, list(ngram), continuation) >= 2

    engine = Engine(target, "ngram+early-exit:1", eos_token_id=[])
    engine.load_adapter(path)
    assert engine.adapters.general.ngrams == index
    seen = buffered[:8]
    indexed = [engine.generate(prompt, NEW_TOKENS, k=4) for prompt, _ in seen]
    engine.adapters.general.ngrams = None  # the same adapter without its index
    modelled = [engine.generate(prompt, NEW_TOKENS, k=4) for prompt, _ in seen]
    for (_, output), with_index, without in zip(seen, indexed, modelled, strict=True):
        assert with_index.token_ids == without.token_ids == output  # the records are the target's greedy outputs
    accepted = [sum(out.stats.accepted for out in outs) for outs in (indexed, modelled)]
    forwards = [sum(out.stats.target_forwards for out in outs) for outs in (indexed, modelled)]
    drafts = [sum(out.stats.draft_forwards for out in outs) for outs in (indexed, modelled)]
    print(
        f"\n{len(index)} n-grams; with the index and without: accepted {accepted}, target forwards {forwards}, "
        f"draft forwards {drafts}"
    )
    assert accepted[0] > accepted[1] and forwards[0] < forwards[1] and drafts[0] < drafts[1]


def occurrences(outputs: list[tuple[list[int], list[int]]], ngram: list[int], continuation: list[int]) -> int:
    """How often `ngram` is followed by `continuation` in the outputs (the n-gram may begin in the prompt)."""
    count = 0
    for prompt, output in outputs:
        tokens, first = prompt[-len(ngram) :] + output, len(prompt[-len(ngram) :])
        run = ngram + continuation
        count += sum(tokens[i : i + len(run)] == run for i in range(first - len(ngram), len(tokens) - len(run) + 1))
    return count


def test_the_default_statistical_gate_says_what_it_waits_for_and_promotes_before_1000_positions(
    target, records, redis_client, tmp_path
):
    stream = "test:online:statistical"
    redis_client.delete(stream)
    append(redis_client, stream, records)
    trainer = make_trainer(
        target, redis_client, stream, "statistical", tmp_path, gate=StatisticalGate(), read_count=4, min_new_records=4
    )
    results = []
    while trainer.poll(block_ms=0):
        results.append(trainer.train_round())
    assert any(r.reason.startswith("first candidate when the held-out set reaches 128 positions") for r in results)
    promoted = [r for r in results if r.promoted]
    assert promoted, [r.reason for r in results]
    assert promoted[0].candidate.positions < 1000  # the fixed gate's floor: never reached by this traffic
    assert "confidence, promoted" in promoted[0].reason
    assert all(r.candidate.positions == r.champion.positions for r in results if r.trained)
    status = json.loads(redis_client.get(TRAINER_STATUS_KEY))  # what the dashboard shows
    assert status["message"] == results[-1].reason and status["consumer"] == "statistical"


def test_lr0_trainer_promotes_nothing(target, records, redis_client, tmp_path):
    append(redis_client, "test:online:lr0", records)
    trainer = make_trainer(
        target,
        redis_client,
        "test:online:lr0",
        "lr0",
        tmp_path,
        round_steps=5,
        lora=LoraSettings(batch_tokens=512, lr=0.0),
    )
    results = []
    while trainer.poll(block_ms=0):
        results.append(trainer.train_round())
    trained = [result for result in results if result.trained]
    assert trained and trainer.adapters_promoted == 0 and trainer.champion_version is None
    assert all(result.candidate == result.champion and not result.promoted for result in trained)
    assert not list((tmp_path / "adapters").iterdir())


def test_rejected_round_rolls_back_to_the_champion(target, records, redis_client, tmp_path):
    append(redis_client, "test:online:reject", records)
    trainer = make_trainer(
        target,
        redis_client,
        "test:online:reject",
        "reject",
        tmp_path,
        round_steps=5,
        read_count=RECORDS,
        gate=Gate(min_positions=300, margin=1.0),
    )  # nothing can pass
    before = {name: p.clone() for name, p in trainer.trainer.model.named_parameters() if p.requires_grad}
    assert trainer.poll(block_ms=0) == RECORDS
    result = trainer.train_round()
    assert result.trained and not result.promoted and "below the margin" in result.reason
    assert result.candidate != result.champion  # the candidate did move ...
    after = dict(trainer.trainer.model.named_parameters())
    assert all(torch.equal(after[name], weights) for name, weights in before.items())  # ... and was rolled back
    assert not trainer.trainer.optimizer.state
    assert draft_agreement(trainer.trainer.model, trainer.holdout.records) == result.champion
    assert trainer.last_result == result and trainer.rounds == 1
    skipped = trainer.train_round()  # no new records since
    assert not skipped.trained and "new training records" in skipped.reason and trainer.rounds == 1


def test_on_slow_traffic_a_round_keeps_training_until_records_arrive(target, records, redis_client, tmp_path):
    """run() lets a round go on past round_steps while the next round would still wait for records,
    up to max_round_steps, instead of idling; the round ends as soon as enough records are in."""
    stream = "test:online:longer"
    append(redis_client, stream, records[:64])
    trainer = make_trainer(
        target,
        redis_client,
        stream,
        "longer",
        tmp_path,
        round_steps=3,
        max_round_steps=9,
        read_count=64,
        gate=Gate(min_positions=1, margin=1.0),  # trains, never promotes
    )
    stop = threading.Event()
    worker = threading.Thread(target=trainer.run, args=(stop,), kwargs=dict(checkpoint_every_s=60, poll_block_ms=50))
    worker.start()
    try:
        wait_for(lambda: trainer.rounds >= 1, timeout=60, what="the first round")
    finally:
        stop.set()
        worker.join()
    assert trainer.last_result.trained and trainer.last_result.steps == 9  # no traffic during it: max_round_steps

    append(redis_client, stream, records[64:])  # more than min_new_records new training records
    assert trainer.poll(block_ms=0) and trainer.drain() >= 0
    answers = iter([True, True, False])  # records arrive after the round's 5th step
    result = trainer.train_round(keep_training=lambda: next(answers))
    assert result.trained and result.steps == 3 + 2
    with pytest.raises(ValueError, match="max_round_steps"):
        OnlineSettings(tmp_path / "x", round_steps=20, max_round_steps=10)


def test_when_the_traffic_goes_quiet_a_promoted_lineage_trains_on_until_two_idle_rounds_get_nowhere(
    target, records, redis_client, tmp_path
):
    """Idle rounds: no record for idle_after_s, a promoted version, a ready gate: run() trains a round on
    the buffer again, gated as any. They go on while they promote and stop after two in a row that do not;
    a new record would start them over. A lineage that never promoted gets none."""
    stream = "test:online:idle"
    append(redis_client, stream, records[:64])
    promotes, never = Gate(min_positions=1, margin=-1.0), Gate(min_positions=1, margin=1.0)
    trainer = make_trainer(
        target, redis_client, stream, "idle", tmp_path, round_steps=2, read_count=64, gate=never, idle_after_s=0.2
    )
    assert trainer.poll(block_ms=0) == 64
    assert trainer.idle_lineage(quiet=True) is None  # nothing promoted yet: nothing to refine
    trainer.rounds_part.gate = promotes
    assert trainer.train_round().promoted and not trainer.nothing_to_train  # v1; idle rounds may follow

    stop = threading.Event()
    worker = threading.Thread(target=trainer.run, args=(stop,), kwargs=dict(checkpoint_every_s=60, poll_block_ms=50))
    worker.start()
    try:
        wait_for(lambda: trainer.adapters_promoted >= 3, timeout=60, what="two idle rounds that promote")
        assert "idle round" in trainer.last_result.reason
        trainer.rounds_part.gate = never  # from here on nothing beats the champion
        wait_for(lambda: trainer.nothing_to_train, timeout=60, what="the idle rounds to give up")
        rounds = trainer.rounds
        time.sleep(1.0)
        assert trainer.rounds == rounds and trainer.general.idle_rejections == 2  # it stopped there
    finally:
        stop.set()
        worker.join()
    append(redis_client, stream, records[64:66])  # traffic again: idle rounds may try again once it is quiet
    assert trainer.poll(block_ms=0) == 2 and trainer.general.idle_rejections == 0
    assert trainer.idle_lineage() is None and trainer.idle_lineage(quiet=True) is trainer.general


def test_records_held_out_during_a_long_round_are_scored_for_the_champion_too(target, records, redis_client, tmp_path):
    """A round that keeps training polls, so held-out records may arrive before its candidate is
    promoted. The champion's cached figures are those of the round's snapshot: the next round scores
    the champion on the grown held-out set, both sides on the same records (bench-drift --scenario
    once lost a 67 s round to "scored on different held-out records (8 vs 4)")."""
    stream = "test:online:grown"
    append(redis_client, stream, records[:64])
    promotes = Gate(min_positions=1, margin=-1.0)
    trainer = make_trainer(
        target, redis_client, stream, "grown", tmp_path, round_steps=3, max_round_steps=4, read_count=128, gate=promotes
    )
    assert trainer.poll(block_ms=0) == 64
    held_before = len(trainer.holdout)

    def records_arrive() -> bool:
        append(redis_client, stream, records[64:])
        trainer.poll(block_ms=0)
        return False

    first = trainer.train_round(keep_training=records_arrive)
    assert first.promoted and first.candidate.records.records == held_before < len(trainer.holdout)
    second = trainer.train_round()
    assert second.trained, second.reason
    assert second.champion.positions == second.candidate.positions == trainer.holdout.positions
    assert second.champion.records.records == len(trainer.holdout), second.reason


class _PromotesOnRecords:
    """A gate that promotes any candidate scored on at least `records` held-out records (never, by default)."""

    min_positions = 1

    def __init__(self, margin: float = 0.0) -> None:
        self.margin, self.records = margin, math.inf

    def decide(self, candidate, champion) -> tuple[bool, str]:
        scored = candidate.records.records
        return scored >= self.records, f"{scored} held-out records, promotes at {self.records}"


def test_a_first_round_promotes_at_the_look_that_makes_it_certain(target, records, redis_client, tmp_path):
    """While a lineage's champion is the base draft, held-out records that arrive during a long round
    bring a look at the gate: the round ends at the look where the gate would promote, on the grown
    held-out set, not after max_round_steps. With a champion of its own, a round runs its length."""
    stream = "test:online:look"
    append(redis_client, stream, records[:48])
    gate = _PromotesOnRecords()
    trainer = make_trainer(
        target,
        redis_client,
        stream,
        "look",
        tmp_path,
        round_steps=3,
        max_round_steps=12,
        min_new_records=8,
        read_count=128,
        gate=gate,
    )
    assert trainer.poll(block_ms=0) == 48
    gate.records = len(trainer.holdout) + 1  # not before records arrive

    def records_arrive(batch: list[CorrectionRecord]) -> Callable[[], bool]:
        def keep_training() -> bool:
            if batch:
                append(redis_client, stream, batch)
                batch.clear()
            trainer.poll(block_ms=0)
            return True

        return keep_training

    held = len(trainer.holdout)
    first = trainer.train_round(keep_training=records_arrive(list(records[48:88])))
    assert first.promoted and first.steps == 4, first.reason  # 3 steps, the records arrive, 1 step, the look
    assert first.candidate.records.records == first.champion.records.records == len(trainer.holdout) > held
    assert "after 1 look at held-out records that arrived during the round" in first.reason
    held = len(trainer.holdout)
    gate.records = held + 1
    second = trainer.train_round(keep_training=records_arrive(list(records[88:])))
    assert len(trainer.holdout) > held  # records arrived, and were not looked at: v1 is the champion now
    assert second.trained and second.steps == 12 and "look" not in second.reason, second.reason
    assert second.candidate.records.records == held


@pytest.mark.parametrize("margin", [0.0, 1.0])
def test_a_candidate_ahead_but_not_yet_certain_is_trained_on_in_the_next_round(
    margin, target, records, redis_client, tmp_path
):
    """A candidate that beats its champion on the held-out records by more than the gate's margin, but
    without the gate's confidence, is not thrown away: the next round starts from its weights. Ahead by
    less than the margin (1.0 here), it is rolled back and the next round starts from the champion."""
    stream = f"test:online:carry:{margin}"
    append(redis_client, stream, records[:64])
    trainer = make_trainer(
        target,
        redis_client,
        stream,
        "carry",
        tmp_path,
        round_steps=20,
        min_new_records=8,
        read_count=128,
        gate=_PromotesOnRecords(margin),
    )
    trainer.poll(block_ms=0)
    draft, starts, ends = trainer.trainer, [], []
    train_step = draft.train_step

    def spy(batch):
        starts.append(draft.lora_state())
        loss = train_step(batch)
        ends.append(draft.lora_state())
        return loss

    draft.train_step = spy
    first = trainer.train_round()
    assert first.trained and not first.promoted
    assert first.candidate.greedy_match > first.champion.greedy_match  # ahead, by more than 0
    assert first.candidate.expected_acceptance >= first.champion.expected_acceptance
    append(redis_client, stream, records[64:])
    trainer.poll(block_ms=0)
    second = trainer.train_round()
    assert second.trained and len(starts) == 40
    candidate, champion = ends[19], starts[0]  # the first round's last weights; the base draft's
    assert not all(torch.equal(candidate[name], champion[name]) for name in champion)
    start = candidate if margin == 0.0 else champion
    assert all(torch.equal(starts[20][name], start[name]) for name in start)
    assert ("the next round trains on from this candidate" in first.reason) == (margin == 0.0), first.reason


# ---------------------------------------------------------------- acknowledgement


def test_entries_stay_pending_until_a_checkpoint_contains_them(target, records, redis_client, tmp_path):
    stream = "test:online:ack"
    append(redis_client, stream, records[:40])
    trainer = make_trainer(target, redis_client, stream, "acker", tmp_path, min_new_records=NEVER)
    assert trainer.poll(block_ms=0) == 32
    assert trainer.stream.pending_count() == 32  # in memory only: not safe yet
    path = trainer.checkpoint()
    assert trainer.stream.pending_count() == 0
    assert {p.name for p in path.iterdir()} == {"adapter", "buffer.bin", "holdout.bin", "state.json"}
    assert (tmp_path / "checkpoint" / "LATEST").read_text() == path.name

    # run(): what it read after the last periodic checkpoint is acknowledged by its final one.
    append(redis_client, stream, records[40:60])
    stop = threading.Event()
    started = time.monotonic()
    counters = trainer.run(stop, budget_s=0.5, checkpoint_every_s=60, poll_block_ms=100)
    assert time.monotonic() - started < 3
    assert counters["records_consumed"] == 60 == kept(trainer) and counters["unacknowledged"] == 0
    assert trainer.stream.pending_count() == 0
    assert [p.name for p in (tmp_path / "checkpoint").iterdir() if p.name.startswith("ckpt-")] == ["ckpt-000002"]


def test_without_checkpoint_dir_entries_are_acknowledged_once_buffered(target, records, redis_client, tmp_path):
    append(redis_client, "test:online:nockpt", records[:20])
    trainer = make_trainer(
        target, redis_client, "test:online:nockpt", "plain", tmp_path, checkpoint_dir=None, min_new_records=NEVER
    )
    assert trainer.poll(block_ms=0) == 20 and kept(trainer) == 20
    assert trainer.stream.pending_count() == 0
    with pytest.raises(ValueError, match="no checkpoint_dir"):
        trainer.checkpoint()


def test_between_rounds_the_loop_drains_a_backlog_not_one_read(target, records, redis_client, tmp_path):
    """A fleet writes faster than one read per round: run() takes the whole backlog before it trains
    (`drain`), and stops at a read that is not full."""
    stream = "test:online:backlog"
    append(redis_client, stream, records[:100])
    trainer = make_trainer(target, redis_client, stream, "drainer", tmp_path, min_new_records=NEVER)
    assert trainer.poll(block_ms=0) == 32  # one read: read_count
    assert trainer.drain() == 68 and kept(trainer) == 100
    assert trainer.drain() == 0
    append(redis_client, stream, records[100:110])
    counters = trainer.run(threading.Event(), budget_s=0.3, checkpoint_every_s=60, poll_block_ms=50)
    assert counters["records_consumed"] == 110 and trainer.stream.pending_count() == 0


# ---------------------------------------------------------------- faults: kill and restart


def test_killed_trainer_loses_nothing_when_restarted_under_its_consumer_name(target, records, redis_client, tmp_path):
    stream = "test:online:kill"
    append(redis_client, stream, records[:50])
    first = make_trainer(target, redis_client, stream, "trainer-1", tmp_path, min_new_records=NEVER, read_count=20)
    assert first.poll(block_ms=0) == 20
    first.checkpoint()  # these 20 are safe and acknowledged
    assert first.poll(block_ms=0) == 20  # these 20 are read, then the trainer is killed
    del first
    assert redis_client.xpending(stream, "adaptive-spec-trainer")["pending"] == 20
    append(redis_client, stream, records[50:60])

    second = make_trainer(target, redis_client, stream, "trainer-1", tmp_path, min_new_records=NEVER, read_count=20)
    assert kept(second) == 20  # restored from the checkpoint
    # Its own 20 pending (XREADGROUP 0), then 20 new: the 10 never read and the 10 written since.
    assert second.poll(block_ms=0) == 20 + 20
    assert second.poll(block_ms=0) == 0
    assert kept(second) == second.records_consumed == 60 and second.duplicates == 0
    ids = {r.request_id for r in second.holdout.records} | {e.request_id for e in second.buffer._examples}
    assert ids == {record.request_id for record in records[:60]}
    second.checkpoint()
    assert second.stream.pending_count() == 0


def test_another_consumer_reclaims_a_dead_trainers_entries_once_idle(target, records, redis_client, tmp_path):
    stream = "test:online:reclaim"
    append(redis_client, stream, records[:50])
    dead = make_trainer(target, redis_client, stream, "dead", tmp_path / "dead", min_new_records=NEVER, read_count=50)
    heir = make_trainer(
        target,
        redis_client,
        stream,
        "heir",
        tmp_path / "heir",
        min_new_records=NEVER,
        read_count=20,
        reclaim_idle_ms=100,
    )
    assert dead.poll(block_ms=0) == 50
    del dead  # killed before any checkpoint: all 50 pending on "dead"
    assert heir.poll(block_ms=0) == 0  # nothing new, nothing idle long enough yet
    time.sleep(0.15)
    received = [heir.poll(block_ms=0) for _ in range(4)]
    assert received == [20, 20, 10, 0]
    assert kept(heir) == heir.records_consumed == 50
    heir.checkpoint()
    assert heir.stream.pending_count() == 0


def test_run_rides_out_a_redis_restart(target, records, redis_server, tmp_path):
    """The server restarts without persistence: stream and group are gone, the trainer recreates the
    group and goes on with what it holds plus what is written after."""
    stream, client = "test:online:outage", redis.Redis.from_url(redis_server.url)
    trainer = make_trainer(target, client, stream, "survivor", tmp_path, min_new_records=NEVER)
    append(client, stream, records[:10])
    stop = threading.Event()
    options = {"checkpoint_every_s": 0.2, "poll_block_ms": 100}
    worker = threading.Thread(target=trainer.run, args=(stop,), kwargs=options)
    worker.start()
    try:
        wait_for(lambda: trainer.records_consumed == 10)
        redis_server.stop()
        time.sleep(0.5)
        assert worker.is_alive()
        redis_server.start()
        append(client, stream, records[10:20])
        wait_for(lambda: trainer.records_consumed == 20)
    finally:
        stop.set()
        worker.join(10)
    assert not worker.is_alive() and kept(trainer) == 20
    assert trainer.stream.pending_count() == 0
    client.close()


def test_before_its_first_round_a_running_trainer_says_what_it_waits_for(target, records, redis_client, tmp_path):
    append(redis_client, "test:online:waiting", records[:5])
    trainer = make_trainer(target, redis_client, "test:online:waiting", "patient", tmp_path, min_new_records=1000)
    trainer.run(threading.Event(), budget_s=1.5, poll_block_ms=100)
    status = json.loads(redis_client.get(TRAINER_STATUS_KEY))  # what the dashboard shows a new user
    assert status["state"] == "waiting" and status["round"] == 0
    assert status["message"] == f"{trainer.general.new_records} new training records, need 1000"


# ---------------------------------------------------------------- resume


def test_resumed_trainer_has_the_same_buffer_champion_and_version_numbers(learned, target):
    trainer = learned.trainer
    assert learned.pending_after == 0
    resumed = OnlineTrainer(
        build_early_exit(target, 1),
        CorrectionStream(learned.client, stream=learned.stream, consumer="learner"),
        OnlineSettings(
            learned.root / "adapters",
            checkpoint_dir=learned.root / "checkpoint",
            lora=SETTINGS,
            gate=GATE,
            holdout_fraction=0.25,
            target_id="tiny-llama",
            draft_id="early-exit:1",
        ),
    )
    assert len(resumed.buffer) == len(trainer.buffer) and resumed.buffer.tokens == trainer.buffer.tokens
    assert [e.request_id for e in resumed.buffer._examples] == [e.request_id for e in trainer.buffer._examples]
    assert resumed.holdout.records == trainer.holdout.records
    assert resumed.champion_version == trainer.champion_version >= 1
    assert resumed.next_version == trainer.next_version
    assert resumed.last_result == trainer.last_result
    for name in ("records_consumed", "tokens_consumed", "train_s", "adapters_promoted", "rounds"):
        assert getattr(resumed, name) == getattr(trainer, name), name
    heldout = trainer.holdout.records
    assert draft_agreement(resumed.trainer.model, heldout) == draft_agreement(trainer.trainer.model, heldout)
    assert resumed.rng.bit_generator.state == trainer.rng.bit_generator.state
    assert resumed.poll(block_ms=0) == 0  # everything was acknowledged; nothing comes back

    state = json.loads(
        (learned.root / "checkpoint" / (learned.root / "checkpoint" / "LATEST").read_text() / "state.json").read_text()
    )
    assert state["champion_version"] == trainer.champion_version and state["consumer"] == "learner"


def test_version_numbers_never_reuse_an_existing_directory(target, redis_client, tmp_path):
    (tmp_path / "adapters" / "v0003").mkdir(parents=True)
    trainer = make_trainer(target, redis_client, "test:online:versions", "v", tmp_path, checkpoint_dir=None)
    assert trainer.next_version == 4 and trainer.champion_version is None and trainer.champion_path is None


def test_a_promoted_version_serves_in_the_engine_with_its_draft_vocabulary(learned, target, records):
    """What the trainer writes is what a server loads: the merged adapter, restricted to the tokens
    the traffic used, still gives the target's exact greedy output and agrees with it more."""
    path = learned.promoted[-1].path
    vocab = json.loads((path / "draft_vocab.json").read_text())["token_ids"]
    assert vocab == sorted(set(vocab)) and 0 < len(vocab) < target.config.vocab_size
    # Written at promotion; records that came later may hold a few tokens it has not seen.
    outputs = [t for r in learned.trainer.holdout.records for t in r.output_ids]
    assert sum(t in set(vocab) for t in outputs) >= 0.95 * len(outputs)
    engine = Engine(target, "early-exit:1", eos_token_id=[])
    prompts = [r.prompt_ids for r in learned.trainer.holdout.records[:6]]
    base = [engine.generate(p, NEW_TOKENS, k=1) for p in prompts]
    engine.load_adapter(path)
    assert engine.adapter_version == str(learned.promoted[-1].version)
    served = [engine.generate(p, NEW_TOKENS, k=1) for p in prompts]
    assert all(s.token_ids == b.token_ids for s, b in zip(served, base, strict=True))
    assert all(set(t for t in s.proposed if t >= 0) <= set(vocab) for s in served)
    assert sum(s.stats.accepted for s in served) > sum(b.stats.accepted for b in base)
