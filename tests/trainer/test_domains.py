"""Per-domain lineages in the online trainer (trainer/loop/domains.py), end to end on a real redis-server.

Run: .venv/bin/python -m pytest tests/trainer/test_domains.py -q   (CPU, one thread, about 20 s)

What must hold:

- each tagged domain gets its own lineage: its own held-out set and buffer, versions tagged with
  the domain and trained on its records only; the general adapter's rounds are started by
  untagged records;
- a domain with no version of its own is gated against the general adapter (what its requests
  draft with), not against the base draft;
- no adapter trains on a record that its gate scores; between rounds the model holds the general
  champion's weights;
- a resumed trainer has the same domain champions with the same weights;
- past `max_domains`, a domain's records go to the general adapter.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch
from tiny import llama
from traffic import greedy_records

from adaptive_spec.drafters.early_exit import build_early_exit
from adaptive_spec.formats.adapters import AdapterDir
from trainer.evaluation.decision import StatisticalGate, Thresholds
from trainer.evaluation.gate import adapters_disabled, draft_agreement
from trainer.intake.stream import CorrectionStream
from trainer.learning.distill import LoraSettings
from trainer.loop.online import OnlineSettings, OnlineTrainer

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]


class PromoteAll(StatisticalGate):
    """The statistical gate's floors, then every candidate promoted: these tests are about whose
    records train and gate what, not about the gate (tests/trainer/test_decision.py)."""

    def decide(self, candidate, champion):
        return True, "promoted (the test's gate)"


VOCAB, DOMAIN_TOKENS = 64, 16
RECORDS = 144
OPTIONS = dict(
    lora=LoraSettings(batch_tokens=512),
    gate=PromoteAll(Thresholds(min_positions=96)),
    holdout_fraction=0.25,
    min_new_records=12,
    round_steps=20,
    read_count=24,
    target_id="tiny-llama",
    draft_id="early-exit:1",
)


@pytest.fixture(scope="module")
def target():
    return llama(0, vocab=VOCAB)


@pytest.fixture(scope="module")
def records(target):
    """Three kinds of traffic, interleaved: json and sql prompts from token ranges of their own (so a
    domain's adapter has something of its own to learn), and untagged prompts from both."""
    kinds = [
        greedy_records(
            target,
            RECORDS // 3,
            domains=(domain,),
            domain_tokens=DOMAIN_TOKENS,
            first_token=first,
            id_prefix=domain or "untagged",
        )
        for domain, first in (("json", 0), ("sql", 40), (None, 20))
    ]
    return [record for records in zip(*kinds, strict=True) for record in records]


def make_trainer(target, client, stream: str, root: Path, **options) -> OnlineTrainer:
    settings = OnlineSettings(root / "adapters", checkpoint_dir=root / "checkpoint", **(OPTIONS | options))
    return OnlineTrainer(build_early_exit(target, 1), CorrectionStream(client, stream=stream, consumer="c"), settings)


def feed(client, stream: str, records) -> None:
    client.delete(stream)
    for record in records:
        client.xadd(stream, {"r": record.encode()})


def base_or_general(trainer: OnlineTrainer, heldout):
    """What a domain without its own version drafts with, scored as the gate scores it."""
    model, settings = trainer.trainer.model, trainer.trainer.settings
    if trainer.champion.version is None:
        with adapters_disabled(model):
            return draft_agreement(model, heldout, settings.batch_tokens, settings.max_seq_len)
    return draft_agreement(model, heldout, settings.batch_tokens, settings.max_seq_len)


@pytest.fixture(scope="module")
def trained(target, records, redis_url, tmp_path_factory):
    client, stream, root = redis.Redis.from_url(redis_url), "test:domains", tmp_path_factory.mktemp("domains")
    feed(client, stream, records)
    trainer = make_trainer(target, client, stream, root)
    results, fallback_checks = [], []
    while True:
        polled = trainer.poll(block_ms=0)
        lineage = trainer.next_lineage()
        if lineage is None:
            if polled:
                continue
            break
        expected = None
        if lineage.domain is not None and lineage.champion.version is None:
            expected = base_or_general(trainer, lineage.holdout.records)
        result = trainer.train_round(lineage)
        results.append(result)
        if expected is not None and result.trained:
            fallback_checks.append((expected, result.champion))
        if not result.trained and not polled:
            break
    trainer.checkpoint()
    yield trainer, results, fallback_checks, client, stream, root
    client.close()


def test_each_domain_trains_and_promotes_its_own_adapter(trained):
    trainer, results, _, *_ = trained
    assert {lineage.domain for lineage in trainer.lineages} == {"json", "sql"}
    promoted = [r for r in results if r.promoted]
    print("\n" + "\n".join(f"{r.domain}: {r.reason}" for r in results))
    assert {r.domain for r in promoted} >= {"json", "sql"}
    for result in promoted:
        metadata = AdapterDir(trainer.versions.path(result.version)).metadata().to_dict()
        assert metadata["domain"] == result.domain
        if result.domain is not None:  # trained on its own domain's records only
            assert set(metadata["domain_mix"]) == {result.domain}
            assert trainer.lineages.lineages[result.domain].champion.version is not None
    for lineage in trainer.lineages:
        newest = max(r.version for r in promoted if r.domain == lineage.domain)
        assert lineage.champion.version == newest
        assert f"{lineage.domain} v{newest:04d}" in trainer.progress()  # the log's progress line names each one
    assert "champions: general " in trainer.progress()


def test_a_domain_without_its_own_version_is_gated_against_the_general_adapter(trained):
    _, _, fallback_checks, *_ = trained
    assert fallback_checks, "no domain round ran before the domain had a version of its own"
    for expected, champion in fallback_checks:
        assert champion.greedy_match == pytest.approx(expected.greedy_match)
        assert champion.positions == expected.positions


def test_no_adapter_trains_on_what_its_gate_scores_and_the_model_holds_the_general_champion(trained):
    trainer, *_ = trained
    general_buffer = {example.request_id for example in trainer.buffer}
    general_holdout = {record.request_id for record in trainer.holdout.records}
    assert not general_buffer & general_holdout
    for lineage in trainer.lineages:
        held = {record.request_id for record in lineage.holdout.records}
        assert held and not held & ({example.request_id for example in lineage.buffer} | general_buffer)
        assert held <= general_holdout
        assert {record.domain for record in lineage.holdout.records} == {lineage.domain}
    weights = trainer.trainer.lora_state()
    assert all(torch.equal(weights[name], trainer.champion.weights[name]) for name in weights)


def test_a_resumed_trainer_has_the_same_domain_champions(trained, target):
    trainer, _, _, client, stream, root = trained
    resumed = make_trainer(target, client, stream, root)
    assert {d: lineage.champion.version for d, lineage in resumed.lineages.lineages.items()} == {
        d: lineage.champion.version for d, lineage in trainer.lineages.lineages.items()
    }
    for domain, lineage in trainer.lineages.lineages.items():
        again = resumed.lineages.lineages[domain]
        assert all(torch.equal(again.champion.weights[n], w) for n, w in lineage.champion.weights.items())
        assert [r.request_id for r in again.holdout.records] == [r.request_id for r in lineage.holdout.records]
    weights = resumed.trainer.lora_state()
    assert all(torch.equal(weights[n], trainer.champion.weights[n]) for n in weights)


def test_past_max_domains_a_domain_trains_the_general_adapter(target, records, redis_url, tmp_path):
    client, stream = redis.Redis.from_url(redis_url), "test:domains:rare"
    feed(client, stream, records[:48])
    trainer = make_trainer(target, client, stream, tmp_path, max_domains=1, min_new_records=10**6)
    while trainer.poll(block_ms=0):
        pass
    (only,) = trainer.lineages
    assert only.domain == "json"  # the first domain the traffic brought
    other = [r for r in records[:48] if r.domain != "json"]
    trained_other = [r for r in other if r.request_id in {e.request_id for e in trainer.buffer}]
    assert trainer.general.new_records == len(trained_other) > 0
    assert only.new_records == len(only.buffer) > 0
    client.close()
