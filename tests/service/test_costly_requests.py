"""Costly requests are capped (issue 30, item 7), on a live server with a tiny engine and a real redis-server.

OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/service/test_costly_requests.py -q

- Admission first: with the queue full, a request is refused 429 before its prompt is tokenised or its
  grammar compiled. Shown by a request whose prompt the tokenising check refuses (a token id past the
  vocabulary): with the queue full it gets the 429, not that 400; with room it gets the 400, and the place
  it held is given back (the next request is queued).
- Stop strings are at most 256 characters.
- The series endpoint reads at most 12,000 bucket hashes, and none past retention: counted by Redis itself
  (INFO commandstats, HGETALL calls).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import redis
from polling import wait_for

from service.stats_queries import MAX_BUCKETS

pytestmark = [pytest.mark.redis, pytest.mark.usefixtures("one_thread")]

PROMPT = [5, 17, 33, 8, 5, 17]


@contextmanager
def engine_stuck(engine):
    """Hold the step lock: the worker blocks inside its current request's next decoding step."""
    engine.step_lock.acquire()
    try:
        yield
    finally:
        engine.step_lock.release()


def background(url: str, body: dict, results: list) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(httpx.post(url, json=body, timeout=60)))
    thread.start()
    return thread


def test_a_full_queue_answers_429_before_the_prompt_is_tokenised(live_server, tiny_engine):
    with live_server(tiny_engine, queue_size=1) as server:
        url = server.url + "/v1/completions"
        good = {"model": tiny_engine.target_id, "prompt": PROMPT, "max_tokens": 4}
        bad = {**good, "prompt": [5, 10**6]}  # refused by the tokenising check: an id past the vocabulary
        assert httpx.post(url, json=bad).status_code == 400  # with room: the check runs and refuses it
        results: list[httpx.Response] = []

        def health() -> dict:
            return httpx.get(server.url + "/health").json()

        with engine_stuck(tiny_engine):
            threads = [background(url, good, results)]
            wait_for(lambda: health()["requests_running"] == 1, what="one running")
            threads.append(background(url, good, results))
            wait_for(lambda: health()["requests_waiting"] == 1, what="one queued")
            full = httpx.post(url, json=bad)
        for thread in threads:
            thread.join()
        after = httpx.post(url, json=good, timeout=60)  # the places the 400s held were given back
    assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full", full.text
    assert [r.status_code for r in results] == [200, 200] and after.status_code == 200


def test_stop_strings_are_bounded_in_length(live_server, chat_engine):
    with live_server(chat_engine) as server:
        body = {"model": chat_engine.target_id, "prompt": "hi", "max_tokens": 4}
        for stop, status in ((["x" * 256], 200), (["x" * 257], 400), ("y" * 10_000, 400)):
            answer = httpx.post(server.url + "/v1/completions", json={**body, "stop": stop}, timeout=60)
            assert answer.status_code == status, (len(stop), answer.text)


def hgetall_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0))


def test_the_series_endpoint_caps_what_one_request_reads(live_server, tiny_engine, redis_url, redis_client):
    now = time.time()
    with live_server(tiny_engine, redis_url=redis_url) as server:
        series = server.url + "/api/stats/series"

        def read(**params) -> tuple[httpx.Response, int]:
            before = hgetall_calls(redis_client)
            answer = httpx.get(series, params={"to": now, **params}, timeout=60)
            return answer, hgetall_calls(redis_client) - before

        # 31 days at 1220 s, which only 10 s buckets make up: 267,840 reads before the cap
        refused, reads = read(**{"from": now - 31 * 86400, "step": 1220})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "too_many_buckets", refused.text
        assert "use a multiple of 60" in refused.json()["error"]["message"] and reads == 0
        # 31 days at 1800 s: 600 s buckets, 4,464 of them
        allowed, reads = read(**{"from": now - 31 * 86400, "step": 1800})
        assert allowed.status_code == 200 and reads <= 31 * 144 + 2
        # 6 hours at 10 s, three days ago: 10 s buckets live 2 days, so there is nothing left to read
        expired, reads = read(**{"from": now - 3 * 86400, "to": now - 3 * 86400 + 6 * 3600, "step": 10})
        assert expired.status_code == 200 and reads == 0
        widest, reads = read(**{"from": now - 7 * 86400, "step": 300})  # 60 s buckets: 10,080
        assert widest.status_code == 200 and 0 < reads <= MAX_BUCKETS
