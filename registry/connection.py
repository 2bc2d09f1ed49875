"""The registry's connection to MLflow: its two errors, the client opened on first use with MLflow's HTTP
retries cut to seconds, and MLflow's exceptions translated into those errors. `RegistryConnection` is the
base that `AdapterRegistry` (registry/client.py) and its alias moves (registry/aliases.py) build on."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from adaptive_spec.contracts import (
    DEFAULT_DATA_DIR,
    EXPERIMENT,
    MLFLOW_TRACKING_URI_ENV,
    MODEL_NAME,
    redact_url,
    sqlite_tracking_uri,
)
from registry.events import AdapterEvents
from registry.lock import AliasLock
from registry.mlflow_store import open_client

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


class RegistryConnection:
    """One target/draft pair's registered model in MLflow: where it is, its client, its alias lock and events."""

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

    def close(self) -> None:
        self.events.close()

    def _mlflow(self, what: str):
        return _Translate(what, self.tracking_uri)

    def _get_version(self, version: str):
        try:
            return self.client.get_model_version(self.model_name, version)
        except Exception as exc:
            if mlflow_error_code(exc) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                raise RegistryError(f"{self.model_name} has no version {version!r}") from None
            raise


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
        code = mlflow_error_code(exc)
        if code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "BAD_REQUEST"):
            raise RegistryError(f"{self.what}: {exc}") from exc
        raise RegistryUnavailable(
            f"{self.what}: MLflow at {redact_url(self.uri)} is unavailable: {type(exc).__name__}: {str(exc)[:300]}"
        ) from exc


def mlflow_error_code(exc: BaseException) -> str | None:
    return getattr(exc, "error_code", None)
