"""The adapter watcher: the server follows the registry's `champion` alias and hot-swaps the draft's
adapter between decoding steps.

    registry = open_registry(settings)           # MLFLOW_TRACKING_URI, else <data-dir>/mlflow.db if there
    watcher = AdapterWatcher(engine, registry, data_dir / "adapter-cache", poll_s=5.0,
                             events=registry.events, metrics=metrics, on_swap=record_swap).start()
    watcher.check()        # one pass, in the caller's thread: "unchanged", "swapped", "unloaded", "refused", ...

`Service.start` builds both (`start_watcher`); the watcher gets only what it uses: the engine, the
registry with its adapter-events channel (trainer/adapter_events.py), the metrics and a callback
that records each swap on the dashboard.

Tests (tiny engine, real MLflow and Redis, about 40 s): `.venv/bin/python -m pytest tests/service/test_watcher.py -q`.

Two signals wake it (DESIGN.md "Swap"):

- an event on the Redis pub/sub channel `adaptive_spec:adapters` (sent by the registry on every
  promote and rollback): the check runs at once, and the event says what kind of change it was
  and who made it;
- a poll of the alias every `poll_s` (5 s by default), so an alias moved by hand in the MLflow UI
  is followed within `poll_s` plus a download, and a lost event costs one poll at most.

A change of champion to version V, in order; any failure before step 4 refuses V and nothing
changes (the served adapter stays; the refusal is logged and counted in
`adaptive_spec:adapter_refusals_total{reason}`):

1. V must be for this engine: its `target_id` and `draft_id` tags equal the engine's (reason
   "incompatible");
2. download V's artifacts into `cache_dir/vV-<sha>` (reason "missing" when the registry has no
   files for it);
3. verify: the weights hash to V's `adapter_sha256` tag and to `checksum.sha256` (reason
   "checksum");
4. `Engine.load_adapter`: LoRA shapes against the draft's modules (rank, target modules), merged into
   a new slot, then swapped under the step lock and the old slot dropped (reason "incompatible"
   or "corrupt" when it refuses).

A refused version is not tried again until the alias moves elsewhere and back. The champion alias
removed (or the registered model gone) unloads to the base draft. MLflow unreachable: the served
adapter stays and the watcher retries at the next poll (`adaptive_spec:adapter_registry_errors_total`).

Each swap is counted (`adaptive_spec:adapter_swaps_total{kind}`), its pause (how long decoding was
held) is the gauge `adaptive_spec:adapter_swap_pause_seconds`, and `on_swap(kind, version, by, path)` is
called once, after the swap (`Service.record_swap` marks it on the dashboard), kind "rollback" when the registry's
event says so (or, for an alias moved in the MLflow UI, when the version number went down), else
"swap"; `by` is the event's, or "mlflow-alias".
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path

from adaptive_spec.adapters import AdapterDir, AdapterError, check_models
from adaptive_spec.contracts import (
    ADAPTER_CACHE_DIR,
    MLFLOW_DB,
    OUTSIDE,
    SHA_TAG,
    cache_dir_name,
    sqlite_tracking_uri,
)
from trainer.adapter_events import AdapterEvents
from trainer.registry import AdapterRegistry, RegistryError, RegistryUnavailable

log = logging.getLogger(__name__)

RECENT_ACTION_S = 120.0  # a version's audit tag this fresh names the change the watcher sees


class AdapterWatcher:
    def __init__(
        self,
        engine,
        registry,
        cache_dir: Path,
        *,
        poll_s: float = 5.0,
        events: AdapterEvents | None = None,
        metrics=None,
        on_swap=None,
    ) -> None:
        self.engine = engine
        self.registry = registry
        self.cache_dir = Path(cache_dir)
        self.poll_s = poll_s
        self.events = events  # the registry's pub/sub channel; None: the alias poll alone
        self.metrics = metrics
        self.on_swap = on_swap
        self.swaps: list[tuple[str, str | None, float]] = []  # (kind, version, pause_s), for reports and tests
        self.refused: dict[str, str] = {}  # version -> reason, until the alias moves elsewhere
        self._events: dict[str | None, dict] = {}  # version -> the last pub/sub event naming it
        self._check_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._unavailable = False

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> AdapterWatcher:
        self._threads = [threading.Thread(target=self._poll_loop, name="adapter-watcher", daemon=True)]
        if self.events:
            self._threads.append(
                threading.Thread(
                    target=self.events.listen, args=(self.wake, self._stop), name="adapter-events", daemon=True
                )
            )
        for thread in self._threads:
            thread.start()
        log.info(
            "watching %r for the champion adapter every %.1f s%s",
            self.registry,
            self.poll_s,
            " and on " + self.events.channel if self.events else "",
        )
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout)

    def wake(self, event: dict | None = None) -> None:
        """Check now (e.g. after a promote through the admin API); `event` says what changed and who did it."""
        if event is not None:
            self._events[None if event.get("version") is None else str(event["version"])] = event
        self._wake.set()

    # ---------------------------------------------------------------- one check

    def check(self) -> str:
        """Follow the champion alias once; returns what happened."""
        with self._check_lock:
            try:
                champion = self.registry.champion()
            except RegistryUnavailable as exc:
                return self._registry_down(exc)
            if self._unavailable:
                log.info("the adapter registry is back")
                self._unavailable = False
            served = self.engine.adapter_version
            for version in [v for v in self.refused if v != champion]:
                del self.refused[version]  # the alias moved on: a later return is a new decision
            if champion == served or champion in self.refused:
                return "unchanged" if champion == served else "refused"
            if champion is None:
                kind, by = self._describe_change(None, served)
                self._swapped(kind, None, by, self.engine.unload_adapter(), None)
                return "unloaded"
            try:
                path = self._fetch(champion)
                pause = self.engine.load_adapter(path, champion)
            except RegistryUnavailable as exc:
                return self._registry_down(exc)
            except RegistryError as exc:
                self._refuse(champion, AdapterError(f"version {champion}: {exc}", "missing"))
                return "refused"
            except AdapterError as exc:
                self._refuse(champion, exc)
                return "refused"
            kind, by = self._describe_change(champion, served)
            self._swapped(kind, champion, by, pause, path)
            return "swapped"

    def _fetch(self, version: str) -> Path:
        """Download the version (or reuse the cache) and verify it; returns its directory."""
        described = self.registry.get(version)
        check_models(described.tags, self.engine.target_id, self.engine.draft_id, f"version {version}")
        sha = described.sha256
        if not sha:
            raise AdapterError(f"version {version} has no {SHA_TAG} tag: nothing to verify it against", "missing")
        final = self.cache_dir / cache_dir_name(version, sha)
        if not final.is_dir():
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".download-", dir=self.cache_dir))
            try:
                downloaded = self.registry.download(version, staging)
                downloaded.rename(final)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        try:
            adapter = AdapterDir(final)
            adapter.verify(expected_sha256=sha)
            adapter.check_models(self.engine.target_id, self.engine.draft_id)
        except AdapterError:
            shutil.rmtree(final, ignore_errors=True)  # never reuse bad files; a fixed artifact downloads again
            raise
        return final

    # ---------------------------------------------------------------- outcomes

    def _swapped(self, kind: str, version: str | None, by: str | None, pause: float, path: Path | None) -> None:
        self.swaps.append((kind, version, pause))
        log.info(
            "adapter %s -> %s (%s by %s): decoding held %.2f ms", kind, version or "base draft", kind, by, pause * 1000
        )
        if self.metrics is not None:
            self.metrics.adapter_swaps.labels(kind).inc()
            self.metrics.adapter_swap_pause.set(pause)
        if self.on_swap is not None:
            try:
                self.on_swap(kind, version, by, path)
            except Exception:  # a dashboard marker must never undo or block a swap
                log.exception("on_swap failed after the swap to %s", version)

    def _refuse(self, version: str, refusal: AdapterError) -> None:
        self.refused[version] = refusal.reason
        log.error(
            "refused adapter version %s (%s): %s; still serving %s",
            version,
            refusal.reason,
            refusal,
            self.engine.adapter_version or "the base draft",
        )
        if self.metrics is not None:
            self.metrics.adapter_refusals.labels(refusal.reason).inc()

    def _registry_down(self, exc: Exception) -> str:
        if not self._unavailable:
            log.warning(
                "adapter registry unavailable (%s); serving %s and retrying every %.1f s",
                exc,
                self.engine.adapter_version or "the base draft",
                self.poll_s,
            )
        self._unavailable = True
        if self.metrics is not None:
            self.metrics.adapter_registry_errors.inc()
        return "unavailable"

    def _describe_change(self, version: str | None, served: str | None) -> tuple[str, str | None]:
        """(kind, by): from a fresh event naming this version (pub/sub, else the registry's last event);
        with none, the alias was moved outside adaptive-spec (the MLflow UI): a rollback when the
        version number went down."""
        event = self._events.pop(version, None)
        if event is None:  # no pub/sub (or it lost the race): the registry's own record of its last action
            try:
                event = self.registry.last_event()
            except Exception as exc:
                log.debug("no last event (%s)", exc)
        if (
            event is not None
            and event.get("version") == version
            and time.time() - (_float(event.get("at")) or 0.0) < RECENT_ACTION_S
        ):
            return ("rollback" if event.get("event") == "rollback" else "swap"), event.get("by")
        went_down = (version is None and served is not None) or (
            version is not None and served is not None and version.isdigit() and served.isdigit()
            and int(version) < int(served))  # fmt: skip
        return ("rollback" if went_down else "swap"), OUTSIDE

    # ---------------------------------------------------------------- threads

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:  # keep watching whatever one check did
                log.exception("adapter check failed")
            self._wake.wait(self.poll_s)
            self._wake.clear()


def open_registry(settings) -> AdapterRegistry | None:
    """The adapter registry the settings name, or None: `mlflow_tracking_uri` (MLFLOW_TRACKING_URI)
    when set, else the trainer's default `mlflow.db` when the data directory already holds one."""
    uri = settings.mlflow_tracking_uri
    if uri is None and (Path(settings.data_dir) / MLFLOW_DB).is_file():
        uri = sqlite_tracking_uri(settings.data_dir)
    if uri is None:
        return None
    return AdapterRegistry(uri, data_dir=settings.data_dir, redis_url=settings.redis_url)


def start_watcher(
    engine, registry: AdapterRegistry | None, settings, *, metrics=None, on_swap=None
) -> AdapterWatcher | None:
    """A started watcher that keeps `engine` on the registry's champion; None when there is nothing to
    watch: no registry, a draft that takes no adapters, or `adapter_poll_s` = 0 (the admin API still
    reaches the registry)."""
    if registry is None or settings.adapter_poll_s <= 0:
        return None
    if not hasattr(engine.drafter, "build_weights"):
        log.warning("draft %s takes no adapters: not watching the registry", engine.draft_id)
        return None
    return AdapterWatcher(
        engine,
        registry,
        Path(settings.data_dir) / ADAPTER_CACHE_DIR,
        poll_s=settings.adapter_poll_s,
        events=registry.events,
        metrics=metrics,
        on_swap=on_swap,
    ).start()


def _float(text) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None
