"""The dashboard's JSON API and assets on a live server with a tiny engine and a real redis-server.

OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/service/test_dashboard_api.py -q
"""

from __future__ import annotations

import httpx
import pytest
from dashboard_support import make_adapter, send_traffic, settle, swap
from tiny import tiny_target

from adaptive_spec import Engine
from adaptive_spec.contracts import TRAINER_STATUS_KEY
from trainer.loop.rounds import RoundResult
from trainer.loop.status import TrainerStatus

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]


@pytest.fixture
def engine() -> Engine:
    """A private engine: these tests swap its adapters."""
    return Engine(tiny_target(0), "early-exit:1", tokenizer=None, k=3, record_topk=8)


def test_series_events_and_summary_follow_live_traffic_and_swaps(
    live_server, engine, redis_client, redis_url, tmp_path
):
    v1 = make_adapter(engine.target, 1, tmp_path / "v1", seed=1, version=1, greedy_match=0.5, expected_acceptance=0.4)
    with live_server(engine, redis_url=redis_url, data_dir=tmp_path) as server:
        send_traffic(server.url, 3, "alpha")
        swap(server.service, v1, "1", by="test")
        send_traffic(server.url, 2, "beta")
        settle(server.service, 5)
        series = httpx.get(server.url + "/api/stats/series").json()
        assert series["step"] == 10 and len(series["t"]) in (360, 361)  # the default hour, in 10 s buckets
        assert {"base", "1"} <= set(series["by_version"]) and {"alpha", "beta"} <= set(series["by_domain"])
        assert sum(n or 0 for n in series["by_version"]["base"]["requests"]) == 3
        assert sum(n or 0 for n in series["by_domain"]["beta"]["requests"]) == 2
        rates = [r for r in series["by_version"]["1"]["acceptance_rate"] if r is not None]
        assert rates and all(0 <= r <= 1 for r in rates)
        assert all(s is None for s in series["by_version"]["1"]["speedup"])  # no target-alone traffic: unknown

        events = httpx.get(server.url + "/api/stats/events").json()["events"]
        assert [(e["kind"], e["version"], e["by"]) for e in events] == [("swap", "1", "test")]

        summary = httpx.get(server.url + "/api/stats/summary").json()
        assert summary["served_version"] == "1"
        assert summary["decoding"]["dtype"] in ("fp32", "bf16") and summary["decoding"]["path"] in ("eager", "compiled")
        assert summary["champion"]["gate"]["candidate"]["greedy_match"] == 0.5
        assert [d["domain"] for d in summary["domains"]] == ["alpha", "beta"]
        assert all(0 <= d["draft_k"] <= 3 for d in summary["domains"])  # tokens drafted per step, k = 3 at most
        assert [d["adapter"] for d in summary["domains"]] == ["1", "1"]  # no domain adapter: the general one
        v2 = make_adapter(
            engine.target, 1, tmp_path / "v2", seed=2, version=2, greedy_match=0.5, expected_acceptance=0.4
        )
        server.service.engine.load_adapter(v2, "2", domain="beta")
        summary = httpx.get(server.url + "/api/stats/summary").json()
        assert {d["domain"]: d["adapter"] for d in summary["domains"]} == {"alpha": "1", "beta": "2"}
        assert {"base", "1"} == {v["version"] for v in summary["versions"]}
        assert summary["trainer"] is None  # no trainer has reported

        waiting = (
            "first candidate when the held-out set reaches 128 positions and 4 records: 64 positions in 2 records now"
        )
        TrainerStatus(redis_client, "trainer-a").report(RoundResult(False, False, waiting), "the base draft")
        trainer = httpx.get(server.url + "/api/stats/summary").json()["trainer"]
        assert trainer["state"] == "waiting" and trainer["message"] == waiting
        assert trainer["consumer"] == "trainer-a" and trainer["champion"] == "the base draft"
        assert 0 < redis_client.ttl(TRAINER_STATUS_KEY) <= 86400  # bounded: a stopped trainer's word expires


def test_drift_alert_on_the_page_data_and_in_prometheus(live_server, engine, redis_url, redis_client, tmp_path):
    # The gate promised 0.95 first-token acceptance; a random adapter on a random model gets far less.
    v1 = make_adapter(engine.target, 1, tmp_path / "v1", seed=1, version=1, greedy_match=0.95, expected_acceptance=0.9)
    with live_server(engine, redis_url=redis_url, data_dir=tmp_path, drift_min_drafts=20) as server:
        swap(server.service, v1, "1", by="test")
        metrics = httpx.get(server.url + "/metrics").text
        assert "adaptive_spec:drift_alert 0.0" in metrics  # no traffic yet: no alert
        send_traffic(server.url, 4, "gamma")
        settle(server.service, 4)
        drift = httpx.get(server.url + "/api/stats/summary").json()["drift"]
        assert drift["drafts"] >= 20 and drift["first_token_acceptance"] < 0.7 * 0.95
        assert drift["alert"] is True and drift["expected"] == pytest.approx(0.95)
        metrics = httpx.get(server.url + "/metrics").text
        assert "adaptive_spec:drift_alert 1.0" in metrics
        window = next(
            line for line in metrics.splitlines() if line.startswith("adaptive_spec:first_token_acceptance_window ")
        )
        assert float(window.split()[1]) == pytest.approx(drift["first_token_acceptance"])


def test_an_adapter_served_from_the_start_shows_its_gate_figures_and_no_swap(
    live_server, engine, redis_url, redis_client, tmp_path
):
    start = make_adapter(
        engine.target, 1, tmp_path / "start", seed=3, version=7, greedy_match=0.42, expected_acceptance=0.3
    )
    with live_server(engine, redis_url=redis_url, data_dir=tmp_path, adapter=str(start)) as server:
        send_traffic(server.url, 1, "a")
        settle(server.service, 1)
        assert httpx.get(server.url + "/api/stats/events").json()["events"] == []
        champion = httpx.get(server.url + "/api/stats/summary").json()["champion"]
        assert champion["version"] == "7"
        assert champion["gate"]["candidate"]["greedy_match"] == 0.42


@pytest.mark.parametrize(
    "query, param",
    [
        ("from=10&to=5", "from"),
        ("step=7", "step"),
        ("from=abc", "query.from"),
        ("from=0&to=40000000", "from"),
        ("step=10&from=0&to=86400", "step"),
    ],
)
def test_bad_queries_get_a_400_in_openai_shape(live_server, tiny_engine, redis_url, query, param):
    with live_server(tiny_engine, redis_url=redis_url) as server:
        response = httpx.get(server.url + "/api/stats/series?" + query)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_without_redis_the_api_says_why_and_the_page_still_loads(live_server, tiny_engine):
    with live_server(tiny_engine) as server:
        response = httpx.get(server.url + "/api/stats/summary")
        assert response.status_code == 503 and "REDIS_URL" in response.json()["error"]["message"]
        assert httpx.get(server.url + "/dashboard").status_code == 200


def test_page_and_vendored_assets_are_served(live_server, tiny_engine, redis_url):
    with live_server(tiny_engine, redis_url=redis_url) as server:
        page = httpx.get(server.url + "/dashboard")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        for src in (
            "/dashboard/static/vendor/uPlot.iife.min.js",
            "/dashboard/static/vendor/uPlot.min.css",
            "/dashboard/static/dashboard.js",
            "/dashboard/static/dashboard.css",
        ):
            assert src in page.text
            assert httpx.get(server.url + src).status_code == 200
        assert "http" not in page.text.replace("http-equiv", "")  # no external URL at all
        assert httpx.get(server.url + "/dashboard/static/../../service/app.py").status_code == 404
