"""The replay buffer and the held-out split.

Run: .venv/bin/python -m pytest tests/trainer/test_buffer.py -q   (under a second)

What must hold:

- the buffer evicts oldest first by input tokens, and refuses duplicates (the stream is
  at-least-once), useless examples and examples larger than the whole budget;
- a sampled batch stays within its token budget, never repeats an example, and reaches every example;
- its latest outputs, split from their prompts, are what a version's n-gram index is built from;
- the held-out decision is a pure function of the request id (stable across instances and
  processes, about `fraction` of ids), the store keeps the most recent records and ignores duplicates.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.intake.buffer import HoldoutSplit, ReplayBuffer
from trainer.intake.examples import TrainingExample, examples_from_record

# blake2b of "req-0".."req-59" below 0.1 * 2**64: computed once, frozen so any change of hash shows.
HELD_OUT_OF_FIRST_60 = ["req-1", "req-6", "req-21", "req-26", "req-31", "req-43", "req-45", "req-53", "req-55"]


def example(request_id: str, tokens: int, positions: int = 2) -> TrainingExample:
    return TrainingExample(
        request_id=request_id,
        input_ids=torch.zeros(tokens, dtype=torch.long),
        positions=torch.arange(tokens - positions, tokens),
        target_topk_ids=torch.zeros(positions, 4, dtype=torch.long),
        target_topk_logprobs=torch.zeros(positions, 4, dtype=torch.float16),
        accepted=torch.zeros(positions, dtype=torch.bool),
    )


def test_buffer_evicts_oldest_first_by_tokens():
    buffer = ReplayBuffer(max_tokens=100)
    for i, tokens in enumerate([30, 30, 30]):
        assert buffer.add(example(f"r{i}", tokens))
    assert (len(buffer), buffer.tokens, buffer.positions) == (3, 90, 6)
    assert buffer.add(example("r3", 25))  # 115 tokens: r0 goes
    assert [e.request_id for e in buffer._examples] == ["r1", "r2", "r3"] and buffer.tokens == 85
    assert buffer.add(example("r4", 80))  # 165: r1, r2 and r3 go
    assert [e.request_id for e in buffer._examples] == ["r4"] and buffer.tokens == 80
    assert buffer.evicted == 4


def test_buffer_refuses_duplicates_useless_and_oversized_examples():
    buffer = ReplayBuffer(max_tokens=100, remember_ids=3)
    assert buffer.add(example("a", 60))
    assert not buffer.add(example("a", 60))  # redelivered by the stream
    assert buffer.add(example("b", 60))  # evicts a
    assert not buffer.add(example("a", 10))  # a late duplicate of an evicted record is still refused
    assert buffer.duplicates == 2
    assert not buffer.add(example("c", 101))  # alone bigger than the budget
    assert not buffer.add(example("d", 10, positions=0))  # nothing to learn
    assert buffer.refused == 2 and [e.request_id for e in buffer._examples] == ["b"]
    for name in ("e", "f", "g"):  # push "a" out of the 3 remembered ids
        buffer.add(example(name, 5))
    assert buffer.add(example("a", 10))


def test_sample_batch_keeps_to_its_budget_and_reaches_every_example():
    buffer = ReplayBuffer(max_tokens=10_000)
    sizes = np.random.default_rng(0).integers(10, 60, 50)
    for i, tokens in enumerate(sizes):
        buffer.add(example(f"r{i}", int(tokens)))
    rng = np.random.default_rng(1)
    seen = set()
    for _ in range(100):
        batch = buffer.sample_batch(rng, tokens=200)
        ids = [e.request_id for e in batch]
        assert len(ids) == len(set(ids)) >= 1
        assert sum(e.num_tokens for e in batch) <= 200
        seen.update(ids)
    assert len(seen) == 50
    assert [e.request_id for e in buffer.sample_batch(np.random.default_rng(7), 200)] == [
        e.request_id for e in buffer.sample_batch(np.random.default_rng(7), 200)
    ]
    assert len(buffer.sample_batch(rng, tokens=1)) == 1  # at least one, even over budget
    assert ReplayBuffer(100).sample_batch(rng, 100) == []


def test_recent_outputs_split_the_newest_examples_at_their_output_within_a_token_budget():
    """What a version's n-gram index is built from: input [p0 p1 p2 o0] with positions [2, 3] is the
    prompt [p0 p1 p2] and the output [o0 o1], o1 being the target's top-1 at the last position."""
    buffer = ReplayBuffer(max_tokens=1000)
    for i in range(3):
        topk = torch.tensor([[20 + i, 1], [30 + i, 2]])  # [positions, m]: the top-1 ids are the output
        logprobs, accepted = torch.zeros(2, 2, dtype=torch.float16), torch.zeros(2, dtype=torch.bool)
        buffer.add(
            TrainingExample(f"req-{i}", torch.tensor([7, 8, 9, 20 + i]), torch.tensor([2, 3]), topk, logprobs, accepted)
        )
    assert buffer.recent_outputs(4) == [([7, 8, 9], [22, 32]), ([7, 8, 9], [21, 31])]
    assert buffer.recent_outputs(1) == [([7, 8, 9], [22, 32])]  # the newest one always


