"""`adaptive-spec distill` on tiny models, with a real redis-server and MLflow on sqlite: exported
records replayed, or prompts generated here, train the draft through the online trainer; a version
the gate accepts is registered and promoted like the online trainer's, a server started afterwards
serves it from its first request, and an online trainer adopts it as the champion it trains from.

Run: .venv/bin/python -m pytest tests/cli/test_distill.py -q   (CPU, about 3 minutes)
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import redis
from fastapi.testclient import TestClient
from traffic import greedy_records

from adaptive_spec import Engine
from adaptive_spec.outputs.prompts import PromptItem, load_prompts
from registry.client import AdapterRegistry
from service.app import create_app
from service.settings import Settings
from trainer.intake.stream import CorrectionStream
from trainer.loop.checkpoint import read_records, write_records
from trainer.process.build import build_trainer, load_draft
from trainer.process.distill import DistillSettings, distill, format_line, split_heldout
from trainer.promotion.champion import RegistryChampion
from trainer.settings import TrainerSettings

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]

DRAFT = "early-exit:1"


def engine_of(model_dir, k: int | None = None) -> Engine:
    return Engine.from_pretrained(str(model_dir), DRAFT, device="cpu", dtype="fp32", compile=False, k=k)


def train_settings(model_dir, data_dir, redis_url, **overrides) -> TrainerSettings:
    values = dict(
        target=str(model_dir),
        draft=DRAFT,
        data_dir=data_dir,
        redis_url=redis_url,
        device="cpu",
        dtype="fp32",
        gate_min_positions=64,
        min_new_records=8,
        round_steps=30,
    )
    return TrainerSettings(**{**values, **overrides})


@pytest.fixture(scope="module")
def distilled(tiny_model_dir, redis_url, tmp_path_factory):
    """Records of greedy traffic (as a server logs them) exported to a file, then distilled."""
    data_dir = tmp_path_factory.mktemp("distill")
    records = greedy_records(engine_of(tiny_model_dir).target, 160, domains=(None,), target_id=str(tiny_model_dir))
    export = data_dir / "export.bin"
    write_records(export, (record.encode() for record in records))
    engine = engine_of(tiny_model_dir)
    registry = AdapterRegistry(None, data_dir=data_dir)
    train = train_settings(tiny_model_dir, data_dir, redis_url)
    settings = DistillSettings(minutes=1.5, eval_prompts=0, tail_s=60)
    figures = distill(engine, train, settings, records=read_records(export), registry=registry, progress=False)
    yield figures, engine, registry, data_dir
    registry.close()


def test_a_deployment_with_a_champion_distils_on_from_it_and_generates_with_it(tiny_model_dir, redis_url, tmp_path):
    """A second `distill` (or one after the online trainer promoted): the trainer adopts the registry's
    champion, and the prompts are generated with it, as a server would draft them (they were generated with the
    base draft, which only made them slower)."""
    from adapter_files import write_adapter
    from tiny import tiny_target

    warm = write_adapter(  # shaped as the trainer's own LoRA (rank 16)
        tiny_target(0), 1, tmp_path / "warm", 3, rank=16, target_id=str(tiny_model_dir), draft_id=DRAFT
    )
    registry = AdapterRegistry(None, data_dir=tmp_path)
    try:
        champion = registry.register(warm, by="test")
        saved = tmp_path / "made.bin"
        train = train_settings(tiny_model_dir, tmp_path, redis_url)
        settings = DistillSettings(minutes=0.3, max_new_tokens=8, eval_prompts=0, tail_s=1)
        prompts = [PromptItem("abcd" + str(i)) for i in range(6)]
        engine = engine_of(tiny_model_dir, k=2)
        distill(engine, train, settings, prompts=prompts, save_records=saved, registry=registry, progress=False)
        made = read_records(saved)
        assert made and made[0].adapter_version == champion
    finally:
        registry.close()


@pytest.mark.slow  # they share a distillation of about a minute
def test_exported_records_distil_into_a_registered_champion(distilled):
    figures, engine, registry, _ = distilled
    assert figures["version"] is not None, figures
    assert figures["versions_promoted"] >= 1 and figures["records_consumed"] == 160
    assert len(figures["registered"]) == figures["versions_promoted"]  # every promotion reached MLflow
    assert figures["version"] == figures["registered"][-1] == registry.champion()
    assert engine.adapter_version is not None and not figures["records_rejected"]
    # the gate's held-out figure; the base draft's is ~0. A budget of minutes, not steps: on a loaded 2-core CI
    # machine fewer rounds fit (0.298 and 0.295 seen there), so the bar is training's effect, not a figure of its own
    assert figures["heldout_records_match"] > 0.2
    line = format_line(figures)
    assert line.startswith(f"distill: {figures['version']}; held out:") and "greedy match" in line


@pytest.mark.slow  # they share a distillation of about a minute
def test_a_server_started_afterwards_serves_the_distilled_version_from_its_first_request(distilled, tiny_model_dir):
    """The app's lifespan loads the models and the registry's champion before it answers."""
    _, _, registry, data_dir = distilled
    settings = Settings(
        target=str(tiny_model_dir),
        draft=DRAFT,
        dtype="fp32",
        device="cpu",
        data_dir=data_dir,
        mlflow_tracking_uri=f"sqlite:///{data_dir / 'mlflow.db'}",
        adapter_poll_s=30.0,
    )
    with TestClient(create_app(settings)) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        reply = client.post("/v1/completions", json={"model": model, "prompt": "abc", "max_tokens": 8}).json()
    assert reply["usage"]["spec_decode"]["adapter_version"] == registry.champion() == distilled[0]["version"]


@pytest.mark.slow  # they share a distillation of about a minute
def test_an_online_trainer_adopts_the_distilled_version_and_trains_on_from_it(
    distilled, tiny_model_dir, redis_url, tmp_path
):
    _, _, registry, data_dir = distilled
    champion = registry.champion()
    train = train_settings(tiny_model_dir, data_dir, redis_url)
    target = engine_of(tiny_model_dir).target
    client = redis.Redis.from_url(redis_url)
    stream = CorrectionStream(client, stream="test:distill:online", consumer="online")
    trainer = build_trainer(
        train,
        load_draft(train, target=target)[0],
        stream,
        checkpoints=False,
        champion_source=RegistryChampion(registry),
    )
    assert trainer.sync_registry() is True
    assert trainer.registry_champion == champion and trainer.champion_version is not None
    client.close()


def test_prompts_generate_records_train_rounds_and_measure_the_held_out_prompts(tiny_model_dir, redis_url, tmp_path):
    """No registry: versions stay in the data directory; held-out prompts are never trained on."""
    prompts = [PromptItem("abcd" * (1 + i % 3) + str(i), domain="letters") for i in range(64)]
    held, rest = split_heldout(prompts, 4, seed=0)
    assert len(held) == 4 and not set(map(id, held)) & set(map(id, rest)) and len(rest) == 60
    # a fixed k: at dynamic k a loaded machine could measure drafting as not paying and decode the held-out
    # prompts plainly, which leaves their acceptance undefined (None)
    engine = engine_of(tiny_model_dir, k=3)
    # the gate waits for 4 held-out records (and 24 positions, 2 records of 12 tokens). The split hashes random
    # request ids (1 in 3 is held out until 8 are, then 1 in 5): 36 records held out fewer than 4 about once in
    # 2,000 runs (a CI run saw it: 3 held out, no round), 60 about once in 8 million
    train = train_settings(
        tiny_model_dir, tmp_path, redis_url, min_new_records=4, round_steps=10, gate_min_positions=24
    )
    saved = tmp_path / "made.bin"
    settings = DistillSettings(minutes=1.0, max_new_tokens=12, eval_prompts=4, tail_s=10)
    figures = distill(engine, train, settings, prompts=prompts, save_records=saved, progress=False)
    assert figures["prompts_generated"] == 60 and figures["rounds"] >= 1, figures
    assert math.isfinite(figures["last_loss"])
    assert figures["heldout_prompts"] == 4 and figures["heldout_acceptance_rate"] is not None
    assert [item.prompt for item in load_prompts(figures["heldout_file"])] == [item.prompt for item in held]
    made = read_records(saved)
    assert len(made) == 60 and {r.target_id for r in made} == {str(tiny_model_dir)}


def test_the_command_says_what_it_needs(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "distill",
            "--draft",
            "ngram",
            "--prompts",
            "python",
            "--data-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "the ngram draft has no weights to train" in run.stderr
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x05\x00\x00\x00abc")
    run = subprocess.run(
        [sys.executable, "-m", "cli", "distill", "--records", str(bad), "--data-dir", str(tmp_path), "--draft", "head"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "not a file of encoded correction records" in run.stderr, run.stderr
