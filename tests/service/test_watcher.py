"""The adapter watcher: servers follow the registry's champion alias (real MLflow, real Redis, tiny models).

Run: .venv/bin/python -m pytest tests/service/test_watcher.py -q   (about 40 s; the mlflow server ~15 s of it)

What must hold:

- a promotion in the registry is followed by a swap in a running server, through the pub/sub event
  (the alias poll is set to a minute, so only the event explains a quick swap); the served version
  shows in the response usage and the metrics, and requests during the swaps all succeed, greedy-equal
  to the target alone;
- an alias moved by hand with MlflowClient, as the MLflow UI does, is followed within 10 s, on a
  `mlflow server`, and is reported as a rollback by "mlflow-alias";
- a corrupt, incompatible or missing artifact, or one with a NaN weight whose checksum is right, is
  refused before any swap: the served adapter stays, the refusal is logged and counted once per reason;
  a good version afterwards is served;
- greedy output is token-for-token the target's when swaps land between the steps of a generation;
- the champion alias removed unloads to the base draft; each swap calls the dashboard's stats.mark;
- each domain's alias (`champion-sql`) is followed into the engine's slot for that domain, from the one
  `champions()` read of each check: loaded, swapped, refused and unloaded (its alias deleted) on its own,
  the general adapter untouched; a request tagged sql drafts with it, still lossless; domains beyond the
  engine's slots are not loaded.
"""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest
from mlflow import MlflowClient
from polling import wait_for
from registry_support import write_adapter
from safetensors.torch import load_file, save_file
from tiny import tiny_target

from adaptive_spec import Engine
from adaptive_spec.contracts import ADAPTER_EVENTS, MODEL_NAME
from adaptive_spec.formats.adapters import WEIGHTS_FILE, AdapterDir
from registry.client import AdapterRegistry
from service.settings import Settings
from service.watcher import AdapterWatcher, start_watcher

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]

PROMPT = [5, 17, 33, 8, 5, 17, 33, 8, 5, 17]


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, target) -> dict[str, Path]:
    """Good adapters for early-exit:1 (seeds 1..3), one for early-exit:2, and one for early-exit:2 whose
    metadata claims early-exit:1 (only the shape check can catch it)."""
    root = tmp_path_factory.mktemp("adapters")
    made = {f"good{i}": write_adapter(target, 1, root / f"good{i}", seed=i, version=i) for i in (1, 2, 3)}
    made["other_draft"] = write_adapter(target, 2, root / "other_draft", seed=7)
    made["bad_shape"] = write_adapter(target, 2, root / "bad_shape", seed=8, draft_id="early-exit:1")
    made["corrupt"] = write_adapter(target, 1, root / "corrupt", seed=9)
    made["missing"] = write_adapter(target, 1, root / "missing", seed=10)
    made["nan"] = write_adapter(target, 1, root / "nan", seed=11)  # sealed again after a NaN went in
    weights = load_file(made["nan"] / WEIGHTS_FILE)
    next(iter(weights.values()))[0, 0] = float("nan")
    save_file(weights, made["nan"] / WEIGHTS_FILE)
    AdapterDir(made["nan"]).seal()
    return made


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def registry(store, tmp_path, redis_url) -> AdapterRegistry:
    """The default registered model on the module's sqlite store, emptied for each test."""
    registry = AdapterRegistry(store, data_dir=tmp_path, redis_url=redis_url)
    if registry.aliases() or registry.versions():
        registry.client.delete_registered_model(MODEL_NAME)
    return registry


def engine_for(target) -> Engine:
    return Engine(target, "early-exit:1", k=3, record_topk=8, eos_token_id=[])


