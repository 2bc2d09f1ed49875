"""The online trainer with the draft `eagle3`: a real redis-server, records from a tiny random Llama served by the
Engine, as tests/trainer/test_online.py runs it for an early exit.

Run: .venv/bin/python -m pytest tests/trainer/test_eagle3_online.py -q -n 0   (CPU, one thread, about 40 s)

What must hold:

- fed through the stream, the trainer promotes a version of the head that beats the base draft on held-out
  records: a version directory in the EAGLE-3 layout (a speculators checkpoint: config.json, model.safetensors),
  sealed as every version is (its checksum verifies, its metadata holds the gate's figures), its draft vocabulary
  the deployment's fixed size;
- the engine serves that version with the target's exact greedy output, accepting more than the base draft;
- a trainer built again on the same checkpoint directory holds the same champion, draft vocabulary and all.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from tiny import llama

from adaptive_spec import Engine
from adaptive_spec.formats.adapters import AdapterDir
from adaptive_spec.formats.eagle3 import Eagle3Checkpoint
from adaptive_spec.formats.record import CorrectionRecord, record_from_output
from trainer.evaluation.gate import Gate, GateFigures, draft_agreement
from trainer.intake.stream import CorrectionStream
from trainer.learning.eagle3_distill import Eagle3Settings, Eagle3Trainer
from trainer.learning.eagle3_model import TrainableEagle3Head
from trainer.loop.online import OnlineSettings, OnlineTrainer, RoundResult
from trainer.promotion.versions import AdapterVersion

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]

VOCAB = 64
DRAFT_VOCAB = 48
RECORDS, NEW_TOKENS = 128, 16
SETTINGS = Eagle3Settings(batch_tokens=512, unroll=2)
GATE = Gate(min_positions=300)  # a quarter of the records held out gives ~500 positions


@pytest.fixture(scope="module")
def target():
    return llama(0, vocab=VOCAB)


@pytest.fixture(scope="module")
def records(target) -> list[CorrectionRecord]:
    """test_online.py's traffic (greedy, narrow prompts of tokens 0..15, three domain tags, the target's top-8), served
    with the base `eagle3` draft: a trainer keeps only its own draft's records (trainer/intake/screening.py)."""
    engine = Engine(target, "eagle3", k=1, record_topk=8, eos_token_id=[], target_id="tiny-llama")
    rng = np.random.default_rng(0)
    domains = ("json", "sql", None)
    return [
        record_from_output(
            engine.generate(rng.integers(0, 16, 8).tolist(), max_new_tokens=NEW_TOKENS),
            request_id=f"req-{i}",
            created_at=1_700_000_000.0 + i,
            domain=domains[i % len(domains)],
            target_id="tiny-llama",
            draft_id="eagle3",
            temperature=0.0,
        )
        for i in range(RECORDS)
    ]


def make_trainer(target, client: redis.Redis, stream: str, root: Path, **options) -> OnlineTrainer:
    settings = OnlineSettings(
        root / "adapters",
        checkpoint_dir=root / "checkpoint",
        target_id="tiny-llama",
        draft_id="eagle3",
        lora=SETTINGS,
        gate=GATE,
        holdout_fraction=0.25,
        min_new_records=16,
        round_steps=40,
        max_round_steps=40,
        read_count=32,
        max_domains=0,
        **options,
    )
    draft = TrainableEagle3Head(target, DRAFT_VOCAB)
    return OnlineTrainer(draft, CorrectionStream(client, stream=stream, consumer="learner"), settings)


@dataclass
class Learned:
    trainer: OnlineTrainer
    client: redis.Redis
    stream: str
    root: Path
    results: list[RoundResult]
    promoted: list[AdapterVersion]


@pytest.fixture(scope="module")
def learned(target, records, redis_url, tmp_path_factory) -> Learned:
    """Every record in the stream, taken 32 a poll with a round after each (the first wait for held-out records)."""
    client, stream, root = redis.Redis.from_url(redis_url), "test:eagle3:learn", tmp_path_factory.mktemp("eagle3")
    client.delete(stream)
    for record in records:
        client.xadd(stream, {"r": record.encode()})
    promoted: list[AdapterVersion] = []
    trainer = make_trainer(target, client, stream, root, base_version="tiny-base")
    trainer.rounds_part.on_promote = promoted.append
    results = []
    while trainer.poll(block_ms=0):
        results.append(trainer.train_round())
    trainer.checkpoint()
    yield Learned(trainer, client, stream, root, results, promoted)
    client.close()


