"""What the trainer's writers put in adaptive_spec_adapter.json parses into the metadata record
(adaptive_spec/formats/adapter_metadata.py) with no key left over: DraftTrainer.save and HeadTrainer.save, then a
promoted version (trainer/promotion/versions.py, with the fields trainer/loop/rounds.py adds) and an
adopted one. Each file round-trips to the same text, so every key they write is a field of the record.

    .venv/bin/python -m pytest tests/trainer/test_metadata_writers.py -q    (tiny random models, a few seconds)
"""

from __future__ import annotations

import time

import pytest
from tiny import llama

from adaptive_spec.contracts import METADATA_FILE
from adaptive_spec.drafters.early_exit import build_early_exit
from adaptive_spec.formats.adapter_metadata import AdapterMetadata
from adaptive_spec.formats.adapters import AdapterDir
from trainer.evaluation.gate import GateFigures
from trainer.learning.distill import DraftTrainer, LoraSettings
from trainer.learning.head_distill import HeadSettings, HeadTrainer
from trainer.learning.head_model import TrainableHead
from trainer.promotion.versions import VersionDirs

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


def parsed(path) -> AdapterMetadata:
    """The directory's metadata, checked to name every key and to write back the same text."""
    metadata = AdapterMetadata.read(path)
    assert metadata.extra == {}, f"keys the record does not name: {sorted(metadata.extra)}"
    assert metadata.to_json() == (path / METADATA_FILE).read_text()
    return metadata


def test_what_the_trainers_save_parses(tmp_path):
    target = llama(0, vocab=VOCAB)
    draft = DraftTrainer(
        build_early_exit(target, 1), LoraSettings(r=4), target_id="tiny-llama", draft_id="early-exit:1"
    )
    saved = parsed(draft.save(tmp_path / "draft"))
    assert (saved.format, saved.target_id, saved.draft_id, saved.steps) == (1, "tiny-llama", "early-exit:1", 0)
    assert saved.init_adapter is None and "init_adapter" in saved.to_dict()  # written as null, kept as null
    assert saved.settings["r"] == 4 and saved.draft_config["num_hidden_layers"] == 1

    head = HeadTrainer(TrainableHead(target), HeadSettings(r=4), target_id="tiny-llama", draft_id="head")
    saved = parsed(head.save(tmp_path / "head"))
    assert saved.draft_config["kind"] == "head" and saved.target_state_forwards == 0


def test_a_promoted_and_an_adopted_version_parse(tmp_path):
    trainer = DraftTrainer(build_early_exit(llama(0, vocab=VOCAB), 1), LoraSettings(r=4), target_id="tiny-llama")
    versions = VersionDirs(tmp_path / "adapters")
    promoted = versions.promote(  # with what trainer/loop/rounds.py passes
        trainer.save,
        [1, 2, 3],
        ngrams={(1, 2): [3]},
        candidate=GateFigures(0.4, 0.6, 40),
        champion=GateFigures(0.1, 0.2, 40),
        loss=1.5,
        domain_mix={"sql": 4},
        parent_version=None,
        parent_sha256=None,
        parent_registry_version=None,
        domain="sql",
        base_version="tiny-base",
        round=2,
        round_steps=5,
        first_loss=2.0,
        last_loss=1.4,
        gate={"reason": "greedy match 0.2 -> 0.6", "min_positions": 32, "margin": 0.02},
        records_consumed=10,
        tokens_consumed=160,
    )
    metadata = parsed(promoted.path)
    assert metadata.version == promoted.version == 1 and metadata.adapter_sha256 == promoted.sha256
    assert metadata.gated_greedy_match == 0.6 and metadata.domain == "sql" and metadata.parent_version is None
    assert metadata.ngrams_sha256 and metadata.vocab_sha256 and AdapterDir(promoted.path).verify() == promoted.sha256

    adopted = versions.install(
        versions.take(), promoted.path, registry_version="7", adopted_at=time.time(), adopted_by="cli:ops", adopted_as=2
    )
    again = parsed(adopted)
    kept = again.to_dict()
    assert {key: kept[key] for key in metadata.to_dict()} == metadata.to_dict(), "adopting keeps every key"
    assert (again.registry_version, again.adopted_by, again.adopted_as) == ("7", "cli:ops", 2)
