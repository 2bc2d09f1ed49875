"""The pending-promotion queue: the trainer's promotions wait on disk until MLflow takes them.

    pending = PendingRegistrations(registry, data_dir / "registry-pending.json", by="trainer:host").start()
    trainer = OnlineTrainer(..., on_promote=pending.submit)   # returns at once, whatever MLflow does
    ...
    pending.stop()          # one last try; the queue file keeps what is left for the next start

MLflow down (DESIGN.md "Behaviour under faults"): `submit` writes the promoted adapter's directory
to the queue file and returns at once; a thread registers the queue in order and, while MLflow is
unreachable, keeps it and retries every `retry_s`, across trainer restarts too. The trainer never
waits for MLflow.

Operators win over the trainer. A queued adapter moves `champion` only while the registry still
serves the adapter it was trained from (its `parent_sha256`, compared with the champion's
`adapter_sha256` tag just before promoting). After a rollback, say champion 5 -> 4 while the
trainer's v0006 (trained from 5) waited for MLflow, v0006 is registered as version 6 *without*
promoting it, tagged `adaptive_spec.not_promoted` with the reason, so an operator can still
promote it by hand. The trainer itself follows the registry (trainer/promotion/champion.py): once nothing of
its own is queued, whatever the registry serves is the champion it adopts, trains from and gates
against. The check runs after the version is created (its artifacts uploaded: a second or more),
under the registry's alias lock (registry/lock.py) with the move itself, so a rollback made during the
upload stands, and one made at the same moment lands either before the check (the entry is not promoted)
or after the move (it rolls the entry back).

A domain's adapter (its metadata says `"domain": "sql"`, trainer/loop/domains.py) moves that domain's
aliases (`champion-sql`, `previous-sql`), and the check compares its parent with `champion-sql`, or
with `champion` while the domain has no alias of its own (its requests draft with the general
adapter, which is what its first version was trained from).

Retention: once the queue is empty, the trainer's version directories are pruned to the last
`keep_versions` (ADAPTIVE_SPEC_KEEP_VERSIONS, 20) plus every one an alias names (`prune`).

Tests (MLflow server stopped and started, real Redis): `.venv/bin/python -m pytest
tests/registry/test_registry.py tests/reliability/test_mlflow_outage.py -q`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

from adaptive_spec.contracts import NOT_PROMOTED_TAG
from adaptive_spec.formats.adapters import AdapterDir, trainer_versions
from registry.client import AdapterRegistry, RegistryError, RegistryUnavailable

log = logging.getLogger(__name__)


class PendingRegistrations:
    """The trainer's `on_promote`: queue the adapter on disk, register it from a thread, retry while
    MLflow is down.

        pending = PendingRegistrations(registry, data_dir / "registry-pending.json", by="trainer:host")
        pending.start()
        trainer = OnlineTrainer(..., on_promote=pending.submit)
        ...
        pending.stop()          # one last try, then the queue file keeps what is left

    Entries are registered (and promoted) oldest first, so when MLflow returns after the trainer
    promoted v0004 and v0005, champion ends at v0005 with previous at v0004, as if it had never
    been away. A `RegistryError` (e.g. the directory is gone) drops its entry, logged; anything else
    keeps the queue for the next try.

    An entry that names the adapter it was trained from (`parent_sha256`, which OnlineTrainer's
    AdapterVersion carries) is promoted only if that adapter (or the entry itself) is still the
    champion when its turn comes. Otherwise an operator moved the champion meanwhile (a rollback,
    say): the entry is registered without promotion and tagged `adaptive_spec.not_promoted`. In the
    example above, v0004 lands and becomes champion; if an operator then rolls back before v0005's
    turn, v0005 (trained from v0004) no longer matches and stays a plain version.
    """

    def __init__(
        self,
        registry: AdapterRegistry,
        queue_file: Path,
        *,
        by: str = "trainer",
        retry_s: float = 10.0,
        versions_dir: Path | None = None,
        keep_versions: int = 20,
    ):
        self.registry = registry
        self.versions_dir = versions_dir  # the trainer's vNNNN directories, pruned after each registration
        self.keep_versions = keep_versions
        self.queue_file = Path(queue_file)
        self.by = by
        self.retry_s = retry_s
        self.registered: list[str] = []  # registry versions made by this object, in order
        self.not_promoted: list[str] = []  # those of them left unpromoted: their lineage was abandoned
        self.failures = 0  # attempts that found MLflow unavailable
        self._flush_lock = threading.Lock()  # one flush at a time
        self._file_lock = threading.Lock()  # the queue file; never held across an MLflow call
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def submit(self, adapter) -> None:
        """on_promote(AdapterVersion): never raises for MLflow and never waits for it."""
        entry = {"path": str(Path(adapter.path).resolve()), "queued_at": time.time()}
        if hasattr(adapter, "parent_sha256"):  # what it was trained from: the champion it may replace
            entry.update(parent_sha256=adapter.parent_sha256, sha256=adapter.sha256)
        with self._file_lock:
            queue = self._read()
            queue.append(entry)
            self._write(queue)
        self._wake.set()
        if self._thread is None:  # no background thread: try now, in the caller's thread
            self.flush()

    def pending(self) -> list[dict]:
        with self._file_lock:
            return self._read()

    def flush(self) -> int:
        """Register what is queued, oldest first; returns how many are left."""
        with self._flush_lock:
            while True:
                queue = self.pending()
                if not queue:
                    self.prune()
                    return 0
                entry = queue[0]
                try:
                    version = self.registry.register(Path(entry["path"]), by=self.by, promote=False)
                    domain = AdapterDir(entry["path"]).metadata().domain or None  # register read it too
                    event = self.registry.promote(  # the check runs under the alias lock, right before the move
                        version, by=self.by, domain=domain, unless=functools.partial(self._abandoned, entry, domain)
                    )
                    if event.get("refused"):
                        self.registry.set_version_tag(version, NOT_PROMOTED_TAG, event["refused"])
                        log.warning(
                            "registered %s as version %s without promoting it: %s",
                            entry["path"],
                            version,
                            event["refused"],
                        )
                        self.not_promoted.append(version)
                    self.registered.append(version)
                except RegistryUnavailable as exc:
                    self.failures += 1
                    log.warning(
                        "%d adapter(s) wait for MLflow (%s); retrying every %.0f s", len(queue), exc, self.retry_s
                    )
                    return len(queue)
                except (RegistryError, OSError, json.JSONDecodeError) as exc:
                    log.error("dropping %s from the registration queue: %s", entry["path"], exc)
                with self._file_lock:  # submit() may have appended meanwhile: remove this entry only
                    queue = self._read()
                    if queue and queue[0] == entry:
                        queue.pop(0)
                    self._write(queue)

    def prune(self) -> list[str]:
        """Delete the trainer's version directories but the last `keep_versions`, those an alias of the registry
        names (any domain's champion or previous, matched by their weights' sha256) and those still queued;
        returns the names deleted. A directory holds the n-gram index and vocabulary of the traffic it was
        trained on, so they go with it. MLflow down: nothing is deleted (what is aliased is unknown)."""
        if self.versions_dir is None:
            return []
        versions = trainer_versions(self.versions_dir)
        old = list(versions)[: -self.keep_versions] if self.keep_versions else list(versions)
        if not old:
            return []
        try:
            aliased = {self.registry.get(version).sha256 for version in set(self.registry.aliases().values())}
        except (RegistryUnavailable, RegistryError) as exc:
            log.info("not pruning version directories: %s", exc)
            return []
        queued = {str(Path(entry["path"]).resolve()) for entry in self.pending()}
        deleted = []
        for number in old:
            adapter = versions[number]
            if str(adapter.path.resolve()) in queued or adapter.metadata().adapter_sha256 in aliased:
                continue
            shutil.rmtree(adapter.path, ignore_errors=True)
            deleted.append(adapter.name)
        if deleted:
            kept = self.keep_versions
            log.info(
                "pruned %d version directories (%s); kept the last %d and every aliased one",
                len(deleted),
                ", ".join(deleted),
                kept,
            )
        return deleted

    def _abandoned(self, entry: dict, domain: str | None) -> str | None:
        """Why the entry must not move its champion alias (an operator moved it off its parent), or None."""
        if "parent_sha256" not in entry:  # queued by hand, or by an on_promote that names no parent: nothing to check
            return None
        served = self.registry.served(domain)
        if served.version is None and domain is not None:  # its requests draft with the general adapter
            served = self.registry.served()
        parent, own = entry["parent_sha256"], entry.get("sha256")
        if served.version is None:
            holds = parent is None
        else:
            holds = served.sha256 is not None and served.sha256 in (parent, own)
        if holds:
            return None
        trained_from = "the base draft" if parent is None else f"the adapter with sha256 {parent[:12]}"
        return (
            f"it was trained from {trained_from}, but the champion is now "
            f"{'the base draft' if served.version is None else 'version ' + served.version} "
            f"(moved by {served.by}); promote it by hand if you want it"
        )

    def start(self) -> PendingRegistrations:
        self._thread = threading.Thread(target=self._run, name="registry-sync", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> int:
        """Stop the thread after one last try; returns how many adapters are still queued (kept on disk)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        left = len(self.pending())
        if left:
            log.warning(
                "%d adapter(s) not yet registered; the next `adaptive-spec train` retries them (%s)",
                left,
                self.queue_file,
            )
        return left

    def _run(self) -> None:
        while True:
            left = self.flush()
            if self._stop.is_set():
                return
            self._wake.wait(self.retry_s if left else None)
            self._wake.clear()

    def _read(self) -> list[dict]:
        if not self.queue_file.is_file():
            return []
        return json.loads(self.queue_file.read_text() or "[]")

    def _write(self, queue: list[dict]) -> None:
        self.queue_file.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.queue_file.with_suffix(".tmp")
        temporary.write_text(json.dumps(queue, indent=1) + "\n")
        os.replace(temporary, self.queue_file)
