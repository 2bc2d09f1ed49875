"""Alias moves are atomic (registry/lock.py): rollbacks and the trainer's queued promotions, run at the same
time over and over, end in a state the two moves make one after the other, and each says what it did.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/registry/test_alias_race.py -q -s   (about a minute)

Each round starts from champion 2, previous 1, with version N (trained from 2, so the queue promotes it only
while 2 is still the champion) waiting in the trainer's queue. A rollback starts at a time spread over the
queue's registration, so that some rounds land in the queue's check-then-move window. The only states that
two moves made one after the other can leave:

- the promotion first: champion N, previous 2; then the rollback: champion 2, no previous; the rollback
  says "N -> 2";
- the rollback first: champion 1, no previous; the queue sees 2 is gone and leaves N unpromoted (tagged);
  the rollback says "2 -> 1".

Without the lock, a rollback landing between the queue's check and its move ended with N served and
`previous` deleted, while the rollback said "2 -> 1" (the issue's "champion 5 -> 4").
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from registry_support import write_adapter
from support import child_env
from tiny import tiny_target

from adaptive_spec.contracts import NOT_PROMOTED_TAG
from adaptive_spec.formats.adapters import AdapterDir
from cli.adapters import describe_move
from registry.client import AdapterRegistry
from trainer.promotion.pending import PendingRegistrations

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]

ROUNDS = {"sqlite": 16, "server": 8}


@pytest.fixture(params=["sqlite", "server"])
def store(request, tmp_path) -> tuple[str, str | None]:
    """(tracking URI, Redis URL of the lock): a sqlite file (its file lock), or an `mlflow server` with Redis."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'mlflow.db'}", None
    return request.getfixturevalue("mlflow_server").url, request.getfixturevalue("redis_url")


def one_round(registry, pending, candidate: Path, parent: str, delay_s: float) -> dict:
    """Rollback and queued promotion at once; returns what each said and the aliases afterwards."""
    registry.promote("1", by="test:setup")
    registry.promote("2", by="test:setup")  # champion 2, previous 1
    said: dict = {}

    def roll_back():
        time.sleep(delay_s)
        said["rollback"] = registry.rollback(by="cli:alice@host")

    rollback = threading.Thread(target=roll_back)
    rollback.start()
    own = AdapterDir(candidate).metadata().adapter_sha256
    pending.submit(SimpleNamespace(path=candidate, parent_sha256=parent, sha256=own))
    rollback.join(60)
    version = pending.registered[-1]
    return {
        "version": version,
        "promoted": version not in pending.not_promoted,
        "rollback": said["rollback"],
        "aliases": registry.aliases(),
        "tag": registry.get(version).tags.get(NOT_PROMOTED_TAG),
    }


def test_rollbacks_racing_queued_promotions_always_end_consistent(store, tmp_path):
    uri, redis_url = store
    registry = AdapterRegistry(uri, data_dir=tmp_path, redis_url=redis_url, model_name=f"race-{uuid.uuid4().hex[:6]}")
    target = tiny_target(0)
    first, second = (write_adapter(target, 1, tmp_path / f"v{i}", seed=i, version=i) for i in (1, 2))
    registry.register(first, by="test:setup")
    registry.register(second, by="test:setup")
    parent = AdapterDir(second).metadata().adapter_sha256
    pending = PendingRegistrations(registry, tmp_path / "pending.json", by="trainer:test")

    started = time.monotonic()  # how long one queued registration takes here: the rollbacks spread over it
    pending.submit(SimpleNamespace(path=write_adapter(target, 1, tmp_path / "probe", seed=99)))
    span = time.monotonic() - started
    rounds = ROUNDS["sqlite" if redis_url is None else "server"]
    outcomes = []
    for i in range(rounds):
        candidate = write_adapter(target, 1, tmp_path / f"n{i}", seed=100 + i, version=3 + i)
        outcomes.append(one_round(registry, pending, candidate, parent, delay_s=span * (0.3 + 1.0 * i / rounds)))

    print(f"\n{registry.lock.kind} lock, {rounds} rounds, registration {span:.2f} s:")
    for o in outcomes:
        print(f"  v{o['version']} promoted={o['promoted']}  {describe_move(o['rollback'], None)}  -> {o['aliases']}")
    for o in outcomes:
        rollback, version = o["rollback"], o["version"]
        if o["promoted"]:  # the promotion, then the rollback
            assert (rollback["from"], rollback["version"]) == (version, "2"), o
            assert o["aliases"] == {"champion": "2"} and o["tag"] is None, o
        else:  # the rollback, then the queue's check
            assert (rollback["from"], rollback["version"]) == ("2", "1"), o
            assert o["aliases"] == {"champion": "1"} and o["tag"], o
        assert rollback["aliases"] == {"champion": rollback["version"], "previous": None}, o  # what it read back
    assert registry.lock.kind == ("file" if redis_url is None else "redis")


def test_the_cli_says_what_is_there_after_its_move(tmp_path, redis_url):
    """`adaptive-spec adapters rollback` as a process, under the same lock: its line names the move and the
    aliases it read back."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    registry = AdapterRegistry(uri, data_dir=tmp_path)
    target = tiny_target(0)
    for i in (1, 2):
        registry.register(write_adapter(target, 1, tmp_path / f"v{i}", seed=i, version=i), by="test:setup")
    done = subprocess.run(
        [sys.executable, "-m", "cli", "adapters", "rollback", "--data-dir", str(tmp_path)],
        env=child_env(MLFLOW_TRACKING_URI=uri, REDIS_URL=redis_url),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("rollback: champion 2 -> 1 (by cli:") and done.stdout.rstrip().endswith(
        "; previous none"
    ), done.stdout
    assert registry.aliases() == {"champion": "1"}
    event = registry.last_event()
    assert describe_move(event, None) == done.stdout.strip() and json.dumps(event)
