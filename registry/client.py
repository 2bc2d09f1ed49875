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

Promotion, rollback, the alias lock and the audit trail: registry/aliases.py. MLflow's client and errors:
registry/connection.py.

The trainer's promotions reach `register` through a queue that outlives MLflow outages
(trainer/promotion/pending.py); the trainer reads the champion back through trainer/promotion/champion.py."""

from __future__ import annotations

import getpass
import logging
import socket
import time
from pathlib import Path

from adaptive_spec.contracts import ARTIFACT_PATH, CHAMPION, METADATA_FILE, SHA_TAG
from adaptive_spec.formats.adapter_metadata import AdapterMetadata
from adaptive_spec.formats.adapters import AdapterDir, AdapterError
from registry.aliases import RegistryAliases, alias_pair
from registry.connection import RegistryError, RegistryUnavailable, mlflow_error_code
from registry.records import RegisteredAdapter, ServedChampion, registered_adapter, run_figures, version_tags

__all__ = [
    "AdapterRegistry",
    "RegistryError",
    "RegistryUnavailable",
    "ServedChampion",
    "actor",
]

log = logging.getLogger(__name__)


def actor(kind: str) -> str:
    """Who does it, for the audit trail: e.g. actor("cli") -> "cli:alice@host"."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{kind}:{user}@{socket.gethostname()}"


class AdapterRegistry(RegistryAliases):
    """Registered versions and aliases of one target/draft pair's adapters.

    Constructing it contacts nothing (a server may be down, a sqlite store may not exist yet); each
    call does, opening MLflow's client on first use (registry/mlflow_store.py), and raises
    `RegistryUnavailable` when MLflow cannot be reached and `RegistryError` for a bad request.
    """

    # ---------------------------------------------------------------- writing

    def register(self, adapter_dir: Path | str, *, by: str = "trainer", promote: bool = True) -> str:
        """Log the adapter directory as a run, make it a version, and (by default) promote it."""
        adapter_dir = Path(adapter_dir)
        try:
            metadata = AdapterDir(adapter_dir).metadata()
        except AdapterError as exc:
            raise RegistryError(str(exc)) from None
        if metadata.empty:
            raise RegistryError(f"{adapter_dir}: no {METADATA_FILE}; not an adapter the trainer wrote")
        sha, domain = metadata.adapter_sha256, metadata.domain or None
        alias_pair(domain)  # a name no alias can carry is refused before anything is written
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

    # ---------------------------------------------------------------- reading

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

    # ---------------------------------------------------------------- helpers

    def _ensure_model(self, metadata: AdapterMetadata) -> None:
        pair = {"target_id": str(metadata.target_id), "draft_id": str(metadata.draft_id)}
        try:
            model = self.client.get_registered_model(self.model_name)
        except Exception as exc:
            if mlflow_error_code(exc) != "RESOURCE_DOES_NOT_EXIST":
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
                if mlflow_error_code(exc) != "RESOURCE_ALREADY_EXISTS":
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
                    if mlflow_error_code(exc) != "RESOURCE_ALREADY_EXISTS":
                        raise
                    self._experiment_id = self.client.get_experiment_by_name(self.experiment).experiment_id
        return self._experiment_id

    def _log_run(self, adapter_dir: Path, metadata: AdapterMetadata) -> str:
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

    def _describe(self, model_version, aliases: dict[str, str]) -> RegisteredAdapter:
        metrics: dict = {}
        try:
            metrics = self.client.get_run(model_version.run_id).data.metrics if model_version.run_id else {}
        except Exception as exc:  # a deleted run: list the version without its figures
            log.debug("no run for version %s: %s", model_version.version, exc)
        return registered_adapter(model_version, metrics, aliases)
