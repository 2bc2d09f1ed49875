"""`adaptive-spec bench-serve`: serving throughput and latency at several concurrency levels.


    adaptive-spec bench-serve                                   # default model, head draft, 1,2,4,8 users, 60 s each
    adaptive-spec bench-serve --concurrency 1,4 --duration-s 20 --json serve.json --plot serve.png
    adaptive-spec bench-serve --adapter ./adapters/v7 --prompts python   # a trained draft on its domain
    adaptive-spec bench-serve --target ./tiny --draft early-exit:1 --concurrency 1,2 --duration-s 3 --max-new-tokens 8

For each configuration it starts an `adaptive-spec serve` of its own on a free loopback port (no
Redis, no registry) and waits for it to load; all of them stay up, and only one gets traffic at a
time. At each concurrency level, closed-loop users run against each server in turn: each user
sends a streamed chat completion, reads it to the end, and sends the next at once, so the offered
load follows the server's speed. The window of a level is split into `rounds` (default 3) that
visit the servers in alternating order (A B C, C B A, A B C): on a shared VM the speed of the
machine drifts by tens of percent over minutes, and timing the configurations one after another
turned that drift into their ratios (the same server gave 44 and 61 tok/s in two runs an hour
apart; with the order reversed, batched speculative went from 0.59x to 1.15x batched plain). The
configurations:

- `one_at_a_time`: `--max-batch 1`, speculative with dynamic k: the server as it was before
  continuous batching, the baseline of the batching figures;
- `batched_plain`: `--max-batch N`, every request with `adaptive_spec.speculative: false`
  (the target alone, batched);
- `batched_speculative`: `--max-batch N`, speculative with dynamic k.

Per configuration and level (`runs` in the JSON): output tokens/s (completion tokens of every
request answered in the window over the window), requests/s, latency p50/p99 (send to last
byte), time to first token p50/p99 (send to the first content chunk), time per output token
(mean over requests of (latency - ttft) / (tokens - 1)), errors (any non-200 or transport
failure), `identical` (every output equals the target alone's text for its prompt; the reference
is decoded once, one request at a time, by the first server with `speculative: false`), and the
mean `k` and `batch_size` the engine chose over the window, read from its /metrics.

The clients (streamed requests, closed-loop users, the reference, /metrics) are in
benchmarks/serve_clients.py, the table and the plot in benchmarks/serve_report.py.

A benchmark, not a test: the figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from adaptive_spec.contracts import ENV_PREFIX, MLFLOW_TRACKING_URI_ENV, REDIS_URL_ENV
from adaptive_spec.formats.stats import Totals
from adaptive_spec.options import CoreSettings, ModelOptions
from adaptive_spec.outputs.prompts import PromptItem
from benchmarks.load import percentile
from benchmarks.serve_clients import Reply, closed_loop, model_name, reference_texts, step_counters, streamed, tpots_of
from launch.processes import Child, free_port, http_ok
from launch.processes import child_env as launch_child_env

CONFIGS = ("one_at_a_time", "batched_plain", "batched_speculative")
SERVER_START_TIMEOUT_S = 600.0  # the first start converts the default model's GGUF file


@dataclass(frozen=True)
class ServeBenchSettings(ModelOptions):
    """The model options every server gets (k None: dynamic k), then the benchmark's own."""

    adapter: str | None = None  # an adapter directory to serve
    max_new_tokens: int = 64
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    duration_s: float = 60.0  # per configuration and level, over all rounds
    rounds: int = 3  # the window of a level split into this many visits per server, in alternating order
    max_batch: int = 8
    configs: tuple[str, ...] = CONFIGS
    long_prompt_tokens: int = 4096  # the long-prompt case (`long_prompt`); 0: skip it
    cli: tuple[str, ...] = (sys.executable, "-m", "cli")  # how to start `adaptive-spec`


