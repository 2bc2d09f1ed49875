"""The adapter watcher: the server follows the registry's champion aliases, `champion` for the general
adapter and `champion-<domain>` for each domain's, and hot-swaps the draft's adapters between decoding steps.

    registry = open_registry(settings)           # MLFLOW_TRACKING_URI, else <data-dir>/mlflow.db if there
    watcher = AdapterWatcher(engine, registry, data_dir / "adapter-cache", poll_s=5.0,
                             events=registry.events, metrics=metrics, on_swap=record_swap).start()
    watcher.check()        # one pass, in the caller's thread: "unchanged", "swapped", "unloaded", "refused", ...

`Service.start` builds both (`start_watcher`); the watcher gets only what it uses: the engine, the
registry with its adapter-events channel (registry/events.py), the metrics and a callback
that records each swap on the dashboard.

Tests (tiny engine, real MLflow and Redis, about 40 s): `.venv/bin/python -m pytest tests/service/test_watcher.py -q`.

`start_watcher` returns once the first check is done (or after 30 s, `FIRST_CHECK_S`, if the registry
does not answer), and `Service.start` calls it before the server reports ready: a replica started
or restarted into a fleet serves the champions from its first request.

Two signals wake it (DESIGN.md "Swap"):

- an event on the Redis pub/sub channel `adaptive_spec:adapters` (sent by the registry on every
  promote and rollback): the check runs at once, and the event says what kind of change it was
  and who made it;
- a poll of the aliases every `poll_s` (5 s by default), so an alias moved by hand in the MLflow UI
  is followed within `poll_s` plus a download, and a lost event costs one poll at most.

One check reads every champion alias at once (`registry.champions()`, one MLflow call) and compares
each with the engine's slots (`engine.adapters.versions()`, adaptive_spec/drafters/slots.py): the
general adapter first, then the domains whose alias is gone (unloaded from their slot, so their
requests draft with the general adapter again), then the others by name. At most
`engine.adapters.max_domains` domains are followed (the first by name; a warning names the rest),
so the watcher never makes the slots evict one it would load back at the next poll. `check()`
returns the general adapter's outcome when it is not "unchanged", else the first domain's that is
not, else "unchanged"; "unavailable" when MLflow could not be read.

A change of a champion alias to version V, in order; any failure before step 4 refuses V for that
domain and nothing changes (the served adapter stays; the refusal is logged and counted in
`adaptive_spec:adapter_refusals_total{reason}`):

1. V must be for this engine: its `target_id` and `draft_id` tags equal the engine's (reason
   "incompatible");
2. download V's artifacts into `cache_dir/vV-<sha>` (reason "missing" when the registry has no
   files for it);
3. verify: the weights hash to V's `adapter_sha256` tag and to `checksum.sha256` (reason
   "checksum"); with ADAPTIVE_SPEC_SIGNING_KEY, V carries the trainer's signature made with that key
   (reason "signature": unsigned, forged, or changed after signing);
4. `Engine.load_adapter`: LoRA shapes against the draft's modules (rank, target modules), merged into
   a new slot, then swapped under the step lock and the old slot dropped (reason "incompatible"
   or "corrupt" when it refuses).

A refused version is not tried again until its alias moves elsewhere and back (`refused` holds
(domain, version) -> reason). The champion alias removed (or the registered model gone) unloads to
the base draft; a domain's alias removed unloads that domain's slot. MLflow unreachable: the served
adapters stay and the watcher retries at the next poll (`adaptive_spec:adapter_registry_errors_total`).

After each swap the cache of downloaded versions is pruned to those the engine holds plus the
`keep_versions` (ADAPTIVE_SPEC_KEEP_VERSIONS, 20) most recent (`prune_cache`).

Each swap is counted (`adaptive_spec:adapter_swaps_total{kind}`, every domain alike), its pause (how
long decoding was held) is the gauge `adaptive_spec:adapter_swap_pause_seconds`, and
`on_swap(kind, version, by, path, domain=None)` is called once, after the swap (`Service.record_swap`
marks it on the dashboard), kind "rollback" when the registry's event for that domain says so (or,
for an alias moved in the MLflow UI, when the version number went down), else "swap"; `by` is the
event's, or "mlflow-alias".
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

from adaptive_spec.contracts import (
    ADAPTER_CACHE_DIR,
    MLFLOW_DB,
    OUTSIDE,
    SHA_TAG,
    cache_dir_name,
    sqlite_tracking_uri,
)
from adaptive_spec.formats.adapters import AdapterDir, AdapterError, check_models
from registry.client import AdapterRegistry, RegistryError, RegistryUnavailable
from registry.events import AdapterEvents

log = logging.getLogger(__name__)

RECENT_ACTION_S = 120.0  # a registry event this fresh names the change the watcher sees
FIRST_CHECK_S = 30.0  # how long a starting server waits for its champions before it serves without them


class Swap(NamedTuple):
    kind: str  # "swap" or "rollback"
    version: str | None  # None: unloaded (the base draft, or for a domain the general adapter)
    pause_s: float  # how long decoding was held
    domain: str | None = None  # None: the general adapter


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
        keep_versions: int = 20,
    ) -> None:
        self.engine = engine
        self.keep_versions = keep_versions  # downloaded versions kept besides those served (prune_cache)
        self.registry = registry
        self.cache_dir = Path(cache_dir)
        self.poll_s = poll_s
        self.events = events  # the registry's pub/sub channel; None: the alias poll alone
        self.metrics = metrics
        self.on_swap = on_swap
        self.swaps: list[Swap] = []  # for reports and tests
        self.refused: dict[tuple[str | None, str], str] = {}  # (domain, version) -> reason, until the alias moves
        self._events: dict[tuple[str | None, str | None], dict] = {}  # (domain, version) -> the last event naming it
        self._skipped: list[str] = []  # domains with an alias beyond the engine's slots
        self._check_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._unavailable = False
        self.first_check = threading.Event()  # set once the first check has returned, whatever its outcome

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
            "watching %r for the champion adapters every %.1f s%s",
            self.registry,
            self.poll_s,
            " and on " + self.events.channel if self.events else "",
        )
        return self

    @property
    def alive(self) -> bool:
        """The poll loop runs (True before start()). A dead one follows no promotion and no rollback, so
        `GET /health` answers 503 (service/routers/ops.py); the pub/sub listener's death costs a poll at most."""
        return not self._threads or self._threads[0].is_alive() or self._stop.is_set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout)

    def wake(self, event: dict | None = None) -> None:
        """Check now (e.g. after a promote through the admin API); `event` says what changed and who did it."""
        if event is not None:
            version = None if event.get("version") is None else str(event["version"])
            self._events[(event.get("domain"), version)] = event
        self._wake.set()

    # ---------------------------------------------------------------- one check

    def check(self) -> str:
        """Follow every champion alias once; returns what happened (the module docstring says which)."""
        with self._check_lock:
            try:
                champions = self._followed(self.registry.champions())
            except RegistryUnavailable as exc:
                return self._registry_down(exc)
            if self._unavailable:
                log.info("the adapter registry is back")
                self._unavailable = False
            served = self.engine.adapters.versions()
            # an alias that moved on forgets its refusal: a later return is a new decision
            self.refused = {key: why for key, why in self.refused.items() if champions.get(key[0]) == key[1]}
            gone = sorted(d for d in served if d is not None and d not in champions)
            rest = sorted(d for d in champions if d is not None)
            outcomes = []
            for domain in [None, *gone, *rest]:
                outcome = self._follow(domain, champions.get(domain), served.get(domain))
                if outcome == "unavailable":
                    return outcome
                outcomes.append(outcome)
            return next((outcome for outcome in outcomes if outcome != "unchanged"), "unchanged")

    def _follow(self, domain: str | None, champion: str | None, served: str | None) -> str:
        """Bring one slot (the general adapter's, or a domain's) to its champion alias."""
        if champion == served or (domain, champion) in self.refused:
            return "unchanged" if champion == served else "refused"
        if champion is None:
            kind, by = self._describe_change(domain, None, served)
            self._swapped(Swap(kind, None, self.engine.unload_adapter(domain), domain), by, None)
            return "unloaded"
        try:
            path = self._fetch(champion)
            pause = self.engine.load_adapter(path, champion, domain=domain)
        except RegistryUnavailable as exc:
            return self._registry_down(exc)
        except RegistryError as exc:
            self._refuse(domain, champion, AdapterError(f"version {champion}: {exc}", "missing"))
            return "refused"
        except AdapterError as exc:
            self._refuse(domain, champion, exc)
            return "refused"
        kind, by = self._describe_change(domain, champion, served)
        self._swapped(Swap(kind, champion, pause, domain), by, path)
        return "swapped"

    def _followed(self, champions: dict[str | None, str]) -> dict[str | None, str]:
        """The champions this engine can hold: the general one and the first `max_domains` domains by name."""
        domains = sorted(d for d in champions if d is not None)
        room = self.engine.adapters.max_domains
        if domains[room:] != self._skipped:
            self._skipped = domains[room:]
            if self._skipped:
                log.warning(
                    "the engine holds %d domain adapters: not serving those of %s (raise ADAPTIVE_SPEC_MAX_ADAPTERS)",
                    room,
                    ", ".join(self._skipped),
                )
        return {d: v for d, v in champions.items() if d is None or d in domains[:room]}

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
            self.registry.check_signature(final)  # with ADAPTIVE_SPEC_SIGNING_KEY: the trainer's signature
        except AdapterError:
            shutil.rmtree(final, ignore_errors=True)  # never reuse bad files; a fixed artifact downloads again
            raise
        return final

    # ---------------------------------------------------------------- outcomes

    def _swapped(self, swap: Swap, by: str | None, path: Path | None) -> None:
        self.swaps.append(swap)
        self.prune_cache()
        log.info(
            "%s adapter %s -> %s (by %s): decoding held %.2f ms",
            _label(swap.domain),
            swap.kind,
            _served_name(swap.domain, swap.version),
            by,
            swap.pause_s * 1000,
        )
        if self.metrics is not None:
            self.metrics.adapter_swaps.labels(swap.kind).inc()
            self.metrics.adapter_swap_pause.set(swap.pause_s)
        if self.on_swap is not None:
            try:
                self.on_swap(swap.kind, swap.version, by, path, domain=swap.domain)
            except Exception:  # a dashboard marker must never undo or block a swap
                log.exception("on_swap failed after the swap to %s", swap.version)

    def prune_cache(self) -> list[str]:
        """Delete downloaded versions but those the engine holds and the `keep_versions` most recent; returns
        the names deleted. They hold n-gram indexes and vocabularies of user traffic: kept no longer than used."""
        held = {version for version in self.engine.adapters.versions().values() if version is not None}
        cached = sorted(
            (path for path in self.cache_dir.glob("v*-*") if path.is_dir()), key=lambda p: p.stat().st_mtime
        )
        old = cached[: -self.keep_versions] if self.keep_versions else cached
        deleted = [path.name for path in old if path.name.split("-", 1)[0][1:] not in held]
        for name in deleted:
            shutil.rmtree(self.cache_dir / name, ignore_errors=True)
        return deleted

    def _refuse(self, domain: str | None, version: str, refusal: AdapterError) -> None:
        self.refused[(domain, version)] = refusal.reason
        log.error(
            "refused adapter version %s for the %s adapter (%s): %s; still serving %s",
            version,
            _label(domain),
            refusal.reason,
            refusal,
            _served_name(domain, self.engine.adapters.versions().get(domain)),
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

    def _describe_change(self, domain: str | None, version: str | None, served: str | None) -> tuple[str, str | None]:
        """(kind, by): from a fresh event naming this domain and version (pub/sub, else the registry's
        last event for the domain); with none, the alias was moved outside adaptive-spec (the MLflow
        UI): a rollback when the version number went down."""
        event = self._events.pop((domain, version), None)
        if event is None:  # no pub/sub (or it lost the race): the registry's own record of its last action
            try:
                event = self.registry.last_event(domain)
            except Exception as exc:
                log.debug("no last event (%s)", exc)
        if (
            event is not None
            and event.get("version") == version
            and event.get("domain") == domain
            and time.time() - (_float(event.get("at")) or 0.0) < RECENT_ACTION_S
        ):
            return ("rollback" if event.get("event") == "rollback" else "swap"), event.get("by")
        went_down = (version is None and served is not None) or (
            version is not None
            and served is not None
            and version.isdigit()
            and served.isdigit()
            and int(version) < int(served)
        )
        return ("rollback" if went_down else "swap"), OUTSIDE

    # ---------------------------------------------------------------- threads

    def _poll_loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self.check()
                except Exception:  # keep watching whatever one check did
                    log.exception("adapter check failed")
                self.first_check.set()
                self._wake.wait(self.poll_s)
                self._wake.clear()
        except BaseException:  # what a check cannot catch ends the thread: say so, /health reports it
            log.critical("the adapter watcher died: this server follows no promotion or rollback", exc_info=True)
            self.first_check.set()


def open_registry(settings) -> AdapterRegistry | None:
    """The adapter registry the settings name, or None: `mlflow_tracking_uri` (MLFLOW_TRACKING_URI)
    when set, else the trainer's default `mlflow.db` when the data directory already holds one."""
    uri = settings.mlflow_tracking_uri
    if uri is None and (Path(settings.data_dir) / MLFLOW_DB).is_file():
        uri = sqlite_tracking_uri(settings.data_dir)
    if uri is None:
        return None
    return AdapterRegistry(
        uri, data_dir=settings.data_dir, redis_url=settings.redis_url, signing_key=settings.signing_key
    )


def start_watcher(
    engine,
    registry: AdapterRegistry | None,
    settings,
    *,
    metrics=None,
    on_swap=None,
    first_check_s: float = FIRST_CHECK_S,
) -> AdapterWatcher | None:
    """A started watcher that keeps `engine` on the registry's champions; None when there is nothing to
    watch: no registry, a draft that takes no adapters, or `adapter_poll_s` = 0 (the admin API still
    reaches the registry).

    It returns once the first check is done (the champions loaded), or after `first_check_s`: a server
    becomes ready on the fleet's champions, not on the base draft for its first seconds, and a
    registry that does not answer delays its start by that much at most (the check goes on behind)."""
    if registry is None or settings.adapter_poll_s <= 0:
        return None
    if engine.drafter is None or not engine.drafter.takes_adapters:
        log.warning("draft %s takes no adapters: not watching the registry", engine.draft_id)
        return None
    watcher = AdapterWatcher(
        engine,
        registry,
        Path(settings.data_dir) / ADAPTER_CACHE_DIR,
        poll_s=settings.adapter_poll_s,
        events=registry.events,
        metrics=metrics,
        on_swap=on_swap,
        keep_versions=settings.keep_versions,
    ).start()
    if not watcher.first_check.wait(first_check_s):
        log.warning(
            "the adapter registry did not answer in %.0f s: serving %s until it does",
            first_check_s,
            engine.adapter_version or "the base draft",
        )
    return watcher


def _label(domain: str | None) -> str:
    return "general" if domain is None else repr(domain)


def _served_name(domain: str | None, version: str | None) -> str:
    """What a slot serves: version 3, or without a version the base draft (general) or the general adapter."""
    if version is not None:
        return f"version {version}"
    return "the base draft" if domain is None else "the general adapter"


def _float(text) -> float | None:
    try:
        return float(text)
    except (TypeError, ValueError):
        return None