def metric(server, name: str, **labels) -> float:
    total = 0.0
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def complete(server, max_tokens: int = 24) -> dict:
    response = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        json={"model": "target", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_a_promotion_is_followed_by_a_swap_in_a_running_server(
    live_server, target, adapters, registry, store, redis_url, tmp_path
):
    engine = engine_for(target)
    expected = engine.generate(PROMPT, max_new_tokens=24, speculative=False).token_ids
    with live_server(
        engine, mlflow_tracking_uri=store, data_dir=tmp_path, redis_url=redis_url, adapter_poll_s=60.0
    ) as server:
        watcher = server.service.watcher
        wait_for(lambda: _subscribed(redis_url), 10, "the watcher to subscribe to adapter events")
        results, failures, stop = [], [], threading.Event()

        def traffic():  # steady requests while versions come and go
            while not stop.is_set():
                try:
                    results.append(complete(server))
                except BaseException as exc:
                    failures.append(exc)

        client = threading.Thread(target=traffic)
        client.start()
        try:
            for i, name in enumerate(("good1", "good2", "good3"), start=1):
                promoted = time.monotonic()
                registry.register(adapters[name], by="trainer:test")
                wait_for(lambda i=i: len(watcher.swaps) == i, 5, f"the swap to version {i} (event, not poll)")
                assert engine.adapter_version == str(i)
                assert time.monotonic() - promoted < 5
                time.sleep(0.3)
        finally:
            stop.set()
            client.join(60)
        assert not failures and results
        assert all(r["choices"][0]["token_ids"] == expected for r in results), "lossless across swaps"
        assert {r["usage"]["spec_decode"]["adapter_version"] for r in results} <= {None, "1", "2", "3"}
        final = complete(server)
        assert final["usage"]["spec_decode"]["adapter_version"] == "3"
        assert [swap[:2] for swap in watcher.swaps] == [("swap", "1"), ("swap", "2"), ("swap", "3")]
        assert metric(server, "adaptive_spec:adapter_swaps_total", kind="swap") == 3
        assert metric(server, "adaptive_spec:adapter_version") == 3
        assert 0 < metric(server, "adaptive_spec:adapter_swap_pause_seconds") < 0.05
        assert metric(server, "adaptive_spec:adapter_refusals_total") == 0


def test_a_server_starting_while_a_champion_exists_is_ready_on_it(target, adapters, registry, tmp_path):
    """A replica started (or restarted) into a fleet serves the champion from its first request, not
    the base draft until its first poll: start_watcher (Service.start, before the server is ready)
    returns once the first check has loaded the champions."""
    registry.register(adapters["good1"], by="trainer:test")
    registry.register(adapters["good2"], by="trainer:test")
    engine = engine_for(target)
    settings = Settings(data_dir=tmp_path, adapter_poll_s=60.0)
    watcher = start_watcher(engine, registry, settings)
    try:
        assert engine.adapter_version == "2" and [swap[:2] for swap in watcher.swaps] == [("swap", "2")]
    finally:
        watcher.stop()


def test_an_alias_moved_by_hand_in_mlflow_is_followed_within_10_s(mlflow_server, target, adapters, tmp_path):
    registry = AdapterRegistry(mlflow_server.url, data_dir=tmp_path, model_name=f"ui-{uuid.uuid4().hex[:8]}")
    registry.register(adapters["good1"])
    registry.register(adapters["good2"])
    engine = engine_for(target)
    watcher = AdapterWatcher(engine, registry, tmp_path / "cache", poll_s=5.0).start()  # the default poll
    try:
        wait_for(lambda: watcher.swaps and watcher.swaps[-1][1] == "2", 15, "the first champion")
        moved = time.monotonic()
        MlflowClient(tracking_uri=mlflow_server.url).set_registered_model_alias(registry.model_name, "champion", "1")
        wait_for(lambda: watcher.swaps[-1][1] == "1", 10, "the alias moved by hand")  # swapped and recorded
        assert time.monotonic() - moved < 10 and engine.adapter_version == "1"
        kind, version, pause, domain = watcher.swaps[-1]
        assert (kind, version, domain) == ("rollback", "1", None) and pause < 0.05
    finally:
        watcher.stop()


def test_corrupt_incompatible_and_missing_artifacts_are_refused_and_counted(
    live_server, target, adapters, registry, store, tmp_path
):
    engine = engine_for(target)
    with live_server(engine, mlflow_tracking_uri=store, data_dir=tmp_path, adapter_poll_s=0.2) as server:
        registry.register(adapters["good1"])
        wait_for(lambda: engine.adapter_version == "1", 10, "the first swap")
        versions = {
            name: registry.register(adapters[name], promote=False)
            for name in ("corrupt", "missing", "bad_shape", "nan")
        }
        versions["other_draft"] = _register_by_hand(registry, adapters["other_draft"])  # the registry refuses it
        corrupt = _artifact_dir(registry, versions["corrupt"]) / WEIGHTS_FILE
        data = bytearray(corrupt.read_bytes())
        data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the weights
        corrupt.write_bytes(bytes(data))
        for path in _artifact_dir(registry, versions["missing"]).iterdir():
            path.unlink()

        expected = {
            "corrupt": "checksum",
            "missing": "missing",
            "other_draft": "incompatible",
            "bad_shape": "incompatible",
            "nan": "corrupt",
        }
        for name, reason in expected.items():
            before = metric(server, "adaptive_spec:adapter_refusals_total", reason=reason)
            registry.promote(versions[name], by="test")
            wait_for(
                lambda name=name, reason=reason: server.service.watcher.refused.get((None, versions[name])) == reason,
                10,
                f"{name} refused",
            )
            time.sleep(0.5)  # a few more polls: counted once, not once per poll
            assert metric(server, "adaptive_spec:adapter_refusals_total", reason=reason) == before + 1
            assert engine.adapter_version == "1", f"{name}: the served adapter must stay"
            assert complete(server)["usage"]["spec_decode"]["adapter_version"] == "1"
        assert not list((tmp_path / "adapter-cache").glob(f"v{versions['corrupt']}-*")), "bad files are not kept"

        good = registry.register(adapters["good2"])  # a good version after the refusals is served
        wait_for(lambda: len(server.service.watcher.swaps) == 2, 10, "the good version")
        assert engine.adapter_version == good and metric(server, "adaptive_spec:adapter_swaps_total") == 2


def test_greedy_output_equals_the_target_alone_when_swaps_land_mid_generation(target, adapters, registry, tmp_path):
    engine = engine_for(target)
    expected = engine.generate(PROMPT, max_new_tokens=48, speculative=False).token_ids
    watcher = AdapterWatcher(engine, registry, tmp_path / "cache")  # driven by hand: check() between steps
    actions = {
        2: lambda: registry.register(adapters["good1"]),
        5: lambda: registry.register(adapters["good2"]),
        8: lambda: registry.rollback(by="test"),
        11: lambda: registry.client.delete_registered_model_alias(registry.model_name, "champion"),
    }
    tokens, seen = [], []
    for step, chunk in enumerate(engine.stream(PROMPT, max_new_tokens=48, k=3)):
        tokens += chunk.token_ids
        if step in actions:
            actions[step]()
            assert watcher.check() in ("swapped", "unloaded")
            seen.append(engine.adapter_version)
    assert seen == ["1", "2", "1", None], "each swap landed mid-generation"
    assert tokens == expected
    assert chunk.output.token_ids == expected and chunk.output.stats.adapter_version is None
    assert [swap.kind for swap in watcher.swaps] == ["swap", "swap", "rollback", "rollback"]


def test_champion_removed_unloads_and_every_swap_marks_the_dashboard(
    live_server, target, adapters, registry, store, tmp_path
):
    engine = engine_for(target)
    with live_server(engine, mlflow_tracking_uri=store, data_dir=tmp_path, adapter_poll_s=0.2) as server:
        marks = []

        class Stats:  # what the dashboard store offers (service/stats_store.py), recording the calls
            def mark(self, kind, version, by=None, **extra):
                marks.append((kind, version, by, sorted(extra)))

        server.service.stats = Stats()
        registry.register(adapters["good1"], by="trainer:test")
        wait_for(lambda: len(marks) == 1, 10, "the swap")
        registry.client.delete_registered_model_alias(registry.model_name, "champion")
        wait_for(lambda: len(marks) == 2, 10, "the unload")
        assert complete(server)["usage"]["spec_decode"]["adapter_version"] is None
        assert marks == [
            ("swap", "1", "trainer:test", ["adapter_dir", "domain"]),
            ("rollback", None, "mlflow-alias", ["adapter_dir", "domain"]),
        ]


def test_each_domain_alias_is_followed_into_its_own_slot(target, adapters, registry, tmp_path):
    engine = Engine(target, "early-exit:1", k=3, record_topk=8, eos_token_id=[], max_adapters=1)
    expected = engine.generate(PROMPT, max_new_tokens=16, speculative=False).token_ids
    swapped = []

    def on_swap(kind, version, by, path, *, domain):
        swapped.append((kind, version, by, domain))

    # driven by hand, with no pub/sub: `by` comes from each domain's last event in the registry
    watcher = AdapterWatcher(engine, registry, tmp_path / "cache", on_swap=on_swap)
    reads = []
    champions = registry.champions
    registry.champions = lambda: reads.append(1) or champions()
    registry.register(adapters["good1"], by="trainer:test")  # "1": champion
    for name in ("good2", "good3", "bad_shape"):  # "2", "3", "4"
        registry.register(adapters[name], promote=False)
    registry.promote("2", by="cli:alice@host", domain="sql")
    assert watcher.check() == "swapped" and len(reads) == 1
    assert engine.adapters.versions() == {None: "1", "sql": "2"}
    assert swapped == [("swap", "1", "trainer:test", None), ("swap", "2", "cli:alice@host", "sql")]
    for domain, version in (("sql", "2"), (None, "1")):
        out = engine.generate(PROMPT, max_new_tokens=16, k=3, domain=domain)
        assert out.stats.adapter_version == version and out.token_ids == expected

    registry.promote("3", by="cli:alice@host", domain="sql")
    assert watcher.check() == "swapped" and engine.adapters.versions() == {None: "1", "sql": "3"}
    registry.promote("4", by="cli:alice@host", domain="sql")  # made for another draft shape
    assert watcher.check() == "refused" and watcher.refused == {("sql", "4"): "incompatible"}
    assert engine.adapters.versions() == {None: "1", "sql": "3"} and watcher.check() == "refused"
    registry.rollback(by="cli:alice@host", domain="sql")  # back to 3, which it still serves
    assert watcher.check() == "unchanged" and watcher.refused == {}

    registry.promote("2", by="cli:alice@host", domain="zzz")  # one slot for domains: sql's, first by name
    assert watcher.check() == "unchanged" and engine.adapters.versions() == {None: "1", "sql": "3"}
    registry.client.delete_registered_model_alias(registry.model_name, "champion-sql")
    assert watcher.check() == "unloaded"
    assert watcher.swaps[-2][:2] == ("rollback", None) and watcher.swaps[-2].domain == "sql"
    assert engine.adapters.versions() == {None: "1", "zzz": "2"}  # the slot is free for the next domain
    out = engine.generate(PROMPT, max_new_tokens=16, k=3, domain="sql")  # the general adapter again
    assert out.stats.adapter_version == "1" and out.token_ids == expected
    assert [swap.domain for swap in watcher.swaps] == [None, "sql", "sql", "sql", "zzz"] and len(reads) == 7


def _register_by_hand(registry: AdapterRegistry, adapter_dir: Path) -> str:
    """A version made with MlflowClient alone, as another tool could: it skips the registry's own
    target/draft check, so only the watcher stands between it and the engine."""
    import json

    metadata = json.loads((adapter_dir / "adaptive_spec_adapter.json").read_text())
    client = registry.client
    run = client.create_run(client.get_experiment_by_name("adaptive-spec").experiment_id)
    client.log_artifacts(run.info.run_id, str(adapter_dir), "adapter")
    tags = {
        "target_id": metadata["target_id"],
        "draft_id": metadata["draft_id"],
        "adapter_sha256": metadata["adapter_sha256"],
    }
    return str(
        client.create_model_version(
            registry.model_name, run.info.artifact_uri + "/adapter", run_id=run.info.run_id, tags=tags
        ).version
    )


def _artifact_dir(registry: AdapterRegistry, version: str) -> Path:
    run = registry.client.get_run(registry.client.get_model_version(registry.model_name, version).run_id)
    return Path(urlparse(run.info.artifact_uri).path) / "adapter"


def _subscribed(redis_url: str) -> bool:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return dict(client.pubsub_numsub(ADAPTER_EVENTS)).get(ADAPTER_EVENTS.encode(), 0) > 0
    finally:
        client.close()


def test_a_dead_watcher_makes_health_503_while_requests_are_still_answered(
    live_server, target, registry, store, tmp_path, caplog
):
    """The watcher decides what this server serves: dead, it follows no promotion and no rollback, so
    /health answers 503 (an orchestrator restarts the process, which loads the champions before it is
    ready). Killed here by what its per-check `except Exception` cannot catch: a library calling sys.exit."""
    engine = engine_for(target)
    with live_server(engine, mlflow_tracking_uri=store, data_dir=tmp_path, adapter_poll_s=0.2) as server:
        watcher = server.service.watcher
        assert httpx.get(server.url + "/health").json()["threads"]["adapter_watcher"] is True

        def champions():
            raise SystemExit("injected: sys.exit on the watcher's thread")

        watcher.registry.champions = champions
        wait_for(lambda: httpx.get(server.url + "/health").status_code == 503, 10, "/health to say so")
        health = httpx.get(server.url + "/health").json()
        assert health["status"] == "unhealthy" and health["dead"] == ["adapter_watcher"]
        assert health["threads"] == {"engine": True, "adapter_watcher": False, "correction_log": None}
        assert complete(server)["choices"][0]["token_ids"]  # until a restart, what it serves is still exact
    died = [r for r in caplog.records if "adapter watcher died" in r.getMessage()]
    assert died and died[0].exc_info is not None


def test_downloaded_versions_are_pruned_to_those_served_and_the_most_recent(target, adapters, registry, tmp_path):
    """Issue 30, item 6: a server's adapter cache (their n-gram indexes and vocabularies come from user traffic)
    keeps what the engine holds plus `keep_versions` more, however many versions it followed."""
    engine = engine_for(target)
    watcher = AdapterWatcher(engine, registry, tmp_path / "cache", keep_versions=1)  # driven by hand
    for name in ("good1", "good2", "good3"):
        registry.register(adapters[name], by="trainer:test")
        assert watcher.check() == "swapped"
    registry.rollback(to="1", by="cli:alice@host")
    assert watcher.check() == "swapped"
    cached = sorted(path.name.split("-")[0] for path in (tmp_path / "cache").iterdir())
    assert cached == ["v1"] and engine.adapter_version == "1"  # held now, and the most recent download
