"""The adapter registry: promoted adapters as versions of an MLflow registered model, the served ones
named by aliases (the general adapter's and each domain's), and an audit trail of who moved them.

    registry = AdapterRegistry(data_dir=Path(".adaptive-spec"), redis_url=os.environ.get("REDIS_URL"))
    version = registry.register(Path(".adaptive-spec/adapters/v0003"), by="trainer")  # "3", now champion
    registry.rollback(by="cli:alice@host")          # champion <- previous
    registry.promote("2", by="admin-api:10.0.0.7")  # champion <- 2, previous <- the old champion
    registry.promote("3", by="cli:alice@host", domain="sql")  # champion-sql <- 3, previous-sql <- the old one
    registry.champions()                            # {None: "2", "sql": "3"}
    registry.versions()                             # [RegisteredAdapter(version="1", ...), ...]

From the terminal: `adaptive-spec adapters list|rollback [--to V]|promote V [--domain D]`. Tests (real
MLflow on sqlite and a `mlflow server`, real Redis, about 40 s): `.venv/bin/python -m pytest tests/registry/test_registry.py -q`.

Names (DESIGN.md contracts): experiment `adaptive-spec`, registered model `adaptive-spec-draft`,
aliases `champion` (served) and `previous` (for rollback), per domain `champion-<domain>` and
`previous-<domain>`, events on the Redis pub/sub channel `adaptive_spec:adapters`. The tracking URI
is `MLFLOW_TRACKING_URI` when set, else `sqlite:///<data_dir>/mlflow.db` (artifacts in `<data_dir>/mlartifacts`).

Domains: an adapter whose adaptive_spec_adapter.json says `"domain": "sql"` gets the version tag
`domain=sql` and is promoted to `champion-sql`; without one it is the general adapter. `promote`,
`rollback`, `champion`, `served` and `last_event` take `domain=` (None: the general adapter, as
before). Any version may be promoted for any domain: the domain named decides the aliases.

One registration (`register`) is, in order:

1. a run in the experiment with the adapter directory as artifacts under `adapter/` (PEFT's two
   files, adaptive_spec_adapter.json, checksum.sha256, draft_vocab.json), the training settings as
   params (lr, rank, alpha, target modules, records and tokens used), the gate's figures as
   metrics (`candidate_greedy_match`, `champion_greedy_match`, ... and `loss`) and the lineage as
   tags (target id, draft spec, base version, parent, domain mix, the weights' sha256);
2. a version of the registered model made with `MlflowClient.create_model_version` from that run's
   artifacts (`mlflow.register_model` refuses plain files in MLflow 3);
3. with `promote=True`, `promote(version, domain=<the metadata's domain>)`.

Signing (DESIGN.md: `ADAPTIVE_SPEC_SIGNING_KEY`): a registry given `signing_key` signs every adapter it
registers (`AdapterDir.sign`: an HMAC-SHA256 over the checksums, the config and the model ids, in
`signature.hmac`, uploaded with the files), and `check_signature` refuses a downloaded version without
this key's signature. The trainer registers with the key; servers and the trainer's adoption check it.

A retry after a registration that half happened does not make a second version: a version whose
`adapter_sha256` tag equals the adapter's is reused.

Promotion and rollback move aliases and leave an audit trail (registry_records.audit_tags and
event_tag): tags on the version (`adaptive_spec.last_action`, `..._by`, `..._at`, `..._alias`), the
event (with its `domain`) as the domain's registered-model tag, and the event published on
`adaptive_spec:adapters` (registry/events.py).

Every move holds the alias lock (registry/lock.py: a file lock beside a sqlite store, a Redis key for an
`mlflow server`), so promotions and rollbacks from the trainer, the CLI and the admin API of any replica
happen one after the other, never interleaved; a caller's condition (`promote(..., unless=...)`, the
trainer's queue asking whether its parent is still the champion) is checked under it too. Each move reads
the aliases back and returns them in its event (`"aliases"`), so a command says what is there afterwards.

A rollback without `to` sets `champion` to `previous` and removes `previous` (per domain alike): nothing
is known about the version before it, and a second plain rollback must not bring back the version just
rolled away from. `rollback(to=V)` and `promote(V)` go anywhere and set `previous` to the old champion.

The trainer's promotions reach `register` through a queue that outlives MLflow outages
(trainer/promotion/pending.py); the trainer reads the champion back through trainer/promotion/champion.py.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from adaptive_spec.adapters import AdapterDir, AdapterError
from adaptive_spec.contracts import (
    ARTIFACT_PATH,
    CHAMPION,
    DEFAULT_DATA_DIR,
    EXPERIMENT,
    METADATA_FILE,
    MLFLOW_TRACKING_URI_ENV,
    MODEL_NAME,
    OUTSIDE,
    SHA_TAG,
    redact_url,
    sqlite_tracking_uri,
)
from registry.events import AdapterEvents
from registry.lock import AliasLock, LockUnavailable
from registry.mlflow_store import open_client
from registry.records import (
    RegisteredAdapter,
    ServedChampion,
    audit_tags,
    champions_of,
    domain_aliases,
    event_record,
    event_tag,
    registered_adapter,
    run_figures,
    version_tags,
)

log = logging.getLogger(__name__)

# MLflow's REST client retries 7 times with exponential backoff (minutes) by default; registry calls
# run in background threads that must notice an outage and come back, so they fail within seconds.
# MLflow reads these from the environment on every request and offers no per-client setting, so
# AdapterRegistry sets them when it is built (never at import), and an operator's own values win.
_MLFLOW_CLIENT_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}


class RegistryError(ValueError):
    """A request the registry refuses whatever its state: an unknown version, nothing to roll back to."""


class RegistryUnavailable(RuntimeError):
    """MLflow (or its database) could not be reached; the same call may work later."""


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

    Constructing it contacts nothing (a server may be down, a sqlite store may not exist yet); each
    call does, opening MLflow's client on first use (registry/mlflow_store.py), and raises
    `RegistryUnavailable` when MLflow cannot be reached and `RegistryError` for a bad request.
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        data_dir: Path | str = DEFAULT_DATA_DIR,
        redis_url: str | None = None,
        model_name: str = MODEL_NAME,
        experiment: str = EXPERIMENT,
        signing_key: str | None = None,
    ) -> None:
        for name, value in _MLFLOW_CLIENT_ENV.items():
            os.environ.setdefault(name, value)
        self.data_dir = Path(data_dir)
        self.tracking_uri = tracking_uri or default_tracking_uri(self.data_dir)
        self.local = self.tracking_uri.startswith(("sqlite:", "file:", "/"))
        self.model_name = model_name
        self.experiment = experiment
        self.signing_key = signing_key  # ADAPTIVE_SPEC_SIGNING_KEY: register signs, check_signature checks
        self.events = AdapterEvents(redis_url)
        self.lock = AliasLock(self.tracking_uri, redis_url, model_name)  # one alias move at a time
        self._client = None
        self._client_lock = threading.Lock()
        self._experiment_id: str | None = None
        self._sha_of: dict[str, str] = {}  # version -> adapter_sha256 tag (set when the version is created)

    @property
    def client(self):
        """MLflow's client, opened on first use; a failed opening is tried again on the next call."""
        with self._client_lock:
            if self._client is None:
                self._client = open_client(self.tracking_uri)
            return self._client

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
        sha, domain = metadata.get(SHA_TAG), metadata.get("domain") or None
        _aliases(domain)  # a name no alias can carry is refused before anything is written
        with self._mlflow("register"):
            self._ensure_model(metadata)
            existing = self._versions_with_sha(sha) if sha else []
            if existing:
                version = existing[0]
                log.info("%s is already version %s of %s", adapter_dir, version, self.model_name)
            else:
                if self.signing_key:
                    AdapterDir(adapter_dir).sign(self.signing_key)  # uploaded with the files it covers
                run_id = self._log_run(adapter_dir, metadata)
                source = self.client.get_run(run_id).info.artifact_uri.rstrip("/") + "/" + ARTIFACT_PATH
                created = self.client.create_model_version(
                    self.model_name, source, run_id=run_id, tags=version_tags(metadata, adapter_dir)
                )
                version = str(created.version)
                log.info("registered %s as version %s of %s (run %s)", adapter_dir, version, self.model_name, run_id)
        if promote:
            self.promote(version, by=by, domain=domain)
        return version

    def promote(
        self,
        version: str | int,
        *,
        by: str,
        action: str = "promote",
        domain: str | None = None,
        unless: Callable[[], str | None] | None = None,
    ) -> dict:
        """champion <- version, previous <- the old champion (of `domain`); returns the event it published.

        Under the alias lock (registry/lock.py): `unless()`, when given, is asked first, and a reason it
        returns leaves the aliases alone (the event then says `"changed": false` and `"refused": reason`).
        The aliases are read back after the move: the event's `"aliases"` is what they hold then."""
        version = str(version)
        champion, previous = _aliases(domain)
        with self._mlflow(action), self._moving(action):
            self._get_version(version)
            old = self.aliases().get(champion)
            refused = unless() if unless is not None else None
            if refused is not None or old == version:  # nothing moves, nothing to record
                event = event_record(action, self.model_name, domain, version, old, by, time.time())
                return event | {"changed": False, "refused": refused, "aliases": self._read_back(domain)}
            at = self._audit(version, action, by, champion)  # before the alias moves: a watcher reads them with it
            if old is not None:
                self.client.set_registered_model_alias(self.model_name, previous, old)
            self.client.set_registered_model_alias(self.model_name, champion, version)
            return self._record(action, version, old, by, at, domain)

    def rollback(self, to: str | int | None = None, *, by: str, domain: str | None = None) -> dict:
        """champion <- `to`, or <- previous (and previous removed) when `to` is None (of `domain`); under
        the alias lock, read back like `promote`."""
        if to is not None:
            return self.promote(to, by=by, action="rollback", domain=domain)
        champion, previous = _aliases(domain)
        with self._mlflow("rollback"), self._moving("rollback"):
            aliases = self.aliases()
            target, old = aliases.get(previous), aliases.get(champion)
            if target is None:
                flag = "" if domain is None else f" --domain {domain}"
                raise RegistryError(
                    f"{self.model_name} has no '{previous}' version to roll back to; "
                    f"name one with --to VERSION{flag} (see `adaptive-spec adapters list{flag}`)"
                )
            at = self._audit(target, "rollback", by, champion)
            self.client.set_registered_model_alias(self.model_name, champion, target)
            self.client.delete_registered_model_alias(self.model_name, previous)
            return self._record("rollback", target, old, by, at, domain)

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

    def champion(self, domain: str | None = None) -> str | None:
        """The served version (of `domain`), or None (no registered model, or no such alias)."""
        return self.aliases().get(_aliases(domain)[0])

    def champions(self) -> dict[str | None, str]:
        """Every champion alias by domain: {None: "3", "sql": "5"} for `champion` and `champion-sql`."""
        return champions_of(self.aliases())

    def served(self, domain: str | None = None) -> ServedChampion:
        """The champion (of `domain`), its weights' sha256 and who moved it there: one or two MLflow calls."""
        champion = _aliases(domain)[0]
        with self._mlflow("read champion"):
            try:
                model = self.client.get_registered_model(self.model_name)
            except Exception as exc:
                if _error_code(exc) == "RESOURCE_DOES_NOT_EXIST":
                    return ServedChampion(None, None, None)
                raise
            version = (model.aliases or {}).get(champion)
            version = None if version is None else str(version)
            if version is not None and version not in self._sha_of:
                sha = (self._get_version(version).tags or {}).get(SHA_TAG)
                if sha:
                    self._sha_of[version] = sha
            raw = (model.tags or {}).get(event_tag(domain))
        event = json.loads(raw) if raw else {}
        sha = self._sha_of.get(version) if version is not None else None
        if event.get("version") == version and event.get("domain") == domain:
            return ServedChampion(version, sha, event.get("by"), event.get("from"))
        return ServedChampion(version, sha, OUTSIDE)

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

    def check_signature(self, adapter_dir: Path) -> None:
        """With a signing key: the downloaded (and verified) version is signed with it, else AdapterError
        (reason "signature"). Without one: nothing to check (the servers warn at start)."""
        if self.signing_key:
            AdapterDir(adapter_dir).check_signature(self.signing_key)

    def version_of(self, sha256: str) -> str | None:
        """The oldest version whose adapter_sha256 tag is sha256, or None."""
        with self._mlflow("find version"):
            found = self._versions_with_sha(sha256)
        return found[0] if found else None

    def delete_version(self, version: str | int) -> None:
        """Delete a version and its run (`adaptive-spec purge --registry`); its aliases go with it."""
        with self._mlflow("delete version"), self._moving("delete version"):
            run_id = self._get_version(str(version)).run_id
            self.client.delete_model_version(self.model_name, str(version))
            if run_id:
                self.client.delete_run(run_id)

    def set_version_tag(self, version: str | int, key: str, value: str) -> None:
        with self._mlflow("tag version"):
            self.client.set_model_version_tag(self.model_name, str(version), key, value)

    def last_event(self, domain: str | None = None) -> dict | None:
        """The last promote or rollback of `domain`'s aliases (None: the general adapter's)."""
        with self._mlflow("read event"):
            raw = self.client.get_registered_model(self.model_name).tags.get(event_tag(domain))
        return json.loads(raw) if raw else None

    def close(self) -> None:
        self.events.close()

    # ---------------------------------------------------------------- helpers

    def _mlflow(self, what: str):
        return _Translate(what, self.tracking_uri)

    @contextlib.contextmanager
    def _moving(self, what: str) -> Iterator[None]:
        """The alias lock for one move (registry/lock.py); RegistryUnavailable when it cannot be had."""
        try:
            with self.lock.held(what):
                yield
        except LockUnavailable as exc:
            raise RegistryUnavailable(f"{what}: {exc}") from None

    def _read_back(self, domain: str | None) -> dict[str, str | None]:
        """What the domain's two aliases hold now: {"champion": "4", "previous": None}."""
        aliases = self.aliases()
        return {alias: aliases.get(alias) for alias in _aliases(domain)}

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
                        f"trained online by adaptive-spec. The alias '{CHAMPION}' is served ('{CHAMPION}-<domain>' for a domain)."
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

        run = self.client.create_run(
            self._experiment(), run_name=f"adapter-{adapter_dir.name}", tags=version_tags(metadata, adapter_dir)
        )
        run_id = run.info.run_id
        params, metrics = run_figures(metadata)
        now = int(time.time() * 1000)
        self.client.log_batch(
            run_id,
            metrics=[Metric(k, v, now, 0) for k, v in metrics.items()],
            params=[Param(k, v) for k, v in params.items()],
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
        metrics: dict = {}
        try:
            metrics = self.client.get_run(model_version.run_id).data.metrics if model_version.run_id else {}
        except Exception as exc:  # a deleted run: list the version without its figures
            log.debug("no run for version %s: %s", model_version.version, exc)
        return registered_adapter(model_version, metrics, aliases)

    def _audit(self, version: str, action: str, by: str, alias: str) -> float:
        """Tags on the version saying what was done to it, by whom, when, to which alias; returns when."""
        at = time.time()
        for key, value in audit_tags(action, by, alias, at).items():
            self.client.set_model_version_tag(self.model_name, version, key, value)
        return at

    def _record(self, action: str, version: str, old: str | None, by: str, at: float, domain: str | None) -> dict:
        """The event: as the domain's tag on the registered model, then on pub/sub (best effort). The aliases
        are read back first: anything but what this move wrote was written by a hand outside the lock."""
        after = self._read_back(domain)
        tags = self.client.get_registered_model(self.model_name).tags
        pair = {"target_id": tags.get("target_id"), "draft_id": tags.get("draft_id")}
        event = {
            **event_record(action, self.model_name, domain, version, old, by, at),
            "changed": True,
            "aliases": after,
            **pair,
        }
        self.client.set_registered_model_tag(self.model_name, event_tag(domain), json.dumps(event))
        champion = _aliases(domain)[0]
        log.info("%s: %s %s %s -> %s by %s", self.model_name, action, champion, old, version, by)
        if after[champion] != version:
            log.warning(
                "%s: %s now names %s, not %s: moved meanwhile outside adaptive-spec",
                self.model_name,
                champion,
                after[champion],
                version,
            )
        self.events.publish(event)  # best effort: watchers also poll the aliases
        return event


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


def _aliases(domain: str | None) -> tuple[str, str]:
    """(champion, previous) alias of `domain`; a name no alias can carry is a RegistryError."""
    try:
        return domain_aliases(domain)
    except ValueError as exc:
        raise RegistryError(str(exc)) from None
