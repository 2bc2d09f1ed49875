"""A bounded HTTP load test: N concurrent users send completions on loopback for a fixed time.

    adaptive-spec bench-load --url http://127.0.0.1:8000 --users 8 --duration-s 30 --max-tokens 32
    adaptive-spec bench-load --url http://127.0.0.1:8000 --users 2 --duration-s 5 --json load.json  # small CPU run

    report = asyncio.run(run_load("http://127.0.0.1:8000", users=4, duration_s=10))
    print(report.summary())

Each user is one asyncio task with its own connection that sends a request, waits for the whole
response, and sends the next one at once (a closed loop: the offered load follows the server's
speed, so a slow server sees fewer requests, never an unbounded queue). The model name comes from
`GET /v1/models` unless given. Requests are greedy completions of a fixed chat or token prompt.

What is reported (`LoadReport.as_dict()`, the JSON file):

- `requests`: responses received plus transport failures; `by_status`: counts per HTTP status,
  and `transport_errors` per exception name (connection refused, reset, timeout);
- `throughput_rps` = requests / elapsed; `tokens_per_s` = completion tokens of the 200s / elapsed;
- `latency_s`: p50, p99 and max over every request (nearest-rank percentiles), in seconds;
- `errors`: every response that is not 200 and not one of `allowed` (429 and 503 by default, the
  service's documented answers to a full queue and to draining), plus every transport failure.
  Example: 412 requests in 10.0 s, {200: 410, 429: 2} -> throughput 41.2/s, errors 0.
- `adapter_versions`: how many 200s each served adapter version answered (usage.spec_decode).

A benchmark, not a test: the figures depend on the machine. tests/reliability/test_load.py runs it
for a few seconds and asserts only that nothing failed.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

ALLOWED_STATUSES = (429, 503)


def percentile(values: list[float], q: float) -> float:
    """Nearest rank: p50 of [1, 2, 3, 4] is 2, p99 of 200 latencies is the 198th smallest; NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


@dataclass
class LoadReport:
    users: int
    duration_s: float
    elapsed_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)  # one per request, in completion order
    by_status: Counter = field(default_factory=Counter)
    transport_errors: Counter = field(default_factory=Counter)  # exception name -> count
    completion_tokens: int = 0
    adapter_versions: Counter = field(default_factory=Counter)
    allowed: tuple[int, ...] = ALLOWED_STATUSES

    @property
    def requests(self) -> int:
        return sum(self.by_status.values()) + sum(self.transport_errors.values())

    @property
    def errors(self) -> int:
        bad = sum(count for status, count in self.by_status.items() if status != 200 and status not in self.allowed)
        return bad + sum(self.transport_errors.values())

    def percentile(self, q: float) -> float:
        return percentile(self.latencies_s, q)

    def as_dict(self) -> dict:
        elapsed = self.elapsed_s or math.nan
        return {
            "users": self.users,
            "duration_s": self.duration_s,
            "elapsed_s": round(self.elapsed_s, 3),
            "requests": self.requests,
            "errors": self.errors,
            "by_status": {str(status): count for status, count in sorted(self.by_status.items())},
            "transport_errors": dict(self.transport_errors),
            "throughput_rps": round(self.requests / elapsed, 2),
            "tokens_per_s": round(self.completion_tokens / elapsed, 1),
            "latency_s": {
                "p50": round(self.percentile(50), 4),
                "p99": round(self.percentile(99), 4),
                "max": round(max(self.latencies_s, default=math.nan), 4),
            },
            "adapter_versions": {str(version): count for version, count in self.adapter_versions.items()},
        }

    def summary(self) -> str:
        d = self.as_dict()
        return (
            f"{d['requests']} requests from {self.users} users in {d['elapsed_s']} s: "
            f"{d['throughput_rps']} req/s, {d['tokens_per_s']} tok/s, latency p50 {d['latency_s']['p50']} s "
            f"p99 {d['latency_s']['p99']} s max {d['latency_s']['max']} s; by status {d['by_status']}, "
            f"transport errors {d['transport_errors']}; errors {d['errors']}; "
            f"adapter versions {d['adapter_versions']}"
        )


async def run_load(
    url: str,
    users: int = 4,
    duration_s: float = 10.0,
    *,
    model: str | None = None,
    prompt: str | list[int] = "Name three rivers.",
    max_tokens: int = 16,
    timeout_s: float = 60.0,
    extra_body: dict | None = None,
    allowed: tuple[int, ...] = ALLOWED_STATUSES,
    stop: threading.Event | None = None,
) -> LoadReport:
    """Run `users` closed-loop users against `url` for `duration_s`, or until `stop` is set (from any thread);
    requests under way at the end finish."""
    url = url.rstrip("/")
    if model is None:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            model = (await client.get(url + "/v1/models")).raise_for_status().json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **(extra_body or {})}
    report = LoadReport(users=users, duration_s=duration_s, allowed=allowed)
    started = time.monotonic()
    deadline = started + duration_s
    stop = stop or threading.Event()
    await asyncio.gather(
        *(_user(url + "/v1/completions", body, deadline, stop, timeout_s, report) for _ in range(users))
    )
    report.elapsed_s = time.monotonic() - started
    return report


async def _user(
    url: str, body: dict, deadline: float, stop: threading.Event, timeout_s: float, report: LoadReport
) -> None:
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        while time.monotonic() < deadline and not stop.is_set():
            sent = time.monotonic()
            try:
                response = await client.post(url, json=body)
            except httpx.HTTPError as exc:
                report.transport_errors[type(exc).__name__] += 1
                report.latencies_s.append(time.monotonic() - sent)
                await asyncio.sleep(0.05)  # a refused connection returns at once: do not spin
                continue
            report.latencies_s.append(time.monotonic() - sent)
            report.by_status[response.status_code] += 1
            if response.status_code == 200:
                usage = response.json()["usage"]
                report.completion_tokens += usage["completion_tokens"]
                report.adapter_versions[usage.get("spec_decode", {}).get("adapter_version") or "base"] += 1
            elif response.status_code in report.allowed:
                await asyncio.sleep(float(response.headers.get("retry-after", "0.1")))
