"""The dashboard in a real browser (Debian's chromium driven by Playwright), offline, against a live
server that served traffic across two adapter swaps and a rollback.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/service/test_dashboard_browser.py -q -s

Every request the page makes to anything but loopback is aborted and listed, so the test proves
the page needs no network. The screenshot goes to test-artifacts/dashboard.png (gitignored).
Never run `playwright install`: the browser is the system's chromium.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from dashboard_support import make_adapter, send_traffic, settle, swap
from tiny import tiny_target

from adaptive_spec import Engine
from adaptive_spec.formats.stats import RequestStats, StepStats
from service.stats_store import StatsRecorder
from trainer.loop.rounds import RoundResult
from trainer.loop.status import TrainerStatus

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    executable = shutil.which("chromium")
    if executable is None:
        pytest.fail("Debian's chromium is not installed (apt-get install -y chromium); never `playwright install`")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def offline_page(browser):
    """A page that can reach loopback only; `page.blocked` lists whatever else it tried."""
    page = browser.new_page(viewport={"width": 1400, "height": 1300})
    page.blocked = []

    def route(route):
        if urlsplit(route.request.url).hostname in ("127.0.0.1", "localhost"):
            route.continue_()
        else:
            page.blocked.append(route.request.url)
            route.abort()

    page.route("**/*", route)
    return page


def open_dashboard(page, url: str) -> float:
    """Navigate and wait until the first refresh drew everything; returns the seconds it took."""
    started = time.perf_counter()
    page.goto(url, wait_until="domcontentloaded")
    page.wait_for_function("window.dashboard && window.dashboard.loaded", timeout=30_000)
    return time.perf_counter() - started


def test_chart_shows_versions_swaps_and_a_rollback_offline(browser, live_server, redis_url, redis_client, tmp_path):
    engine = Engine(tiny_target(0), "early-exit:1", tokenizer=None, k=3, record_topk=8)  # private: it gets swapped
    v1 = make_adapter(engine.target, 1, tmp_path / "v1", seed=1, version=1, greedy_match=0.31, expected_acceptance=0.2)
    v2 = make_adapter(engine.target, 1, tmp_path / "v2", seed=2, version=2, greedy_match=0.36, expected_acceptance=0.25)
    with live_server(engine, redis_url=redis_url, data_dir=tmp_path) as server:
        service, served = server.service, 0
        for phase, (action, domain) in enumerate(
            [(None, "json"), ("swap v1", "json"), ("swap v2", "sql"), ("rollback v1", "sql")]
        ):
            if action == "swap v1":
                swap(service, v1, "1", by="test")
            elif action == "swap v2":
                swap(service, v2, "2", by="test")
            elif action == "rollback v1":  # as the adapter watcher does it: swap on the engine, then mark it
                engine.load_adapter(v1, "1")
                service.stats.mark("rollback", "1", by="test")
            send_traffic(server.url, 3, domain, seed=phase)
            served += 3
            settle(service, served)
        waiting = (
            "first candidate when the held-out set reaches 128 positions and 4 records: 64 positions in 2 records now"
        )
        rejected = {"vocab": 4, "model": 2}  # records the trainer's screen dropped (trainer/intake/screening.py)
        status = TrainerStatus(redis_client, "trainer-a")
        status.round_failed("a round of the general adapter failed (OSError: disk full); training goes on", 1)
        status.report(RoundResult(False, False, waiting), "the base draft", rejected)

        page = offline_page(browser)
        seconds = open_dashboard(page, server.url + "/dashboard")
        state = page.evaluate(
            "() => ({versions: window.dashboard.versionsDrawn, markers: window.dashboard.markersDrawn,"
            " error: window.dashboard.error})"
        )
        chart = page.locator("#acceptance-chart")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        print(f"\ndashboard with live traffic loaded in {seconds * 1000:.0f} ms: {state}")

        assert state["error"] is None
        assert {"base", "1", "2"} <= set(state["versions"]) and all(n > 0 for n in state["versions"].values())
        assert set(chart.get_attribute("data-versions").split(",")) >= {"base", "1", "2"}
        assert int(chart.get_attribute("data-swap-markers")) == 2  # base -> 1, 1 -> 2
        assert int(chart.get_attribute("data-rollback-markers")) == 1  # 2 -> 1
        assert page.locator("#events li[data-kind=rollback][data-version='1']").count() == 1
        assert page.locator("#champion-figures").get_attribute("data-version") == "1"
        assert "0.310" in page.locator("#champion").inner_text()  # v1's gated greedy match
        assert page.locator("#trainer-status").get_attribute("data-state") == "waiting"
        assert waiting in page.locator("#trainer").inner_text()
        assert "6 (model 2, vocab 4)" in page.locator("#trainer").inner_text()
        assert "failed (OSError: disk full)" in page.locator("#trainer-failure").inner_text()
        assert page.locator("#domains tr[data-domain=json]").count() == 1
        assert page.locator("#domains tr[data-domain=sql]").count() == 1
        assert page.locator("canvas").count() >= 3
        assert page.blocked == []  # it asked for nothing outside loopback
        page.close()


def test_24_hours_of_10_second_buckets_load_fast_offline(browser, live_server, tiny_engine, redis_url, redis_client):
    end = time.time()
    history = StatsRecorder(redis_url, flush_every_s=3600, replica="history")

    changes = [("swap", "2", end - 57600), ("rollback", "1", end - 50000), ("swap", "3", end - 28800)]
    for i in range(8640):  # one request in every 10 s bucket of the last 24 h, in three domains
        at = end - 86400 + 10 * i + 5
        version = next((v for _, v, t in reversed(changes) if t <= at), "1")  # what the markers say was served
        stats = RequestStats(adapter_version=version, wall_s=0.5, prefill_s=0.1)
        for step in range(4):
            stats.add(StepStats(4, (i + step) % 5, (i + step) % 5 + 1, 4, 0.01, 0.05))
        history.record(stats, domain=("json", "sql", "chat")[i % 3], greedy=True, ended_at=at)
        if i % 300 == 299:
            assert history.flush()
    assert history.flush()
    for kind, version, at in changes:
        history.mark(kind, version, by="test", at=at)
    assert history.flush()
    assert sum(1 for _ in redis_client.scan_iter("adaptive_spec:stats:b:10:*", count=1000)) >= 8640

    with live_server(tiny_engine, redis_url=redis_url) as server:
        page = offline_page(browser)
        open_dashboard(page, server.url + "/dashboard?range=86400")  # a first load warms the server and browser
        timings = []
        for _ in range(3):
            page.reload(wait_until="domcontentloaded")
            page.wait_for_function("window.dashboard && window.dashboard.loaded", timeout=30_000)
            timings.append(page.evaluate("window.dashboard.loadMs") / 1000)  # from navigation start
        state = page.evaluate(
            "() => ({versions: window.dashboard.versionsDrawn, markers: window.dashboard.markersDrawn,"
            " points: window.dashboard.series.t.length, step: window.dashboard.series.step,"
            " api_ms: performance.getEntriesByType('resource').filter(e => e.name.includes('/api/'))"
            ".map(e => e.name.split('?')[0].split('/').pop() + ' ' + Math.round(e.duration))})"
        )
        page.screenshot(path=str(ARTIFACTS / "dashboard-24h.png"), full_page=True)
        print(
            f"\n24 h of 10 s buckets: page loads in {', '.join(f'{t * 1000:.0f}' for t in timings)} ms "
            f"(navigation start to everything drawn); {state}"
        )
        assert state["step"] == 60 and state["points"] in (1440, 1441)  # 24 h read as minute buckets
        assert set(state["versions"]) == {"1", "2", "3"}
        assert state["markers"]["swap"] == 2 and state["markers"]["rollback"] == 1
        assert page.blocked == []
        page.close()