@dataclass
class Level:
    config: str
    concurrency: int
    replies: list[Reply] = field(default_factory=list)
    elapsed_s: float = 0.0
    steps: float = 0.0  # decoding steps the engine took in the window, from its /metrics
    rows: float = 0.0  # sum over those steps of the rows in the batch
    k_sum: float = 0.0  # sum over those steps of the k drafted

    @property
    def k(self) -> float | None:
        return self.k_sum / self.steps if self.steps > 0 else None

    @property
    def batch_size(self) -> float | None:
        return self.rows / self.steps if self.steps > 0 else None

    def add(self, part: Level) -> None:
        """Fold in one round's window."""
        self.replies += part.replies
        self.elapsed_s += part.elapsed_s
        self.steps += part.steps
        self.rows += part.rows
        self.k_sum += part.k_sum

    def figures(self, reference: list[str]) -> dict:
        ok = [r for r in self.replies if r.status == 200]
        tokens = sum(r.tokens for r in ok)
        latencies = [r.latency_s for r in ok]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        tpots = tpots_of(ok)
        elapsed = self.elapsed_s or math.nan
        return {
            "config": self.config,
            "concurrency": self.concurrency,
            "requests": len(self.replies),
            "elapsed_s": round(self.elapsed_s, 3),
            "output_tok_s": round(tokens / elapsed, 2),
            "requests_per_s": round(len(ok) / elapsed, 3),
            "latency_p50_s": _round(percentile(latencies, 50)),
            "latency_p99_s": _round(percentile(latencies, 99)),
            "ttft_p50_s": _round(percentile(ttfts, 50)),
            "ttft_p99_s": _round(percentile(ttfts, 99)),
            "tpot_s": _round(statistics.fmean(tpots) if tpots else math.nan),
            "tpot_p99_s": _round(percentile(tpots, 99)),
            **{key: _round_all(value) for key, value in _speculation(ok).figures().items()},
            "errors": len(self.replies) - len(ok),
            "identical": bool(ok) and all(r.text == reference[r.prompt] for r in ok),
            "mismatched": sum(r.text != reference[r.prompt] for r in ok),
            "k": None if self.k is None else round(self.k, 3),
            "batch_size": None if self.batch_size is None else round(self.batch_size, 3),
        }


def _round(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 4)


def _round_all(value):
    """A figure of Totals.figures() rounded: None stays, a list is rounded item by item."""
    if value is None:
        return None
    return [round(v, 4) for v in value] if isinstance(value, list) else round(value, 4)


def _speculation(replies: list[Reply]) -> Totals:
    """The replies' usage.spec_decode summed: acceptance, tokens verified per step and by depth."""
    totals = Totals()
    for reply in replies:
        spec = reply.spec
        forwards = spec.get("num_verify_forwards") or 0
        totals.include(
            Totals(
                drafted=spec.get("num_draft_tokens") or 0,
                accepted=spec.get("num_accepted_tokens") or 0,
                emitted=(spec.get("mean_acceptance_length") or 0) * forwards,
                target_forwards=forwards,
                accepted_per_pos=list(spec.get("num_accepted_tokens_per_pos") or []),
                drafted_per_pos=list(spec.get("num_drafts_per_pos") or []),
            )
        )
    return totals


