"""The adapter registry: promoted adapters as versions of an MLflow registered model, the served one
named by an alias.

    registry = AdapterRegistry(data_dir=Path(".adaptive-spec"), redis_url=os.environ.get("REDIS_URL"))
    version = registry.register(Path(".adaptive-spec/adapters/v0003"), by="trainer")  # "3", now champion
    registry.rollback(by="cli:alice@host")          # champion <- previous
    registry.promote("2", by="admin-api:10.0.0.7")  # champion <- 2, previous <- the old champion
    registry.versions()                             # [RegisteredAdapter(version="1", ...), ...]

From the terminal: `adaptive-spec adapters list|rollback [--to V]|promote V`. Tests (real MLflow on
sqlite and a `mlflow server`, real Redis, about 40 s): `.venv/bin/python -m pytest tests/trainer/test_registry.py -q`.

Names (DESIGN.md contracts): experiment `adaptive-spec`, registered model `adaptive-spec-draft`,
aliases `champion` (served) and `previous` (the one before, for rollback), events on the Redis
pub/sub channel `adaptive_spec:adapters`. The tracking URI is `MLFLOW_TRACKING_URI` when set, else
`sqlite:///<data_dir>/mlflow.db` with artifacts under `<data_dir>/mlartifacts`.

One registration (`register`) is, in order:

1. a run in the experiment with the adapter directory as artifacts under `adapter/` (PEFT's two
   files, adaptive_spec_adapter.json, checksum.sha256, draft_vocab.json), the training settings as
   params (lr, rank, alpha, target modules, records and tokens used), the gate's figures as
   metrics (`candidate_greedy_match`, `champion_greedy_match`, ... and `loss`) and the lineage as
   tags (target id, draft spec, base version, parent, domain mix, the weights' sha256);
2. a version of the registered model made with `MlflowClient.create_model_version` from that run's
   artifacts (`mlflow.register_model` refuses plain files in MLflow 3);
3. with `promote=True`, `promote(version)`.

A retry after a registration that half happened does not make a second version: a version whose
`adapter_sha256` tag equals the adapter's is reused.

Promotion and rollback move aliases and leave an audit trail: tags on the version
(`adaptive_spec.last_action`, `..._by`, `..._at`), a registered-model tag `adaptive_spec.last_event`
holding the event, and the event published on `adaptive_spec:adapters`:

    {"event": "rollback", "model": "adaptive-spec-draft", "version": "2", "from": "3",
     "by": "cli:alice@host", "at": 1763800000.0, "target_id": "...", "draft_id": "early-exit:4"}

A rollback without `to` sets `champion` to `previous` and removes `previous`: nothing is known about
the version before it, and a second plain rollback must not bring back the version just rolled away
from. `rollback(to=V)` and `promote(V)` go anywhere and set `previous` to the old champion.

MLflow down (DESIGN.md "Behaviour under faults"): `PendingRegistrations` is the trainer's
`on_promote`. It writes the promoted adapter's directory to a queue file and returns at once; a
thread registers the queue in order and, while MLflow is unreachable, keeps it and retries every
`retry_s`, across trainer restarts too. The trainer never waits for MLflow.

Operators win over the trainer. A queued adapter moves `champion` only while the registry still
serves the adapter it was trained from (its `parent_sha256`, compared with the champion's
`adapter_sha256` tag just before promoting). After a rollback, say champion 5 -> 4 while the
trainer's v0006 (trained from 5) waited for MLflow, v0006 is registered as version 6 *without*
promoting it, tagged `adaptive_spec.not_promoted` with the reason, so an operator can still
promote it by hand. The trainer itself follows the registry through `RegistryChampion`
(OnlineTrainer's `champion_source`): once nothing of its own is queued, whatever the registry serves
is the champion it adopts, trains from and gates against. What is left: an operator action landing
between the check and the alias move of one registration (a few milliseconds) is overwritten.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from adaptive_spec.adapters import AdapterDir, AdapterError
from adaptive_spec.contracts import (
    ACTION_TAG,
    ADAPTER_EVENTS,
    ARTIFACT_PATH,
    CHAMPION,
    EVENT_TAG,
    EXPERIMENT,
    METADATA_FILE,
    MLFLOW_TRACKING_URI_ENV,
    MODEL_NAME,
    NOT_PROMOTED_TAG,
    OUTSIDE,
    PREVIOUS,
    SHA_TAG,
    redact_url,
    sqlite_tracking_uri,
)

log = logging.getLogger(__name__)

# MLflow's REST client retries 7 times with exponential backoff (minutes) by default; registry
# calls run in background threads that must notice an outage and come back, so fail within seconds.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


class RegistryError(ValueError):
    """A request the registry refuses whatever its state: an unknown version, nothing to roll back to."""


class RegistryUnavailable(RuntimeError):
    """MLflow (or its database) could not be reached; the same call may work later."""


@dataclass(frozen=True)
class RegisteredAdapter:
    """One version of the registered model, as `adapters list` shows it."""

    version: str
    created_at: float  # seconds since the epoch
    aliases: tuple[str, ...]
    run_id: str
    sha256: str | None
    candidate_greedy_match: float | None  # the gate's figures when it was promoted by the trainer
    champion_greedy_match: float | None
    candidate_expected_acceptance: float | None
    loss: float | None
    tags: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "version": self.version,
            "created_at": self.created_at,
            "aliases": list(self.aliases),
            "run_id": self.run_id,
            "sha256": self.sha256,
            "candidate_greedy_match": self.candidate_greedy_match,
            "champion_greedy_match": self.champion_greedy_match,
            "candidate_expected_acceptance": self.candidate_expected_acceptance,
            "loss": self.loss,
            "target_id": self.tags.get("target_id"),
            "draft_id": self.tags.get("draft_id"),
            "last_action": self.tags.get(ACTION_TAG),
            "last_action_by": self.tags.get(ACTION_TAG + "_by"),
        }


@dataclass(frozen=True)
class ServedChampion:
    """The version the `champion` alias names, as the trainer compares it with its own champion."""

    version: str | None  # None: no alias (or no registered model): the base draft is served
    sha256: str | None  # the version's adapter_sha256 tag; None for the base draft or an untagged version
    by: str | None  # who put it there: the registry's last event when it names this version, else OUTSIDE
    moved_from: str | None = None  # the champion before, from that event (None: no event, or the base draft)


def default_tracking_uri(data_dir: Path) -> str:
    """`MLFLOW_TRACKING_URI`, else the sqlite file in the data directory."""
    return os.environ.get(MLFLOW_TRACKING_URI_ENV) or sqlite_tracking_uri(data_dir)


def actor(kind: str) -> str:
    """Who does it, for the audit trail: e.g. actor("cli") -> "cli:alice@host"."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{kind}:{user}@{socket.gethostname()}"


