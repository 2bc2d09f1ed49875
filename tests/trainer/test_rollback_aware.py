"""The trainer follows an operator's rollback: real MLflow (sqlite), a real redis-server, a tiny random Llama.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/trainer/test_rollback_aware.py -q   (CPU, about 30 s)

What must hold:

- after the trainer promoted registry versions 1 and 2, an operator rolls back to 1 (AdapterRegistry.rollback,
  as the CLI and the admin API do): the trainer adopts 1 before its next round (its LoRA weights are
  version 1's, its optimiser moments cleared), logs who moved it, and its next candidate is gated
  against version 1 and trained from it: the new champion is version 3 with parent 1, never 2 again;
- the alias moved with MlflowClient directly (the MLflow UI) is adopted too, and so is the alias
  removed (the base draft: a zero LoRA delta); a resumed trainer keeps the adopted champion and the
  local -> registry version map; a trainer with an empty data dir installs the served version locally;
- a promotion queued while MLflow was down, trained from version 2, does not move `champion` when
  MLflow returns after a rollback to 1: it is registered as version 3 without promotion (tagged), and
  the restarted trainer adopts 1.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import torch
from mlflow import MlflowClient
from peft import get_peft_model_state_dict
from safetensors.torch import load_file
from tiny import llama
from traffic import greedy_records

from adaptive_spec.contracts import NOT_PROMOTED_TAG, OUTSIDE
from adaptive_spec.drafters.early_exit import build_early_exit
from adaptive_spec.formats.adapters import WEIGHTS_FILE, AdapterDir, sha256_file
from adaptive_spec.formats.record import CorrectionRecord
from launch.processes import free_port
from registry.client import AdapterRegistry
from trainer.evaluation.gate import Gate, GateFigures, draft_agreement
from trainer.intake.stream import CorrectionStream
from trainer.learning.distill import LoraSettings
from trainer.loop.online import OnlineSettings, OnlineTrainer, RoundResult
from trainer.promotion.champion import RegistryChampion
from trainer.promotion.pending import PendingRegistrations

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]

VOCAB, DOMAIN_TOKENS, PROMPT_LEN, NEW_TOKENS, TOP_M = 64, 16, 8, 16, 8
RECORDS = 144
SETTINGS = LoraSettings(batch_tokens=512)
GATE = Gate(min_positions=300)  # margin 0.01
# Rounds of 20 steps every 16 records: measured, versions 1 and 2 land after about 80 and 96 records.
OPTIONS = dict(
    lora=SETTINGS,
    gate=GATE,
    holdout_fraction=0.25,
    min_new_records=8,
    round_steps=20,
    read_count=16,
    target_id="tiny-llama",
    draft_id="early-exit:1",
    max_domains=0,  # the general adapter's `champion` alias
)


@pytest.fixture(scope="module")
def target():
    return llama(0, vocab=VOCAB)


@pytest.fixture(scope="module")
def records(target) -> list[CorrectionRecord]:
    """Greedy traffic of a narrow domain served by the Engine (k = 1, early-exit:1), with the target's top-8."""
    return greedy_records(
        target,
        RECORDS,
        domains=("json",),
        domain_tokens=DOMAIN_TOKENS,
        prompt_len=PROMPT_LEN,
        new_tokens=NEW_TOKENS,
        top_m=TOP_M,
    )


@dataclass
class Setup:
    target: object
    client: redis.Redis
    stream: str
    root: Path
    registry: AdapterRegistry
    pending: PendingRegistrations

    def trainer(self, data_dir: Path | None = None, consumer: str = "trainer-1", **options) -> OnlineTrainer:
        """As `adaptive-spec train` wires it; the queue has no thread, so a submit registers at once."""
        data_dir = data_dir or self.root / "data"
        pending = options.pop("pending", self.pending)
        registry = options.pop("registry", self.registry)
        settings = OnlineSettings(data_dir / "adapters", checkpoint_dir=data_dir / "trainer", **(OPTIONS | options))
        stream = CorrectionStream(self.client, stream=self.stream, consumer=consumer)
        return OnlineTrainer(
            build_early_exit(self.target, 1),
            stream,
            settings,
            on_promote=pending.submit,
            champion_source=RegistryChampion(registry, pending),
        )


@pytest.fixture
def setup(target, records, redis_client, tmp_path) -> Setup:
    stream = "test:rollback"
    pipe = redis_client.pipeline()
    for record in records:
        pipe.xadd(stream, {"r": record.encode()})
    pipe.execute()
    registry = AdapterRegistry(
        f"sqlite:///{tmp_path / 'mlflow.db'}", data_dir=tmp_path, model_name=f"draft-{uuid.uuid4().hex[:8]}"
    )
    return Setup(
        target,
        redis_client,
        stream,
        tmp_path,
        registry,
        PendingRegistrations(registry, tmp_path / "data" / "registry-pending.json", by="trainer:test"),
    )