def test_the_trainer_promotes_a_head_in_the_eagle3_layout_that_beats_the_base_draft(learned):
    trainer = learned.trainer
    assert isinstance(trainer.trainer, Eagle3Trainer)
    for result in learned.results:
        print(
            f"\n  {result.reason}"
            if not result.trained
            else f"\n  round {result.round}: loss {result.first_loss:.3f} -> {result.last_loss:.3f}, greedy match "
            f"{result.champion.greedy_match:.3f} -> {result.candidate.greedy_match:.3f}, promoted {result.promoted}",
            end="",
        )
    assert trainer.adapters_promoted == len(learned.promoted) >= 1
    assert trainer.champion_version == learned.promoted[-1].version
    first = learned.promoted[0]
    assert first.candidate.greedy_match >= first.champion.greedy_match + GATE.margin
    heldout = trainer.holdout.records
    with trainer.trainer.base_draft():
        base = draft_agreement(trainer.trainer.model, heldout)
    champion = draft_agreement(trainer.trainer.model, heldout)  # between rounds the trainer holds the champion
    print(f"\nheld-out {base.positions} positions: base draft {base}\n  champion {champion}")
    assert champion.greedy_match >= base.greedy_match + 0.05


def test_a_promoted_version_is_a_sealed_speculators_checkpoint(learned):
    version = learned.promoted[-1]
    directory = AdapterDir(version.path)
    assert directory.standard and {"config.json", "model.safetensors"} <= {p.name for p in version.path.iterdir()}
    assert not (version.path / "adapter_config.json").exists()
    assert directory.verify() == version.sha256 == directory.metadata().adapter_sha256
    metadata = directory.metadata().to_dict()
    assert metadata["draft_id"] == "eagle3" and metadata["draft_config"]["kind"] == "eagle3"
    assert metadata["version"] == version.version and metadata["base_version"] == "tiny-base"
    assert GateFigures(**metadata["gate"]["candidate"]) == version.candidate
    checkpoint = Eagle3Checkpoint.read(version.path)
    assert checkpoint.config.verifier == "tiny-llama" and checkpoint.config.draft_vocab_size == DRAFT_VOCAB
    assert checkpoint.draft_to_target().tolist() == sorted(set(checkpoint.draft_to_target().tolist()))
    assert checkpoint.config.aux_layer_ids == (2, 4)  # vLLM's numbering on the target's 4 layers


def test_the_engine_serves_the_promoted_head_exactly_and_accepts_more(learned, target):
    path = learned.promoted[-1].path
    prompts = [record.prompt_ids for record in learned.trainer.holdout.records[:6]]
    engine = Engine(target, "eagle3", eos_token_id=[])
    plain = [engine.generate(p, max_new_tokens=NEW_TOKENS, speculative=False).token_ids for p in prompts]
    base = engine.generate_batch(prompts, max_new_tokens=NEW_TOKENS, k=3)
    engine.load_adapter(path, "1")
    served = engine.generate_batch(prompts, max_new_tokens=NEW_TOKENS, k=3)
    assert [out.token_ids for out in served] == plain == [out.token_ids for out in base]
    assert {out.stats.adapter_version for out in served} == {"1"}
    accepted = sum(out.stats.accepted for out in served) / sum(out.stats.drafted for out in served)
    accepted_base = sum(out.stats.accepted for out in base) / sum(out.stats.drafted for out in base)
    print(f"\nserved acceptance: base draft {accepted_base:.3f}, version {accepted:.3f}")
    assert accepted > accepted_base


def test_a_trainer_resumed_from_its_checkpoint_holds_the_same_champion(learned, target):
    trainer = learned.trainer
    resumed = make_trainer(target, learned.client, learned.stream, learned.root)
    assert resumed.champion_version == trainer.champion_version >= 1
    ours, theirs = trainer.trainer.lora_state(), resumed.trainer.lora_state()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
    heldout = trainer.holdout.records
    assert draft_agreement(resumed.trainer.model, heldout) == draft_agreement(trainer.trainer.model, heldout)
