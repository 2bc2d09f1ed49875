"""The adapter registry on real MLflow (a sqlite file and a `mlflow server` started here) and real Redis.

Run: .venv/bin/python -m pytest tests/registry/test_registry.py -q   (about a minute; the server costs ~15 s)

What must hold, on both backends:

- a registered adapter becomes a version with its files and checksum as artifacts, the training
  settings as params, the gate figures and loss as metrics, the lineage as tags; promotion moves
  `previous` to the old champion and `champion` to the new one and publishes an event;
- rollback (to previous, or to V) and promote move the aliases and record who did it; versions come
  back as str whichever backend; registering the same adapter again makes no second version;
- the CLI lists, rolls back and promotes;
- each domain has its own pair of aliases (`champion-sql`, `previous-sql`): registering an adapter whose
  metadata names a domain, promoting and rolling back for it leave the general `champion` alone, and the
  other way round; `champions()` lists them all; events and audit tags say which domain and alias; the CLI's
  `--domain` does the same from the terminal (sqlite only: the aliases are the same calls on a server);
- with the server stopped, PendingRegistrations queues the trainer's promotions without blocking it
  and registers them, in order, once the server is back; `adaptive-spec train` does it as a process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import redis
from registry_support import write_adapter
from tiny import llama, tiny_target

import cli
from adaptive_spec.contracts import ADAPTER_EVENTS, MODEL_NAME
from adaptive_spec.formats.adapters import WEIGHTS_FILE, AdapterDir, sha256_file
from registry.client import AdapterRegistry, RegistryError, RegistryUnavailable
from trainer.promotion.pending import PendingRegistrations

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def sqlite_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mlflow-sqlite")


@pytest.fixture(params=["sqlite", "server"])
def backend(request, sqlite_dir) -> tuple[str, Path]:
    """(tracking URI, data dir); a test gets its own registered model name on a shared store."""
    if request.param == "sqlite":
        return f"sqlite:///{sqlite_dir / 'mlflow.db'}", sqlite_dir
    return request.getfixturevalue("mlflow_server").url, sqlite_dir


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> list[Path]:
    """Three adapters for a tiny early-exit:1 draft, as the trainer writes them (v0001..v0003)."""
    root, target = tmp_path_factory.mktemp("adapters"), tiny_target(0)
    return [
        write_adapter(target, 1, root / f"v000{i}", seed=i, version=i, greedy_match=0.3 + 0.1 * i) for i in (1, 2, 3)
    ]


def fresh(backend, redis_url=None) -> AdapterRegistry:
    uri, data_dir = backend
    return AdapterRegistry(uri, data_dir=data_dir, redis_url=redis_url, model_name=f"draft-{uuid.uuid4().hex[:8]}")


def test_registration_logs_everything_and_promotion_moves_both_aliases(backend, adapters, redis_url, tmp_path):
    registry = fresh(backend, redis_url)
    subscriber = redis.Redis.from_url(redis_url).pubsub(ignore_subscribe_messages=True)
    subscriber.subscribe(ADAPTER_EVENTS)
    assert registry.champion() is None and registry.versions() == []

    first = registry.register(adapters[0], by="trainer:test")
    assert first == "1" and registry.aliases() == {"champion": "1"}
    second = registry.register(adapters[1], by="trainer:test")
    assert second == "2" and registry.aliases() == {"champion": "2", "previous": "1"}
    assert all(isinstance(v, str) for v in registry.aliases().values())  # int from sqlite, str from a server

    version = registry.get("2")
    run = registry.client.get_run(version.run_id)
    metadata = json.loads((adapters[1] / "adaptive_spec_adapter.json").read_text())
    assert run.data.params["rank"] == "4" and run.data.params["lr"] == "0.001"
    assert run.data.params["target_modules"].split(",") == metadata["settings"]["target_modules"]
    assert run.data.params["records_used"] == str(metadata["records_used"])
    assert run.data.params["tokens_used"] == str(metadata["tokens_used"])
    assert run.data.metrics["candidate_greedy_match"] == pytest.approx(metadata["gate"]["candidate"]["greedy_match"])
    assert run.data.metrics["champion_greedy_match"] == pytest.approx(metadata["gate"]["champion"]["greedy_match"])
    assert run.data.metrics["loss"] == pytest.approx(metadata["loss"])
    assert run.data.tags["target_id"] == "target" and run.data.tags["draft_id"] == "early-exit:1"
    assert json.loads(run.data.tags["domain_mix"]) == metadata["domain_mix"]
    assert "base_version" in metadata and version.sha256 == sha256_file(adapters[1] / WEIGHTS_FILE)
    assert registry.client.get_experiment(run.info.experiment_id).name == "adaptive-spec"

    downloaded = registry.download("2", tmp_path / "download")
    assert sha256_file(downloaded / WEIGHTS_FILE) == version.sha256
    assert (downloaded / "checksum.sha256").read_text().split()[0] == version.sha256

    events = [json.loads(m["data"]) for m in _messages(subscriber, 2)]
    assert [(e["event"], e["version"], e["from"], e["by"]) for e in events] == [
        ("promote", "1", None, "trainer:test"),
        ("promote", "2", "1", "trainer:test"),
    ]
    subscriber.close()


def test_rollback_and_promote_are_recorded_with_who_did_it(backend, adapters):
    registry = fresh(backend)
    for path in adapters:
        registry.register(path)
    assert registry.aliases() == {"champion": "3", "previous": "2"}

    event = registry.rollback(by="cli:alice@host")
    assert (event["event"], event["version"], event["from"], event["by"]) == ("rollback", "2", "3", "cli:alice@host")
    assert registry.aliases() == {"champion": "2"}  # previous is gone: a second plain rollback must not undo this
    tags = registry.get("2").tags
    assert tags["adaptive_spec.last_action"] == "rollback" and tags["adaptive_spec.last_action_by"] == "cli:alice@host"
    assert registry.last_event()["by"] == "cli:alice@host"
    with pytest.raises(RegistryError, match="no 'previous'"):
        registry.rollback(by="cli:alice@host")

    registry.rollback(to=1, by="admin-api:bob@10.0.0.1")
    assert registry.aliases() == {"champion": "1", "previous": "2"}
    registry.promote("3", by="cli:carol@host")
    assert registry.aliases() == {"champion": "3", "previous": "1"}
    assert registry.promote("3", by="cli:carol@host")["changed"] is False
    with pytest.raises(RegistryError, match="no version"):
        registry.promote("42", by="cli:carol@host")

    listed = registry.versions()
    assert [(v.version, v.aliases) for v in listed] == [("1", ("previous",)), ("2", ()), ("3", ("champion",))]
    assert [v.candidate_greedy_match for v in listed] == pytest.approx([0.4, 0.5, 0.6])
    assert listed[0].created_at <= listed[1].created_at <= listed[2].created_at


def test_registering_the_same_adapter_again_reuses_its_version(backend, adapters):
    registry = fresh(backend)
    assert registry.register(adapters[0]) == registry.register(adapters[0]) == "1"
    assert [v.version for v in registry.versions()] == ["1"]


def test_default_store_is_a_sqlite_file_in_the_data_dir(tmp_path, monkeypatch, adapters):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    registry = AdapterRegistry(data_dir=tmp_path)
    assert registry.tracking_uri == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    assert registry.model_name == MODEL_NAME == "adaptive-spec-draft"
    registry.register(adapters[0])
    assert (tmp_path / "mlflow.db").is_file()
    assert list((tmp_path / "mlartifacts").rglob(WEIGHTS_FILE)), "artifacts must live under <data_dir>/mlartifacts"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    assert AdapterRegistry(data_dir=tmp_path).tracking_uri == "http://127.0.0.1:1"


def test_cli_lists_rolls_back_and_promotes(backend, adapters, capsys, monkeypatch):
    uri, data_dir = backend
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("REDIS_URL", raising=False)
    name = f"cli-{uuid.uuid4().hex[:8]}"
    registry = AdapterRegistry(uri, data_dir=data_dir, model_name=name)
    for path in adapters:
        registry.register(path)
    capsys.readouterr()

    assert cli.main(["adapters", "list", "--registered-model", name]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["VERSION", "DOMAIN", "CREATED"] and len(table) == 4
    assert "champion" in table[3] and "previous" in table[2] and "0.600" in table[3]

    assert cli.main(["adapters", "rollback", "--registered-model", name]) == 0
    assert "champion 3 -> 2" in capsys.readouterr().out
    assert registry.aliases() == {"champion": "2"}
    assert registry.get("2").tags["adaptive_spec.last_action_by"].startswith("cli:")

    assert cli.main(["adapters", "promote", "1", "--registered-model", name]) == 0
    assert cli.main(["adapters", "rollback", "--to", "3", "--registered-model", name]) == 0
    assert registry.aliases() == {"champion": "3", "previous": "1"}
    capsys.readouterr()
    assert cli.main(["adapters", "list", "--json", "--registered-model", name]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(v["version"], v["aliases"]) for v in listed] == [("1", ["previous"]), ("2", []), ("3", ["champion"])]
    assert listed[2]["last_action"] == "rollback"

    assert cli.main(["adapters", "promote", "9", "--registered-model", name]) == 2
    assert "no version" in capsys.readouterr().err


@pytest.fixture(scope="module")
def sql_adapter(tmp_path_factory) -> Path:
    """An adapter the trainer wrote for the sql domain (its metadata says so)."""
    return write_adapter(tiny_target(0), 1, tmp_path_factory.mktemp("sql") / "v0004", seed=4, version=4, domain="sql")


def test_each_domain_has_its_own_aliases_and_leaves_the_general_ones_alone(
    sqlite_dir, adapters, sql_adapter, redis_url
):
    registry = fresh((f"sqlite:///{sqlite_dir / 'mlflow.db'}", sqlite_dir), redis_url)
    subscriber = redis.Redis.from_url(redis_url).pubsub(ignore_subscribe_messages=True)
    subscriber.subscribe(ADAPTER_EVENTS)
    registry.register(adapters[0], by="trainer:test")
    registry.register(adapters[1], by="trainer:test")  # champion 2, previous 1
    assert registry.register(sql_adapter, by="trainer:sql") == "3"  # its metadata says "domain": "sql"
    assert registry.aliases() == {"champion": "2", "previous": "1", "champion-sql": "3"}
    assert registry.champions() == {None: "2", "sql": "3"} and registry.champion("sql") == "3"
    assert (registry.get("3").domain, registry.get("1").domain) == ("sql", None)
    assert registry.get("3").as_dict()["domain"] == "sql" and registry.get("3").tags["domain"] == "sql"
    assert "domain" not in registry.get("1").tags

    registry.promote("1", by="cli:alice@host", domain="sql")  # any version may serve any domain
    assert registry.aliases() == {"champion": "2", "previous": "1", "champion-sql": "1", "previous-sql": "3"}
    served = registry.served("sql")
    assert (served.version, served.by, served.moved_from) == ("1", "cli:alice@host", "3")
    assert served.sha256 == registry.get("1").sha256
    general = registry.served()  # the general adapter's last event is still its own, not sql's
    assert (general.version, general.by, general.moved_from) == ("2", "trainer:test", "1")
    assert registry.last_event("sql")["domain"] == "sql" and registry.last_event()["domain"] is None

    event = registry.rollback(by="cli:alice@host", domain="sql")
    assert (event["domain"], event["version"], event["from"]) == ("sql", "3", "1")
    assert registry.aliases() == {"champion": "2", "previous": "1", "champion-sql": "3"}
    with pytest.raises(RegistryError, match=r"no 'previous-sql'.*--domain sql"):
        registry.rollback(by="cli:alice@host", domain="sql")
    registry.rollback(by="cli:bob@host")  # the general adapter's rollback leaves sql's alias alone
    assert registry.aliases() == {"champion": "1", "champion-sql": "3"}

    registry.promote("3", by="cli:carol@host")  # the sql version, now also the general adapter
    tags = registry.get("3").tags
    assert (
        tags["adaptive_spec.last_action_alias"] == "champion"
        and tags["adaptive_spec.last_action_by"] == "cli:carol@host"
    )
    assert registry.get("3").aliases == ("champion", "champion-sql")
    assert registry.get("1").tags["adaptive_spec.last_action_alias"] == "champion"  # its last action: the rollback
    registry.client.set_registered_model_alias(registry.model_name, "champion--x", "2")  # by hand, not a domain's
    assert registry.champions() == {None: "3", "sql": "3"}
    for bad in ("no way", "a.b", "-sql", "x" * 65):
        with pytest.raises(RegistryError):
            registry.promote("1", by="cli:carol@host", domain=bad)

    events = [json.loads(m["data"]) for m in _messages(subscriber, 7)]
    assert [(e["event"], e["domain"], e["version"]) for e in events] == [
        ("promote", None, "1"),
        ("promote", None, "2"),
        ("promote", "sql", "3"),
        ("promote", "sql", "1"),
        ("rollback", "sql", "3"),
        ("rollback", None, "1"),
        ("promote", None, "3"),
    ]
    subscriber.close()


def test_cli_domain_round_trip(sqlite_dir, adapters, sql_adapter, capsys, monkeypatch):
    uri = f"sqlite:///{sqlite_dir / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("REDIS_URL", raising=False)
    name = f"cli-{uuid.uuid4().hex[:8]}"
    registry = AdapterRegistry(uri, data_dir=sqlite_dir, model_name=name)
    for path in (*adapters[:2], sql_adapter):
        registry.register(path)  # champion 2, previous 1, champion-sql 3
    capsys.readouterr()

    def run(*argv: str) -> str:
        assert cli.main(["adapters", *argv, "--registered-model", name]) == 0
        return capsys.readouterr().out

    table = run("list").splitlines()
    assert table[0].split()[:3] == ["VERSION", "DOMAIN", "CREATED"] and len(table) == 4
    assert table[3].split()[:2] == ["3", "sql"] and table[1].split()[:2] == ["1", "-"]
    assert "champion-sql 3 -> 1" in run("promote", "1", "--domain", "sql")
    assert registry.aliases() == {"champion": "2", "previous": "1", "champion-sql": "1", "previous-sql": "3"}
    listed = json.loads(run("list", "--json", "--domain", "sql"))  # sql's versions and aliases only
    assert [(v["version"], v["domain"], v["aliases"]) for v in listed] == [
        ("1", None, ["champion-sql"]),
        ("3", "sql", ["previous-sql"]),
    ]
    assert "champion-sql 1 -> 3" in run("rollback", "--domain", "sql")
    assert "champion-sql 3 -> 2" in run("rollback", "--to", "2", "--domain", "sql")
    assert registry.aliases() == {"champion": "2", "previous": "1", "champion-sql": "2", "previous-sql": "3"}
    with pytest.raises(SystemExit) as exited:  # argparse's error
        cli.main(["adapters", "rollback", "--domain", "no way", "--registered-model", name])
    assert exited.value.code == 2 and "argument --domain: a domain in an alias name" in capsys.readouterr().err
    assert registry.champions() == {None: "2", "sql": "2"}


def test_a_rollback_made_while_a_queued_promotion_uploads_stands(sqlite_dir, adapters, monkeypatch, tmp_path):
    """The queue checks the champion after the upload, right before the alias moves (trainer/promotion/pending.py): a
    rollback that lands while version 3's files upload (a second or more on an MLflow server) is not overwritten
    by version 3, which was trained from the version rolled away from. Seen in tests/reliability/test_fleet.py."""
    registry = fresh((f"sqlite:///{sqlite_dir / 'mlflow.db'}", sqlite_dir))
    registry.register(adapters[0], by="trainer:test")
    registry.register(adapters[1], by="trainer:test")  # champion 2, previous 1
    upload = registry._log_run

    def upload_then_rollback(*args):
        run_id = upload(*args)
        registry.rollback(by="cli:alice@host")  # 2 -> 1 while version 3's files upload
        return run_id

    monkeypatch.setattr(registry, "_log_run", upload_then_rollback)
    pending = PendingRegistrations(registry, tmp_path / "pending.json", by="trainer:test")
    parent, own = (AdapterDir(path).metadata().adapter_sha256 for path in adapters[1:])
    pending.submit(SimpleNamespace(path=adapters[2], parent_sha256=parent, sha256=own))  # trained from 2
    assert pending.registered == ["3"] and pending.not_promoted == ["3"]
    assert registry.aliases() == {"champion": "1"}


def test_a_queued_domain_adapter_moves_its_domains_aliases(sqlite_dir, adapters, sql_adapter, tmp_path):
    """The trainer's promotions of a domain's adapter go through the queue too (trainer/promotion/pending.py): they move
    champion-sql, never champion; the first is checked against the general adapter it was trained from."""
    registry = fresh((f"sqlite:///{sqlite_dir / 'mlflow.db'}", sqlite_dir))
    registry.register(adapters[0], by="trainer:test")  # champion 1
    pending = PendingRegistrations(registry, tmp_path / "pending.json", by="trainer:test")
    general, first = (AdapterDir(path).metadata().adapter_sha256 for path in (adapters[0], sql_adapter))
    pending.submit(SimpleNamespace(path=sql_adapter, parent_sha256=general, sha256=first))
    assert pending.registered == ["2"] and pending.not_promoted == []
    assert registry.aliases() == {"champion": "1", "champion-sql": "2"}
    assert registry.served("sql").by == "trainer:test"

    second = write_adapter(tiny_target(0), 1, tmp_path / "v0005", seed=5, version=5, domain="sql")
    registry.rollback(to="1", by="cli:alice@host", domain="sql")  # an operator moved sql off its parent
    pending.submit(
        SimpleNamespace(path=second, parent_sha256=first, sha256=AdapterDir(second).metadata().adapter_sha256)
    )
    assert pending.registered == ["2", "3"] and pending.not_promoted == ["3"]
    assert registry.champions() == {None: "1", "sql": "1"}


def test_promotions_wait_for_mlflow_and_land_when_it_returns(
    mlflow_server, adapters, redis_client, redis_url, tmp_path, monkeypatch
):
    """MLflow down while (a) PendingRegistrations gets two promotions in this process and (b) `adaptive-spec
    train` runs as a process, gets records of the domain "narrow", trains and promotes; MLflow back: everything
    lands, in order, the trainer's on champion-narrow.
    Then SIGTERM: the trainer checkpoints and exits 0. (Last in the file: it stops the module's server.)"""
    from adaptive_spec import Engine
    from adaptive_spec.formats.record import record_from_output
    from service.correction_log import CorrectionLogWriter

    target = llama(0, vocab=64)
    target_dir = tmp_path / "tiny-target"
    target.save_pretrained(target_dir)
    engine = Engine(target, "early-exit:1", k=1, record_topk=8, eos_token_id=[], target_id=str(target_dir))
    data_dir = tmp_path / "data"
    registry = AdapterRegistry(mlflow_server.url, data_dir=data_dir)  # the default name, as `train` uses it
    queued = AdapterRegistry(mlflow_server.url, data_dir=tmp_path, model_name=f"outage-{uuid.uuid4().hex[:8]}")
    mlflow_server.stop()
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # this process's queue too (see env below)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MLFLOW_TRACKING_URI": mlflow_server.url,
        "REDIS_URL": redis_url,
        "ADAPTIVE_SPEC_DATA_DIR": str(data_dir),
        # the trainer retries its queued registration every 1 s (10 s by default), and each registry call
        # fails at once while MLflow is down (MLflow's two retries took about 2.5 s a call)
        "ADAPTIVE_SPEC_RETRY_S": "1",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    }
    command = [
        sys.executable,
        "-m",
        "cli",
        "train",
        "--target",
        str(target_dir),
        "--draft",
        "early-exit:1",
        "--data-dir",
        str(data_dir),
        "--threads",
        "1",
        "--min-new-records",
        "16",
        "--gate-min-positions",
        "150",
        "--round-steps",
        "40",
        "--checkpoint-every-s",
        "2",
    ]
    with open(tmp_path / "train.log", "wb") as log_file:  # the trainer keeps its own copy of the descriptor
        process = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        with pytest.raises(RegistryUnavailable):
            queued.champion()
        pending = PendingRegistrations(queued, tmp_path / "pending.json", by="trainer:test", retry_s=0.5).start()
        started = time.monotonic()
        for path in adapters[:2]:
            pending.submit(_Promoted(path))  # what OnlineTrainer hands to on_promote
        assert time.monotonic() - started < 0.5, "on_promote must not wait for MLflow"

        writer = CorrectionLogWriter(redis_url)
        rng = np.random.default_rng(0)
        for i in range(160):  # a narrow domain: prompts over 16 tokens, greedy
            out = engine.generate(rng.integers(0, 16, 8).tolist(), max_new_tokens=16)
            writer.submit(
                record_from_output(
                    out,
                    request_id=f"req-{i}",
                    created_at=time.time(),
                    domain="narrow",
                    target_id=str(target_dir),
                    draft_id="early-exit:1",
                    temperature=0.0,
                )
            )
        writer.close(timeout=10)
        _wait(
            lambda: (data_dir / "adapters" / "v0001").is_dir() or process.poll() is not None,
            120,
            "a promoted adapter",
            log=tmp_path / "train.log",
        )
        assert process.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
        _wait(
            lambda: (
                (data_dir / "registry-pending.json").is_file()
                and json.loads((data_dir / "registry-pending.json").read_text())
            ),
            10,
            "the queued registration",
        )
        assert pending.failures >= 2 and [Path(e["path"]).name for e in pending.pending()] == ["v0001", "v0002"]
    finally:
        mlflow_server.start()
    _wait(lambda: not pending.pending(), 60, "the in-process queue drains once MLflow is back")
    assert pending.registered == ["1", "2"] and queued.aliases() == {"champion": "2", "previous": "1"}
    assert pending.stop() == 0
    try:
        _wait(
            lambda: _champion(registry, "narrow") is not None,
            60,
            "the trainer's registration after MLflow returns",
            log=tmp_path / "train.log",
        )
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        code = process.wait(60)
    assert code == 0, (tmp_path / "train.log").read_text()[-3000:]
    assert (data_dir / "trainer" / "LATEST").is_file()
    assert json.loads((data_dir / "registry-pending.json").read_text()) == []
    # Every promoted directory became a version, in order, and the last one is the champion.
    promoted = sorted(p.name for p in (data_dir / "adapters").glob("v*"))
    versions = registry.versions()
    assert [v.tags["adapter_dir"] for v in versions] == promoted
    # the records are tagged "narrow": the trainer's narrow lineage promoted them to champion-narrow
    assert versions[-1].aliases == ("champion-narrow",) and registry.champion("narrow") == versions[-1].version
    assert all(v.domain == "narrow" for v in versions) and registry.champion() is None
    assert all(v.tags["target_id"] == str(target_dir) for v in versions)
    assert versions[-1].tags["adaptive_spec.last_action_by"].startswith("trainer:")


class _Promoted:
    def __init__(self, path: Path) -> None:
        self.path = path


def _champion(registry: AdapterRegistry, domain: str | None = None) -> str | None:
    try:
        return registry.champion(domain)
    except RegistryUnavailable:
        return None


def _messages(pubsub, count: int, timeout: float = 5.0) -> list[dict]:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.2)
        if message is not None:
            got.append(message)
    return got


def _wait(condition, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    pytest.fail(f"timed out after {timeout} s waiting for {what}\n{tail}")