class AdapterRegistry:
    """Registered versions and aliases of one target/draft pair's adapters.

    Constructing it contacts nothing (a server may be down); each call does, and raises
    `RegistryUnavailable` when MLflow cannot be reached and `RegistryError` for a bad request.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        data_dir: Path | str = ".adaptive-spec",
        redis_url: str | None = None,
        model_name: str = MODEL_NAME,
        experiment: str = EXPERIMENT,
    ) -> None:
        from mlflow import MlflowClient

        self.data_dir = Path(data_dir)
        self.tracking_uri = tracking_uri or default_tracking_uri(self.data_dir)
        self.local = self.tracking_uri.startswith(("sqlite:", "file:", "/"))
        if self.tracking_uri.startswith("sqlite:///"):
            Path(self.tracking_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.model_name = model_name
        self.experiment = experiment
        self.redis_url = redis_url
        self.client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)
        self._redis = None
        self._experiment_id: str | None = None
        self._sha_of: dict[str, str] = {}  # version -> adapter_sha256 tag (set when the version is created)

    def __repr__(self) -> str:
        return f"AdapterRegistry({redact_url(self.tracking_uri)!r}, model={self.model_name!r})"

    # ---------------------------------------------------------------- writing

    def register(self, adapter_dir: Path | str, *, by: str = "trainer", promote: bool = True) -> str:
        """Log the adapter directory as a run, make it a version, and (by default) promote it."""
        adapter_dir = Path(adapter_dir)
        try:
            metadata = AdapterDir(adapter_dir).metadata()
        except AdapterError as exc:
            raise RegistryError(str(exc)) from None
        if not metadata:
            raise RegistryError(f"{adapter_dir}: no {METADATA_FILE}; not an adapter the trainer wrote")
        sha = metadata.get(SHA_TAG)
        with self._mlflow("register"):
            self._ensure_model(metadata)
            existing = self._versions_with_sha(sha) if sha else []
            if existing:
                version = existing[0]
                log.info("%s is already version %s of %s", adapter_dir, version, self.model_name)
            else:
                run_id = self._log_run(adapter_dir, metadata)
                source = self.client.get_run(run_id).info.artifact_uri.rstrip("/") + "/" + ARTIFACT_PATH
                created = self.client.create_model_version(
                    self.model_name, source, run_id=run_id, tags=_version_tags(metadata, adapter_dir)
                )
                version = str(created.version)
                log.info("registered %s as version %s of %s (run %s)", adapter_dir, version, self.model_name, run_id)
        if promote:
            self.promote(version, by=by)
        return version

    def promote(self, version: str | int, *, by: str, action: str = "promote") -> dict:
        """champion <- version, previous <- the old champion; returns the event it published."""
        version = str(version)
        with self._mlflow(action):
            self._get_version(version)
            old = self.aliases().get(CHAMPION)
            if old == version:  # nothing moves, nothing to record
                return {
                    "event": action,
                    "model": self.model_name,
                    "version": version,
                    "from": old,
                    "by": by,
                    "at": time.time(),
                    "changed": False,
                }
            at = self._audit(version, action, by)  # before the alias moves: a watcher reads them with it
            if old is not None:
                self.client.set_registered_model_alias(self.model_name, PREVIOUS, old)
            self.client.set_registered_model_alias(self.model_name, CHAMPION, version)
            return self._record(action, version, old, by, at)

    def rollback(self, to: str | int | None = None, *, by: str) -> dict:
        """champion <- `to`, or <- previous (and previous removed) when `to` is None."""
        if to is not None:
            return self.promote(to, by=by, action="rollback")
        with self._mlflow("rollback"):
            aliases = self.aliases()
            target, old = aliases.get(PREVIOUS), aliases.get(CHAMPION)
            if target is None:
                raise RegistryError(
                    f"{self.model_name} has no '{PREVIOUS}' version to roll back to; "
                    f"name one with --to VERSION (see `adaptive-spec adapters list`)"
                )
            at = self._audit(target, "rollback", by)
            self.client.set_registered_model_alias(self.model_name, CHAMPION, target)
            self.client.delete_registered_model_alias(self.model_name, PREVIOUS)
            return self._record("rollback", target, old, by, at)

    # ---------------------------------------------------------------- reading

    def aliases(self) -> dict[str, str]:
        """alias -> version, as str (a server sends str, sqlite int); {} before the first registration."""
        with self._mlflow("read aliases"):
            try:
                model = self.client.get_registered_model(self.model_name)
            except Exception as exc:
                if _error_code(exc) == "RESOURCE_DOES_NOT_EXIST":
                    return {}
                raise
            return {alias: str(version) for alias, version in (model.aliases or {}).items()}

    def champion(self) -> str | None:
        """The served version, or None (no registered model, or the alias points at nothing)."""
        return self.aliases().get(CHAMPION)

    def served(self) -> ServedChampion:
        """The champion, its weights' sha256 and who moved it there: one or two MLflow calls."""
        with self._mlflow("read champion"):
            try:
                model = self.client.get_registered_model(self.model_name)
            except Exception as exc:
                if _error_code(exc) == "RESOURCE_DOES_NOT_EXIST":
                    return ServedChampion(None, None, None)
                raise
            version = (model.aliases or {}).get(CHAMPION)
            version = None if version is None else str(version)
            if version is not None and version not in self._sha_of:
                sha = (self._get_version(version).tags or {}).get(SHA_TAG)
                if sha:
                    self._sha_of[version] = sha
            raw = (model.tags or {}).get(EVENT_TAG)
        event = json.loads(raw) if raw else {}
        if event.get("version") == version:
            return ServedChampion(version, self._sha_of.get(version), event.get("by"), event.get("from"))
        return ServedChampion(version, self._sha_of.get(version), OUTSIDE)

    def get(self, version: str | int) -> RegisteredAdapter:
        with self._mlflow("read version"):
            return self._describe(self._get_version(str(version)), self.aliases())

    def versions(self) -> list[RegisteredAdapter]:
        """Every version, oldest first."""
        with self._mlflow("list versions"):
            aliases = self.aliases()
            found = self.client.search_model_versions(f"name = '{self.model_name}'")
            described = [self._describe(version, aliases) for version in found]
        return sorted(described, key=lambda v: int(v.version) if v.version.isdigit() else 0)

    def download(self, version: str | int, destination: Path) -> Path:
        """The version's adapter directory, downloaded under `destination`; returns its path."""
        with self._mlflow("download"):
            model_version = self._get_version(str(version))
            destination.mkdir(parents=True, exist_ok=True)
            return Path(self.client.download_artifacts(model_version.run_id, ARTIFACT_PATH, str(destination)))

    def version_of(self, sha256: str) -> str | None:
        """The oldest version whose adapter_sha256 tag is sha256, or None."""
        with self._mlflow("find version"):
            found = self._versions_with_sha(sha256)
        return found[0] if found else None

    def set_version_tag(self, version: str | int, key: str, value: str) -> None:
        with self._mlflow("tag version"):
            self.client.set_model_version_tag(self.model_name, str(version), key, value)

    def last_event(self) -> dict | None:
        with self._mlflow("read event"):
            raw = self.client.get_registered_model(self.model_name).tags.get(EVENT_TAG)
        return json.loads(raw) if raw else None

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()

    # ---------------------------------------------------------------- helpers

    def _mlflow(self, what: str):
        return _Translate(what, self.tracking_uri)

    def _ensure_model(self, metadata: dict) -> None:
        pair = {"target_id": str(metadata.get("target_id")), "draft_id": str(metadata.get("draft_id"))}
        try:
            model = self.client.get_registered_model(self.model_name)
        except Exception as exc:
            if _error_code(exc) != "RESOURCE_DOES_NOT_EXIST":
                raise
            try:
                self.client.create_registered_model(
                    self.model_name,
                    tags=pair,
                    description=(
                        f"LoRA adapters of the draft {pair['draft_id']} for the target {pair['target_id']}, "
                        f"trained online by adaptive-spec. The alias '{CHAMPION}' is served."
                    ),
                )
            except Exception as exc:  # another process created it first
                if _error_code(exc) != "RESOURCE_ALREADY_EXISTS":
                    raise
            return
        kept = {key: model.tags.get(key) for key in pair}
        if all(kept.values()) and kept != pair:
            raise RegistryError(
                f"{self.model_name} holds adapters for {kept}, this one is for {pair}: use another "
                f"MLflow tracking URI (or registered model) per target/draft pair"
            )

    def _experiment(self) -> str:
        if self._experiment_id is None:
            found = self.client.get_experiment_by_name(self.experiment)
            if found is not None:
                self._experiment_id = found.experiment_id
            else:
                location = (self.data_dir.resolve() / "mlartifacts").as_uri() if self.local else None
                try:
                    self._experiment_id = self.client.create_experiment(self.experiment, artifact_location=location)
                except Exception as exc:
                    if _error_code(exc) != "RESOURCE_ALREADY_EXISTS":
                        raise
                    self._experiment_id = self.client.get_experiment_by_name(self.experiment).experiment_id
        return self._experiment_id

    def _log_run(self, adapter_dir: Path, metadata: dict) -> str:
        from mlflow.entities import Metric, Param

        settings = metadata.get("settings") or {}
        run = self.client.create_run(
            self._experiment(), run_name=f"adapter-{adapter_dir.name}", tags=_version_tags(metadata, adapter_dir)
        )
        run_id = run.info.run_id
        params = {
            "lr": settings.get("lr"),
            "rank": settings.get("r"),
            "lora_alpha": settings.get("alpha"),
            "target_modules": ",".join(settings.get("target_modules") or []),
            "loss_kind": settings.get("loss"),
            "records_used": metadata.get("records_used"),
            "tokens_used": metadata.get("tokens_used"),
            "records_consumed": metadata.get("records_consumed"),
            "tokens_consumed": metadata.get("tokens_consumed"),
            "steps": metadata.get("steps"),
            "round_steps": metadata.get("round_steps"),
        }
        now = int(time.time() * 1000)
        gate = metadata.get("gate") or {}
        metrics = {
            "loss": metadata.get("loss"),
            "first_loss": metadata.get("first_loss"),
            "last_loss": metadata.get("last_loss"),
        }
        for side in ("candidate", "champion"):
            for key, value in (gate.get(side) or {}).items():
                metrics[f"{side}_{key}"] = value
        self.client.log_batch(
            run_id,
            metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items() if _finite(v)],
            params=[Param(k, str(v)) for k, v in params.items() if v is not None],
        )
        self.client.log_artifacts(run_id, str(adapter_dir), ARTIFACT_PATH)
        self.client.set_terminated(run_id)
        return run_id

    def _versions_with_sha(self, sha: str) -> list[str]:
        found = self.client.search_model_versions(f"name = '{self.model_name}' and tags.{SHA_TAG} = '{sha}'")
        return sorted((str(v.version) for v in found), key=int)

    def _get_version(self, version: str):
        try:
            return self.client.get_model_version(self.model_name, version)
        except Exception as exc:
            if _error_code(exc) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise RegistryError(f"{self.model_name} has no version {version!r}") from None
            raise

    def _describe(self, model_version, aliases: dict[str, str]) -> RegisteredAdapter:
        version = str(model_version.version)
        metrics: dict = {}
        try:
            metrics = self.client.get_run(model_version.run_id).data.metrics if model_version.run_id else {}
        except Exception as exc:  # a deleted run: list the version without its figures
            log.debug("no run for version %s: %s", version, exc)
        tags = dict(model_version.tags or {})
        return RegisteredAdapter(
            version=version,
            created_at=model_version.creation_timestamp / 1000.0,
            aliases=tuple(sorted(alias for alias, v in aliases.items() if v == version)),
            run_id=model_version.run_id or "",
            sha256=tags.get(SHA_TAG),
            candidate_greedy_match=metrics.get("candidate_greedy_match"),
            champion_greedy_match=metrics.get("champion_greedy_match"),
            candidate_expected_acceptance=metrics.get("candidate_expected_acceptance"),
            loss=metrics.get("loss"),
            tags=tags,
        )

    def _audit(self, version: str, action: str, by: str) -> float:
        """Tags on the version saying what was done to it, by whom, when; returns when."""
        at = time.time()
        for key, value in ((ACTION_TAG, action), (ACTION_TAG + "_by", by), (ACTION_TAG + "_at", str(at))):
            self.client.set_model_version_tag(self.model_name, version, key, value)
        return at

    def _record(self, action: str, version: str, old: str | None, by: str, at: float) -> dict:
        """The event: as a tag on the registered model, then on pub/sub (best effort)."""
        model = self.client.get_registered_model(self.model_name)
        event = {
            "event": action,
            "model": self.model_name,
            "version": version,
            "from": old,
            "by": by,
            "at": at,
            "changed": True,
            "target_id": model.tags.get("target_id"),
            "draft_id": model.tags.get("draft_id"),
        }
        self.client.set_registered_model_tag(self.model_name, EVENT_TAG, json.dumps(event))
        log.info("%s: %s champion %s -> %s by %s", self.model_name, action, old, version, by)
        self.publish(event)
        return event

    def publish(self, event: dict) -> bool:
        """Send the event on `adaptive_spec:adapters`; False (logged) when Redis is not there.

        Watchers also poll the alias, so a lost event delays a swap by one poll at most."""
        if not self.redis_url:
            return False
        import redis

        try:
            if self._redis is None:
                self._redis = redis.Redis.from_url(self.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
            self._redis.publish(ADAPTER_EVENTS, json.dumps(event))
            return True
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning(
                "could not publish %s on %s (%s); servers will see it on their next alias poll",
                event["event"],
                ADAPTER_EVENTS,
                exc,
            )
            return False


class _Translate:
    """MLflow's exceptions as ours: RegistryError for a bad request, RegistryUnavailable for the rest."""

    def __init__(self, what: str, uri: str) -> None:
        self.what, self.uri = what, uri

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or isinstance(exc, (RegistryError, RegistryUnavailable)):
            return False
        if not isinstance(exc, Exception):
            return False
        code = _error_code(exc)
        if code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "BAD_REQUEST"):
            raise RegistryError(f"{self.what}: {exc}") from exc
        raise RegistryUnavailable(
            f"{self.what}: MLflow at {redact_url(self.uri)} is unavailable: {type(exc).__name__}: {str(exc)[:300]}"
        ) from exc