def run_serve_bench(settings: ServeBenchSettings, items: list[PromptItem], log: Callable[[str], None] = print) -> dict:
    """Every configuration at every concurrency level, the servers taking turns; the figures as a dict."""
    configs = list(settings.configs)
    levels = {(config, users): Level(config, users) for config in configs for users in settings.concurrency}
    figures: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory(prefix="adaptive-spec-bench-serve-") as workdir, ExitStack() as servers:
        urls = {
            config: servers.enter_context(
                served(settings, 1 if config == "one_at_a_time" else settings.max_batch, Path(workdir) / config, log)
            )
            for config in configs
        }
        log(f"reference: {len(items)} prompts, target alone, one at a time")
        reference = asyncio.run(reference_texts(urls[configs[0]], items, settings.max_new_tokens))
        window = settings.duration_s / settings.rounds
        for users in settings.concurrency:
            for config in configs:  # warm up each server at this batch size
                asyncio.run(
                    closed_loop(
                        urls[config], items, users, min(3.0, window), settings.max_new_tokens, _speculative(config)
                    )
                )
            for turn in range(settings.rounds):
                for config in configs if turn % 2 == 0 else configs[::-1]:
                    part = asyncio.run(_measure(urls[config], config, items, users, window, settings))
                    levels[config, users].add(part)
            for config in configs:
                figures[config, users] = levels[config, users].figures(reference)
                log(run_line(figures[config, users]))
        long_prompt = None
        if settings.long_prompt_tokens > 0:
            config = configs[-1]  # batched speculative, when it runs
            log(f"long prompt: {settings.long_prompt_tokens} tokens among short requests, on {config}")
            long_prompt = asyncio.run(_long_prompt_case(urls[config], config, items, settings))
    runs = [figures[config, users] for config in configs for users in settings.concurrency]
    return {
        "runs": runs,
        "long_prompt": long_prompt,
        "identical": bool(runs) and all(run["identical"] for run in runs),
        "prompts": len(items),
        "max_new_tokens": settings.max_new_tokens,
        "draft": settings.draft,
        "adapter": settings.adapter,
        "target": settings.target,
        "max_batch": settings.max_batch,
        "duration_s": settings.duration_s,
        "rounds": settings.rounds,
        "k_setting": settings.k,
    }


# ---------------------------------------------------------------------------------------- servers


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A child process's environment: this one without Redis or MLflow (a benchmark's servers talk to
    none unless `extra` names them), plus `extra`."""
    return launch_child_env((REDIS_URL_ENV, MLFLOW_TRACKING_URI_ENV), **(extra or {}))


@contextmanager
def served(
    settings: ServeBenchSettings,
    max_batch: int,
    data_dir: Path,
    log: Callable[[str], None],
    extra_env: dict[str, str] | None = None,
):
    """An `adaptive-spec serve` on a free loopback port; yields its URL and stops it (SIGTERM, by pid).
    `extra_env` is added last (a Redis, a registry, settings of its own)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    share_caches(data_dir, CoreSettings.from_env().data_dir)
    port = free_port()
    served_settings = {
        "MAX_BATCH": str(max_batch),
        "ADAPTER_POLL_S": "0",
        "QUEUE_SIZE": str(max(32, 4 * max(settings.concurrency))),
        "REQUEST_TIMEOUT_S": "3600",
        **({"ADAPTER": str(settings.adapter)} if settings.adapter else {}),
    }
    env = child_env({**{ENV_PREFIX + name: value for name, value in served_settings.items()}, **(extra_env or {})})
    command = [*settings.cli, "serve", "--host", "127.0.0.1", "--port", str(port), *settings.models.argv()]
    command += ["--data-dir", str(data_dir)]
    log_path = data_dir / "server.log"
    log(f"starting a server with --max-batch {max_batch} on port {port} (log: {log_path})")
    server = Child(command, log_path, env=env).start()
    url = f"http://127.0.0.1:{port}"
    try:
        server.wait_until(lambda: http_ok(url + "/health"), SERVER_START_TIMEOUT_S, "/health", interval=0.5)
        yield url
    finally:
        server.stop(60)


SHARED_CACHES = ("compile", "models")  # what a benchmark's servers take from the data directory of whoever runs it


def share_caches(data_dir: Path, shared: Path) -> None:
    """Link a server's compiled code and converted models to `shared`'s. In a data directory of its own each
    server converted the model and compiled the step again (about 2 minutes a server on 2 cores); what it
    measures does not change, only how long it takes to start. A run's servers start one after another;
    processes that share the caches otherwise (two runs at once, an `up` on the same directory) take turns
    as for any one data directory (a model is converted aside and renamed, torch locks its builds).
    Where `shared` cannot be written, the server keeps caches of its own."""
    for name in SHARED_CACHES:
        link = data_dir / name
        if link.exists() or link.is_symlink():
            continue
        source = (shared / name).resolve()
        try:
            source.mkdir(parents=True, exist_ok=True)
            link.symlink_to(source, target_is_directory=True)
        except OSError as exc:
            print(f"bench-serve: the server compiles on its own: {source} cannot be shared ({exc})", file=sys.stderr)