@dataclass
class Round:
    result: RoundResult
    heldout: list[CorrectionRecord]  # the held-out snapshot both sides of its gate were scored on


def train(trainer: OnlineTrainer, until_promoted: int | None = None) -> list[Round]:
    """Poll and train a round after each poll, until the stream is dry (or `until_promoted` promotions)."""
    rounds = []
    while until_promoted is None or trainer.adapters_promoted < until_promoted:
        if not trainer.poll(block_ms=0):
            break
        heldout = list(trainer.holdout.records)
        result = trainer.train_round()
        if result.trained:
            rounds.append(Round(result, heldout))
    return rounds


def lora(trainer: OnlineTrainer) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in get_peft_model_state_dict(trainer.trainer.model).items()}


def registered(registry: AdapterRegistry, version: str, tmp: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    path = registry.download(version, tmp / f"download-{version}")
    return path, load_file(str(path / WEIGHTS_FILE))


def same(weights: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> bool:
    return weights.keys() == other.keys() and all(torch.allclose(weights[k], other[k], atol=1e-6) for k in weights)


def served_figures(target, adapter: Path | None, heldout) -> GateFigures:
    """What a server running this adapter (or the base draft) scores on the snapshot."""
    draft = build_early_exit(target, 1)
    if adapter is not None:
        draft.load_adapter(str(adapter), adapter_name="served")
        draft.set_adapter("served")
    return draft_agreement(draft, heldout)


def assert_figures_equal(got: GateFigures, expected: GateFigures) -> None:
    assert got.positions == expected.positions and got.greedy_match == expected.greedy_match
    assert got.expected_acceptance == pytest.approx(expected.expected_acceptance, abs=1e-6)


def test_trainer_adopts_a_rollback_and_its_next_candidate_must_beat_the_rolled_back_to_version(setup, caplog):
    """Only rounds run here (no direct sync_registry call): what a trainer that ignored the registry
    would do differently is what fails. Measured: on the next round's snapshot (448 positions) v1
    matches 0.3281, v2 0.3795; the candidate trained from v1 reaches 0.3884 and becomes version 3,
    and a later round version 4."""
    registry, trainer = setup.registry, setup.trainer()
    train(trainer, until_promoted=2)
    assert trainer.adapters_promoted == 2 and registry.aliases() == {"champion": "2", "previous": "1"}
    v1_dir, v1 = registered(registry, "1", setup.root)
    v2_dir, v2 = registered(registry, "2", setup.root)
    assert same(lora(trainer), v2) and not same(v1, v2)

    registry.rollback(by="cli:alice@host")  # version 2 misbehaves in production
    assert registry.aliases() == {"champion": "1"}
    with caplog.at_level(logging.INFO, logger="trainer.loop.online"):
        rounds = train(trainer)
    assert rounds, "records left for rounds after the rollback"
    # The first round after the rollback is gated against what is served (1), not the trainer's own
    # champion (2); the two score differently on its snapshot.
    first = rounds[0]
    v1_figures = served_figures(setup.target, v1_dir, first.heldout)
    v2_figures = served_figures(setup.target, v2_dir, first.heldout)
    print(f"\nv1 {v1_figures}\nv2 {v2_figures}\nafter the rollback: {[r.result.reason for r in rounds]}")
    assert v1_figures.greedy_match != v2_figures.greedy_match
    assert_figures_equal(first.result.champion, v1_figures)
    # The next promotion was trained from 1 and beat it by the margin; 2 (or a child of 2) did not come back.
    promoted = [r for r in rounds if r.result.promoted]
    assert promoted, "a candidate trained from version 1 beats it"
    new = promoted[0].result
    metadata = AdapterDir(setup.root / "data" / "adapters" / f"v{new.version:04d}").metadata().to_dict()
    assert metadata["parent_sha256"] == sha256_file(v1_dir / WEIGHTS_FILE)
    assert metadata["parent_version"] == 1 and metadata["parent_registry_version"] == "1"
    assert_figures_equal(new.champion, served_figures(setup.target, v1_dir, promoted[0].heldout))
    assert new.candidate.greedy_match >= new.champion.greedy_match + GATE.margin
    assert registry.get("3").tags["parent_version"] == "1"  # local v0001, registry version 1
    assert registry.aliases()["champion"] == str(2 + len(promoted))
    assert "champion moved in the registry from 2 to 1 by cli:alice@host; training from 1" in caplog.text
    assert trainer.adoptions == 1 and not setup.pending.not_promoted
    assert trainer.sync_registry() is False
    assert trainer.registry_versions == {f"v{i:04d}": str(i) for i in range(1, 3 + len(promoted))}


def test_alias_moved_or_removed_outside_adaptive_spec_is_adopted_and_survives_a_restart(setup, caplog):
    registry, trainer = setup.registry, setup.trainer()
    train(trainer, until_promoted=2)
    _, v1 = registered(registry, "1", setup.root)
    mlflow = MlflowClient(registry.tracking_uri)
    mlflow.set_registered_model_alias(registry.model_name, "champion", "1")  # the MLflow UI does this
    with caplog.at_level(logging.INFO, logger="trainer.loop.online"):
        assert trainer.sync_registry() is True
    assert f"champion moved in the registry from 2 to 1 by {OUTSIDE}; training from 1" in caplog.text
    assert trainer.champion_version == 1 and same(lora(trainer), v1)

    # Checkpoint and resume: the adopted champion, its registry version and the map are kept.
    trainer.checkpoint()
    resumed = setup.trainer()
    for name in (
        "champion_version",
        "champion_sha256",
        "registry_champion",
        "registry_versions",
        "adoptions",
        "next_version",
    ):
        assert getattr(resumed, name) == getattr(trainer, name), name
    assert same(lora(resumed), v1) and resumed.sync_registry() is False

    # A trainer with an empty data dir adopts what is served and installs it as its own v0001.
    other = setup.trainer(setup.root / "other", consumer="trainer-2")
    assert other.sync_registry() is True and other.champion_version == 1 and other.next_version == 2
    installed = setup.root / "other" / "adapters" / "v0001"
    assert AdapterDir(installed).metadata().registry_version == "1" and AdapterDir(installed).verify()
    assert other.registry_versions == {"v0001": "1"} and same(lora(other), v1)

    # The alias removed: the base draft is served, so it is the champion to train from and beat.
    mlflow.delete_registered_model_alias(registry.model_name, "champion")
    assert resumed.sync_registry() is True
    assert resumed.champion_version is None and resumed.champion_sha256 is None and resumed.registry_champion is None
    assert all(not tensor.any() for name, tensor in lora(resumed).items() if "lora_B" in name)
    heldout = resumed.holdout.records
    assert_figures_equal(draft_agreement(resumed.trainer.model, heldout), served_figures(setup.target, None, heldout))
    rounds = train(resumed)
    assert rounds
    assert_figures_equal(rounds[0].result.champion, served_figures(setup.target, None, rounds[0].heldout))
    for round_ in rounds:
        if round_.result.promoted:
            assert round_.result.candidate.greedy_match >= round_.result.champion.greedy_match + GATE.margin
            assert AdapterDir(resumed.adapters_dir / f"v{round_.result.version:04d}").metadata().parent_sha256 in (
                None,
                *[sha256_file(p / WEIGHTS_FILE) for p in resumed.adapters_dir.glob("v*")],
            )


def test_promotion_queued_through_an_outage_does_not_land_on_a_rollback(setup, caplog, monkeypatch):
    """MLflow unreachable (a dead port) while the trainer promotes from version 2; it restarts; an operator
    has rolled back to 1 by the time the queue drains: the queued adapter registers without promotion."""
    registry, trainer = setup.registry, setup.trainer()
    train(trainer, until_promoted=2)
    assert trainer.sync_registry() is False and trainer.registry_champion == "2"
    trainer.checkpoint()
    del trainer
    v2_sha = setup.registry.get("2").sha256

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail fast: nothing listens there
    down = AdapterRegistry(f"http://127.0.0.1:{free_port()}", data_dir=setup.root, model_name=registry.model_name)
    queue = setup.root / "data" / "registry-pending.json"
    offline_pending = PendingRegistrations(down, queue, by="trainer:test")
    offline = setup.trainer(pending=offline_pending, registry=down)
    with caplog.at_level(logging.INFO, logger="trainer.loop.online"):
        train(offline, until_promoted=3)  # training goes on while the registry is away
    assert offline.adapters_promoted == 3 and "registry unavailable" in caplog.text
    assert [Path(e["path"]).name for e in offline_pending.pending()] == ["v0003"]
    assert offline_pending.pending()[0]["parent_sha256"] == v2_sha
    offline.checkpoint()
    del offline

    registry.rollback(by="admin-api:bob@10.0.0.1")  # MLflow is back; an operator rolls 2 back first
    restarted = setup.trainer()
    assert restarted.champion_version == 3 and restarted.registry_champion == "2"
    assert restarted.sync_registry() is False  # its own v0003 is still queued: the registry lags, nothing to adopt
    assert setup.pending.flush() == 0
    assert setup.pending.registered == ["1", "2", "3"] and setup.pending.not_promoted == ["3"]
    assert registry.aliases() == {"champion": "1"}  # the rollback stands
    assert "trained from the adapter with sha256" in registry.get("3").tags[NOT_PROMOTED_TAG]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainer.loop.online"):
        assert restarted.sync_registry() is True
    assert "champion moved in the registry from 2 to 1 by admin-api:bob@10.0.0.1; training from 1" in caplog.text
    v1_dir, v1 = registered(registry, "1", setup.root)
    assert restarted.champion_version == 1 and same(lora(restarted), v1)
    rounds = train(restarted)
    assert rounds
    assert_figures_equal(rounds[0].result.champion, served_figures(setup.target, v1_dir, rounds[0].heldout))
    assert registry.aliases()["champion"] not in ("2", "3")
