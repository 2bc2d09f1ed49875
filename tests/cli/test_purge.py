"""Bounded and purgeable (issue 30, item 6): user-derived files are pruned as versions come, and `adaptive-spec
purge` deletes all of it, on a real redis-server and a real MLflow sqlite store.

OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/cli/test_purge.py -q
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from registry_support import write_adapter
from support import child_env
from tiny import tiny_target

from adaptive_spec.contracts import (
    ADAPTER_CACHE_DIR,
    ADAPTERS_DIR,
    CHECKPOINT_DIR,
    CORRECTION_STREAM,
    MLFLOW_DB,
    NGRAMS_FILE,
    PAYLOAD_FIELD,
    PENDING_FILE,
    STATS_EVENTS_KEY,
    TRAINER_GROUP,
    sqlite_tracking_uri,
    stats_bucket_key,
)
from adaptive_spec.formats.adapters import trainer_versions
from registry.client import AdapterRegistry
from trainer.promotion.pending import PendingRegistrations

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]


def test_the_trainers_version_directories_keep_the_last_n_and_every_aliased_one(tmp_path):
    registry = AdapterRegistry(sqlite_tracking_uri(tmp_path), data_dir=tmp_path)
    versions = tmp_path / ADAPTERS_DIR
    pending = PendingRegistrations(
        registry, tmp_path / PENDING_FILE, by="trainer:test", versions_dir=versions, keep_versions=2
    )
    target = tiny_target(0)
    for number in range(1, 7):
        path = write_adapter(target, 1, versions / f"v{number:04d}", seed=number, version=number)
        (path / NGRAMS_FILE).write_text('{"ngrams": []}\n')  # what the traffic left in it
        pending.submit(SimpleNamespace(path=path))
        if number == 1:
            registry.promote("1", by="cli:alice@host", domain="sql")  # served for sql: aliased throughout
        kept = sorted(trainer_versions(versions))
    assert registry.aliases() == {"champion": "6", "previous": "5", "champion-sql": "1"}
    assert kept == [1, 5, 6]  # the last two, and 1 (champion-sql)


def test_purge_deletes_every_piece_of_user_derived_data_after_a_confirmation(tmp_path, redis_url, redis_client):
    data = tmp_path / "data"
    target = tiny_target(0)
    for name in (CHECKPOINT_DIR, ADAPTER_CACHE_DIR):
        (data / name).mkdir(parents=True)
        (data / name / "state.pt").write_bytes(b"prompt and output ids" * 100)
    adapter = write_adapter(target, 1, data / ADAPTERS_DIR / "v0001", seed=1)
    (data / PENDING_FILE).write_text("[]\n")
    registry = AdapterRegistry(sqlite_tracking_uri(data), data_dir=data)
    registry.register(adapter, by="trainer:test")
    redis_client.xadd(CORRECTION_STREAM, {PAYLOAD_FIELD: b"a record"})
    redis_client.xgroup_create(CORRECTION_STREAM, TRAINER_GROUP, id="0")
    redis_client.hset(stats_bucket_key(10, 1_700_000_000), "1|sql|requests", 3)
    redis_client.xadd(STATS_EVENTS_KEY, {"kind": "swap"})
    redis_client.set("someone-elses-key", "kept")

    def purge(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "cli", "purge", "--data-dir", str(data), *flags],
            env=child_env(REDIS_URL=redis_url),
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )

    asked = purge()  # no terminal to answer, no --yes: nothing is deleted
    assert asked.returncode == 1 and "nothing deleted" in asked.stdout, asked.stdout + asked.stderr
    assert redis_client.exists(CORRECTION_STREAM) and (data / CHECKPOINT_DIR).is_dir()
    for name in (CORRECTION_STREAM, CHECKPOINT_DIR, ADAPTERS_DIR, ADAPTER_CACHE_DIR, PENDING_FILE):
        assert name in asked.stdout, name  # it lists what it would delete

    done = purge("--yes", "--registry")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "deleted 3 Redis keys, 4 paths, 1 registered versions" in done.stdout
    assert sorted(key.decode() for key in redis_client.keys("*")) == ["someone-elses-key"]
    assert sorted(path.name for path in data.iterdir()) == sorted(
        path.name for path in data.iterdir() if path.name.startswith((MLFLOW_DB, "mlartifacts"))
    )
    assert registry.versions() == [] and registry.aliases() == {}
    assert "nothing to delete" in purge("--yes").stdout