def _error_code(exc: BaseException) -> str | None:
    return getattr(exc, "error_code", None)


def _finite(value) -> bool:
    try:
        return value is not None and float(value) == float(value) and abs(float(value)) != float("inf")
    except (TypeError, ValueError):
        return False


def _version_tags(metadata: dict, adapter_dir: Path) -> dict[str, str]:
    gate = metadata.get("gate") or {}
    tags = {
        "target_id": metadata.get("target_id"),
        "draft_id": metadata.get("draft_id"),
        "base_version": metadata.get("base_version"),
        "parent_version": metadata.get("parent_version"),
        "trainer_version": metadata.get("version"),
        "adapter_dir": adapter_dir.name,
        "domain_mix": json.dumps(metadata.get("domain_mix") or {}, sort_keys=True),
        SHA_TAG: metadata.get(SHA_TAG),
        "gate_reason": gate.get("reason"),
    }
    return {key: str(value) for key, value in tags.items() if value is not None}


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

    def __init__(self, registry: AdapterRegistry, queue_file: Path, *, by: str = "trainer", retry_s: float = 10.0):
        self.registry = registry
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
                    return 0
                entry = queue[0]
                try:
                    abandoned = self._abandoned(entry)
                    version = self.registry.register(Path(entry["path"]), by=self.by, promote=abandoned is None)
                    if abandoned is not None:
                        self.registry.set_version_tag(version, NOT_PROMOTED_TAG, abandoned)
                        log.warning(
                            "registered %s as version %s without promoting it: %s", entry["path"], version, abandoned
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

    def _abandoned(self, entry: dict) -> str | None:
        """Why the entry must not move champion (an operator moved it off its parent), or None."""
        if "parent_sha256" not in entry:  # queued by an older trainer, or by hand: promote as before
            return None
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


class RegistryChampion:
    """What the registry serves, for the trainer (`OnlineTrainer(champion_source=...)`).

        source = RegistryChampion(registry, pending)
        source.served()      # ServedChampion("4", "9f2c...", "cli:alice@host"), or None while pending is not empty
        source.download("4", Path("/tmp/x"))   # the version's adapter directory
        source.version_of("9f2c...")           # "4": the version holding these weights (for the log)

    While some of the trainer's own promotions still wait in `pending`, the registry lags behind the
    trainer and says nothing about operators: `served()` answers None and the trainer keeps its
    champion. Once the queue is empty, a champion other than the trainer's is someone else's doing
    (or a registration that could not promote) and the trainer adopts it. Raises RegistryUnavailable
    when MLflow is down.
    """

    def __init__(self, registry: AdapterRegistry, pending: PendingRegistrations | None = None) -> None:
        self.registry = registry
        self.pending = pending

    def served(self) -> ServedChampion | None:
        if self.pending is not None and self.pending.pending():
            return None
        return self.registry.served()

    def download(self, version: str, destination: Path) -> Path:
        return self.registry.download(version, destination)

    def version_of(self, sha256: str) -> str | None:
        """The oldest version holding these weights, or None."""
        return self.registry.version_of(sha256)
