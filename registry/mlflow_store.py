"""An MlflowClient whose sqlite store any number of processes may open at the same moment.

    client = open_client("sqlite:////srv/adaptive-spec/mlflow.db")  # creates the file, once, if missing

MLflow creates (or migrates) a sqlite store's tables when a process first opens it, with no guard
against another process doing the same: two servers started together on a new file both ran
`CREATE TABLE`, and the slower one died on "table datasets already exists" (in a loop of
three processes started at once, 12 of 15 failed). Here the opening holds an exclusive lock on a
file beside the database (`mlflow.db.lock`), so the first process creates the tables and the others
find them made. Both of MLflow's stores (runs and the model registry) are opened under the lock.

An `mlflow server` serialises its own schema work; other URIs are opened without a lock.
Tests: `.venv/bin/python -m pytest tests/reliability/test_shared_store.py -q`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

SQLITE = "sqlite:///"


def open_client(tracking_uri: str):
    """An MlflowClient on `tracking_uri` for runs and the registry, its sqlite store ready to use."""
    from mlflow import MlflowClient

    database = sqlite_path(tracking_uri)
    if database is None:
        return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    database.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(database.with_name(database.name + ".lock")):
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)  # the runs' store
        client.search_registered_models(max_results=1)  # opens the registry's store too
    return client


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a sqlite tracking URI, or None for any other (an in-memory sqlite too)."""
    if not tracking_uri.startswith(SQLITE):
        return None
    path = tracking_uri.removeprefix(SQLITE).split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Held by one process at a time on this machine; released when the process dies, however."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, MLflow's own behaviour
        yield
        return
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