def test_holdout_decision_is_a_stable_hash_of_the_request_id():
    ids = [f"req-{i}" for i in range(20_000)]
    split, again = HoldoutSplit(fraction=0.1), HoldoutSplit(fraction=0.1)
    decisions = [split.is_held_out(i) for i in ids]
    assert decisions == [again.is_held_out(i) for i in ids]
    assert abs(np.mean(decisions) - 0.1) < 0.01  # 3 standard errors is 0.0064
    # Fixed across processes and Python versions (no use of the salted built-in hash()).
    assert [i for i in ids[:60] if split.is_held_out(i)] == HELD_OUT_OF_FIRST_60
    salted = HoldoutSplit(fraction=0.1, salt="x")
    assert [salted.is_held_out(i) for i in ids] != decisions
    assert not any(HoldoutSplit(fraction=0.0).is_held_out(i) for i in ids[:1000])
    assert all(HoldoutSplit(fraction=1.0).is_held_out(i) for i in ids[:1000])


def test_a_cold_holdout_takes_one_record_in_three_and_every_delivery_keeps_its_place(make_record):
    records = [make_record(seed, n_out=4, m=2, vocab=64) for seed in range(200)]
    split = HoldoutSplit(fraction=0.1, warmup_records=6)
    routed = [split.add(record) for record in records]
    warm_at = [i for i, held in enumerate(routed) if held][5]  # the sixth held out warms the store
    assert len(split) > 6 and split.warmup_records == 6
    early = [split._number(r.request_id) < 1 / 3 for r in records[: warm_at + 1]]
    assert routed[: warm_at + 1] == early  # cold: one in three
    assert routed[warm_at + 1 :] == [split.is_held_out(r.request_id) for r in records[warm_at + 1 :]]  # warm
    assert warm_at < 40  # six held out within the first 40 records, where 1 in 10 would take about 60
    assert [split.add(record) for record in records] == routed  # every redelivery keeps its place
    restored = HoldoutSplit(fraction=0.1, warmup_records=6)  # a checkpoint restores held-out records first
    for record in split.records:
        assert restored.add(record)
    held = {record.request_id for record in split.records}
    assert not any(restored.add(record) for record in records if record.request_id not in held)
    with pytest.raises(ValueError):
        HoldoutSplit(max_records=4, warmup_records=5)


def test_holdout_keeps_the_most_recent_and_ignores_duplicates(make_record):
    split = HoldoutSplit(fraction=0.5, max_records=3)
    records = [make_record(seed, n_out=4, m=2, vocab=64) for seed in range(40)]
    held = [r for r in records if split.is_held_out(r.request_id)]
    assert len(held) >= 5
    routed = [split.add(r) for r in records]
    assert routed == [split.is_held_out(r.request_id) for r in records]
    assert [r.request_id for r in split.records] == [r.request_id for r in held[-3:]]
    assert split.revision == len(held) and split.positions == 12

    revision = split.revision
    assert split.add(held[-1]) is True  # a duplicate: still held out (never train on it), not stored twice
    assert split.add(held[0]) is True  # a duplicate of an evicted one: not brought back as "recent"
    assert split.revision == revision and split.duplicates == 2
    assert [r.request_id for r in split.records] == [r.request_id for r in held[-3:]]

    train = [r for r, is_held in zip(records, routed, strict=True) if not is_held]
    assert train and all(split.add(r) is False for r in train)  # training records pass through untouched
    buffer = ReplayBuffer(max_tokens=10_000)
    assert [buffer.add(examples_from_record(r)) for r in train + train[:2]] == [True] * len(train) + [False, False]


def test_settings_are_checked():
    with pytest.raises(ValueError):
        HoldoutSplit(fraction=1.5)
    with pytest.raises(ValueError):
        ReplayBuffer(max_tokens=0)