def _speculative(config: str) -> bool:
    return config != "batched_plain"


async def _measure(
    url: str, config: str, items: list[PromptItem], users: int, duration_s: float, settings: ServeBenchSettings
) -> Level:
    level = Level(config, users)
    before = await step_counters(url)
    started = time.monotonic()
    level.replies = await closed_loop(url, items, users, duration_s, settings.max_new_tokens, _speculative(config))
    level.elapsed_s = time.monotonic() - started
    after = await step_counters(url)
    level.steps = after.get("steps", 0) - before.get("steps", 0)
    if level.steps > 0:
        level.rows = after["rows"] - before["rows"]
        level.k_sum = after["k"] - before["k"]
    return level


LONG_PROMPT_IDS = range(20, 100)  # token ids every vocabulary here holds (the tiny test models have 112)


async def _long_prompt_case(url: str, config: str, items: list[PromptItem], settings: ServeBenchSettings) -> dict:
    """Short closed-loop users on one server for a window, twice: alone, then with one long prompt (token
    ids, `long_prompt_tokens` of them) sent a fifth of the way in. The figure is the short requests' p99
    time per output token: over the quiet window, and over the requests that were decoding while the long
    prompt was prefilled (sent before its first token, answered after it was sent). Chunked prefill
    (adaptive_spec/decoding/prefill.py) is what keeps the second near the first."""
    users = max(1, min(max(settings.concurrency), settings.max_batch - 1))  # a row left for the long prompt
    window = max(settings.duration_s / settings.rounds, 5.0)
    speculative = _speculative(config)
    ids = [LONG_PROMPT_IDS[i % len(LONG_PROMPT_IDS)] for i in range(settings.long_prompt_tokens)]

    async def long_one() -> Reply:
        await asyncio.sleep(window / 5)
        async with httpx.AsyncClient(timeout=3600) as client:
            model = await model_name(client, url)
            body = {"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0.0, "stream": True}
            body |= {"stream_options": {"include_usage": True}, "adaptive_spec": {"speculative": speculative}}
            return await streamed(client, url + "/v1/completions", body, -1)

    quiet = await closed_loop(url, items, users, window, settings.max_new_tokens, speculative)
    busy, long = await asyncio.gather(
        closed_loop(url, items, users, window, settings.max_new_tokens, speculative), long_one()
    )
    prefilled_by = long.sent + (long.ttft_s if long.ttft_s is not None else long.latency_s)
    during = [r for r in busy if r.sent < prefilled_by and r.sent + r.latency_s > long.sent]
    return {
        "config": config,
        "users": users,
        "prompt_tokens": settings.long_prompt_tokens,
        "status": long.status,
        "error": long.error or None,
        "ttft_s": _round(long.ttft_s if long.ttft_s is not None else math.nan),
        "short_requests_during": len(during),
        "short_tpot_p99_s_quiet": _round(percentile(tpots_of(quiet), 99)),
        "short_tpot_p99_s_during": _round(percentile(tpots_of(during), 99)),
        "short_errors": sum(r.status != 200 for r in quiet + busy),
    }


def run_line(run: dict) -> str:
    """One configuration at one concurrency, as a line of the report."""

    def fmt(value, spec):
        return "-" if value is None else format(value, spec)

    return (
        f"{run['config']:<20} {run['concurrency']:>3} users  {fmt(run['output_tok_s'], '8.1f')} tok/s  "
        f"{fmt(run['requests_per_s'], '6.2f')} req/s  latency p50 {fmt(run['latency_p50_s'], '6.2f')} s "
        f"p99 {fmt(run['latency_p99_s'], '6.2f')} s  ttft p50 {fmt(run['ttft_p50_s'], '5.3f')} s  "
        f"tpot {fmt(run['tpot_s'], '6.4f')} s  k {fmt(run['k'], '4.2f')}  batch {fmt(run['batch_size'], '4.2f')}  "
        f"errors {run['errors']}  identical {run['identical']}"
    )
