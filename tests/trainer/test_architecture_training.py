"""The online trainer trains every draft kind on more than Llama: Gemma 3 (sliding-window layers, an
embedding scaled by sqrt(hidden)) and Qwen2, tiny random models of the architecture matrix
(tests/helpers/tiny_families.py).

Run: .venv/bin/python -m pytest tests/trainer/test_architecture_training.py -q   (CPU, one thread, under a minute)

For each family and each draft kind the trainer supports (head, early-exit:1, a separate draft model of
the same family), greedy traffic served by the Engine goes through a real Redis stream into the trainer
`adaptive-spec train` and `distill` build (trainer/process/build.py: the statistical gate, the head's
trainer or the LoRA one for the draft it is given). Every kind must train rounds whose candidate beats
the base draft on the held-out records; the early exit and the draft model, which learn fastest on
these models, must be promoted, and a promoted version, loaded by an engine as a server loads it,
accepts more draft tokens on the held-out prompts with the output still equal to the target alone.

The Gemma 3 here unties its LM head from the embedding: tied, a random Gemma 3 repeats its last token
(the embedding, scaled by 8, dominates the residual), which every draft predicts already (0.89 match
before training), so there is nothing to learn; the engine's matrix serves the tied one.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import redis
from tiny_families import model_of
from traffic import greedy_records

from adaptive_spec import Engine
from adaptive_spec.drafters.spec import parse_draft_spec
from trainer.intake.stream import CorrectionStream
from trainer.learning.distill import LoraSettings
from trainer.learning.drafts import trainable_draft
from trainer.process.build import build_trainer
from trainer.settings import TrainerSettings

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]

RECORDS, NEW_TOKENS = 128, 16
MODEL_DRAFT = "tiny-draft-model"  # the draft id of the separate draft model (a path or hub id in real use)
CONFIG = {"gemma3": {"tie_word_embeddings": False}, "qwen2": {}}
_records: dict[str, list] = {}


def traffic(family: str) -> list:
    """Greedy traffic of the family's target, served by the Engine with its top-8 logged (once per family)."""
    if family not in _records:
        target = model_of(family, **CONFIG[family])
        _records[family] = greedy_records(target, RECORDS, domains=(None,), new_tokens=NEW_TOKENS, target_id=family)
    return _records[family]


def drafts_of(family: str, kind: str):
    """(the module the trainer trains, what an Engine takes as its draft), both fresh."""
    if kind == MODEL_DRAFT:
        return tuple(copy.deepcopy(model_of(family, seed=5, layers=1, **CONFIG[family])) for _ in range(2))
    return trainable_draft(parse_draft_spec(kind), model_of(family, **CONFIG[family])), kind


@pytest.mark.parametrize("kind", ["head", "early-exit:1", MODEL_DRAFT])
@pytest.mark.parametrize("family", list(CONFIG))
def test_the_trainer_teaches_every_draft_kind(family, kind, redis_url, tmp_path):
    target = model_of(family, **CONFIG[family])
    records = [dataclasses.replace(r, draft_id=kind) for r in traffic(family)]  # as a server with this draft logs
    trained, served = drafts_of(family, kind)
    settings = TrainerSettings(
        target=family,
        draft=kind,
        data_dir=tmp_path,
        gate_min_positions=200,
        gate_confidence=0.9,
        min_new_records=16,
        round_steps=40,
    )
    client = redis.Redis.from_url(redis_url)
    stream = f"test:architectures:{family}:{kind}"
    client.delete(stream)
    promoted, results = [], []
    trainer = build_trainer(
        settings,
        trained,
        CorrectionStream(client, stream=stream, consumer="arch"),
        checkpoints=False,
        on_promote=promoted.append,
        holdout_fraction=0.25,
        read_count=32,
        max_domains=0,
        lora=LoraSettings(batch_tokens=512),
    )
    pipe = client.pipeline()
    for record in records:
        pipe.xadd(stream, {"r": record.encode()})
    pipe.execute()
    while trainer.poll(block_ms=0):
        results.append(trainer.train_round())
    client.delete(stream)
    client.close()
    rounds = [result for result in results if result.trained]
    for result in rounds:
        print(f"{family} {kind}: {result.reason}")
    assert trainer.records_consumed == RECORDS and not trainer.rejected
    assert rounds and all(math.isfinite(result.last_loss) for result in rounds)
    assert any(result.candidate.greedy_match > result.champion.greedy_match for result in rounds)
    if kind != "head":
        assert promoted, f"{family} {kind}: nothing promoted"
    if not promoted:
        return

    prompts = [list(record.prompt_ids) for record in trainer.holdout.records]
    engine = Engine(target, served, k=3)
    alone = [engine.generate(p, NEW_TOKENS, speculative=False).token_ids for p in prompts]
    base = [engine.generate(p, NEW_TOKENS) for p in prompts]
    engine.load_adapter(promoted[-1].path)
    after = [engine.generate(p, NEW_TOKENS) for p in prompts]
    assert [out.token_ids for out in after] == [out.token_ids for out in base] == alone
    accepted_before, accepted_after = sum(o.stats.accepted for o in base), sum(o.stats.accepted for o in after)
    print(f"{family} {kind}: accepted {accepted_before} -> {accepted_after} over {len(prompts)} held-out prompts")
    assert accepted_after > accepted_before
