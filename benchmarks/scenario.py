"""`adaptive-spec bench-drift --scenario`: traffic that moves between domains, watched live.

    adaptive-spec bench-drift --scenario python:600,sql:600,python:300,mix:600 --json drift.json --plot drift.png
    adaptive-spec bench-drift --scenario my-traffic.jsonl:300,chat:300 --concurrency 2
    adaptive-spec bench-drift --scenario sql:600,python:300 --start-version 3   # warm: a distilled version

A phase is `NAME:SECONDS`: a shipped prompt set, a JSONL prompt file (its stem names the phase), or
`mix` (every set the scenario names). Each set's first `eval_prompts` prompts (after a seeded
shuffle) are held out and never served.

Started here and stopped by pid: a new redis-server on loopback (records never reach a production
stream), MLflow on sqlite in a temporary directory, the **adaptive** server (logging records, its
watcher polling every second) with `adaptive-spec train` beside it, and the **static** server (the
base draft, no Redis, no registry). Every prompt goes to both, in alternating order, with dynamic k.
With a start version (`start_adapter`: a version's directory, `adaptive-spec distill` makes one) the run
starts warm: the version is registered as the champion of the run's own registry, so the adaptive
server serves it from its first request and the trainer trains on from it, and the static server serves
the same version frozen (what a team that only trains offline runs).
The servers decode on all cores but one and the trainer on the last: with both on 2 cores beside
the trainer, OpenMP's workers waited on a preempted sibling at every step (92 adaptive requests in
20 minutes of the first full run).

The figures (`summarize`; JSON keys in DESIGN.md; a run in the README): live windows per server;
per phase its times, plateau (last third), `recover_s` (to 80% of it), held-out and static
acceptance, `return_ratio` (first 60 s back over the last plateau); `overall` per server, with
`target_alone_ratio` (the processes' own speed ratio); `first_promotion_s`; `identical`. A
benchmark, not a test: the figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from adaptive_spec.contracts import MLFLOW_TRACKING_URI_ENV, REDIS_URL_ENV, sqlite_tracking_uri
from adaptive_spec.options import ModelOptions
from adaptive_spec.outputs.prompts import PromptItem, load_prompts
from benchmarks.drift import promote_start, run_registry, split_prompts
from benchmarks.prompts import prompt_source
from benchmarks.scenario_figures import Reply, acceptance, summarize, tok_s, window_figures
from benchmarks.serve import ServeBenchSettings, child_env, served
from benchmarks.serve_clients import reply_text
from launch.processes import Child
from launch.redis import started_server
from service.stats_queries import ratio
from trainer.settings import TrainerSettings

MIX = "mix"
TRAINER_START_TIMEOUT_S = 600.0
SERVED_NAME = "scenario"  # the model name both servers answer to (ADAPTIVE_SPEC_SERVED_MODEL_NAME)


@dataclass(frozen=True)
class Phase:
    name: str  # a shipped set, a prompt file's stem, or "mix"
    source: Path | None  # the prompt file; None for mix
    seconds: float


def parse_scenario(text: str) -> list[Phase]:
    """`python:600,sql:600,mix:300` -> phases; ValueError names the part that is wrong."""
    phases = []
    for part in (p.strip() for p in text.split(",")):
        name, sep, seconds = part.rpartition(":")
        if not sep or not name:
            raise ValueError(f"--scenario: {part!r} is not NAME:SECONDS (for example python:600)")
        try:
            duration = float(seconds)
        except ValueError:
            raise ValueError(f"--scenario: {part!r}: {seconds!r} is not a number of seconds") from None
        if not duration > 0:
            raise ValueError(f"--scenario: {part!r}: the duration must be positive")
        source = None if name == MIX else prompt_source(name)
        phases.append(Phase(name if source is None or not source.suffix else source.stem, source, duration))
    if all(phase.source is None for phase in phases):
        raise ValueError("--scenario: mix draws from the other phases' prompt sets; name at least one")
    return phases


@dataclass(frozen=True)
class ScenarioSettings(ModelOptions):
    """The model options of both servers and the trainer (k None: dynamic k), then the scenario's own."""

    phases: tuple[Phase, ...] = ()
    concurrency: int = 1
    max_new_tokens: int = 64
    eval_prompts: int = 8
    window_s: float = 30.0
    seed: int = 0
    max_batch: int = 8
    max_domains: int = 8  # the trainer's --max-domains; 0: one general adapter (the mix comparison)
    trainer_args: tuple[str, ...] = ("--min-new-records", "8")  # more `adaptive-spec train` flags
    start_adapter: Path | None = None  # a version's directory: both servers start from it, the static one frozen
    start_version: str | None = None  # its name, for the report (bench-drift --start-version)
    cli: tuple[str, ...] = (sys.executable, "-m", "cli")


@dataclass
class PromptSet:
    heldout: list[PromptItem]
    traffic: list[PromptItem]
    reference: list[str] = field(default_factory=list)  # the target alone on the held-out prompts


def run_scenario(settings: ScenarioSettings, log: Callable[[str], None] = print) -> dict:
    """Run the phases against an adaptive and a static server; the figures as a dict."""
    sets = _prompt_sets(settings)
    traffic = [_traffic_of(phase, sets, settings.seed) for phase in settings.phases]
    with tempfile.TemporaryDirectory(prefix="adaptive-spec-scenario-") as work, ExitStack() as stack:
        work = Path(work)
        (work / "redis").mkdir()
        redis = started_server(work / "redis")
        stack.callback(redis.stop)
        data = work / "adaptive"
        shared = {REDIS_URL_ENV: redis.url, MLFLOW_TRACKING_URI_ENV: sqlite_tracking_uri(data)}
        serve = ServeBenchSettings(**vars(settings.models), concurrency=(settings.concurrency,), cli=settings.cli)
        start = None if settings.start_adapter is None else _register_start(settings.start_adapter, data)
        both = {  # the two servers' environment: all cores but the trainer's, one model name
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) - 1)),
            "ADAPTIVE_SPEC_SERVED_MODEL_NAME": SERVED_NAME,
        }
        urls = {
            "adaptive": stack.enter_context(
                served(
                    serve,
                    settings.max_batch,
                    data,
                    log,
                    extra_env={**shared, **both, "ADAPTIVE_SPEC_ADAPTER_POLL_S": "1"},
                )
            ),
            "static": stack.enter_context(
                served(_frozen(serve, settings.start_adapter), settings.max_batch, work / "static", log, extra_env=both)
            ),
        }
        stack.enter_context(_trainer(settings, data, shared, log))
        alone: dict[str, list[Reply]] = {"adaptive": [], "static": []}  # the target alone on each server
        for name, prompt_set in sets.items():
            log(f"reference: the target alone on {len(prompt_set.heldout)} held-out prompts of {name}, both servers")
            for server in ("static", "adaptive"):
                alone[server] += asyncio.run(_once(urls[server], prompt_set.heldout, settings, False))
            prompt_set.reference = [r.text for r in alone["static"][-len(prompt_set.heldout) :]]
        wall_start, started = time.time(), time.monotonic()
        replies: list[Reply] = []
        phases = []
        for index, (phase, items) in enumerate(zip(settings.phases, traffic, strict=True)):
            start_s = time.monotonic() - started
            log(f"phase {index + 1}/{len(settings.phases)}: {phase.name} for {phase.seconds:.0f} s")
            replies += asyncio.run(_live(urls, items, index, phase.seconds, started, settings, log))
            end_s = time.monotonic() - started
            heldout = _heldout_of(phase, sets)
            figures = {
                server: asyncio.run(_once(urls[server], [item for item, _ in heldout], settings, True))
                for server in ("adaptive", "static")
            }
            phases.append(
                {
                    "name": phase.name,
                    "start_s": round(start_s, 1),
                    "end_s": round(end_s, 1),
                    "heldout_acceptance": acceptance(figures["adaptive"]),
                    "heldout_static_acceptance": acceptance(figures["static"]),
                    "heldout_identical": all(
                        reply.text == reference
                        for reply, (_, reference) in zip(figures["adaptive"], heldout, strict=True)
                    ),
                }
            )
            log(
                f"  held-out acceptance: adaptive {_fmt(phases[-1]['heldout_acceptance'])}, "
                f"static {_fmt(phases[-1]['heldout_static_acceptance'])}"
            )
        events = _events(urls["adaptive"], wall_start)
    result = summarize(settings, phases, replies, events, start=start)
    # Two server processes differ in speed on their own (each calibrates its CPU kernels at start);
    # their ratio with the target alone on the same prompts says how much of `speedup` is that.
    process_ratio = ratio(tok_s(alone["adaptive"]), tok_s(alone["static"]))
    result["overall"]["target_alone_ratio"] = process_ratio
    result["overall"]["speedup_net_of_processes"] = ratio(result["overall"]["speedup"], process_ratio)
    result["identical"] = result["identical"] and [r.text for r in alone["adaptive"]] == [
        r.text for r in alone["static"]
    ]
    return result


# ---------------------------------------------------------------------------------------- prompts


def _prompt_sets(settings: ScenarioSettings) -> dict[str, PromptSet]:
    sets = {}
    for phase in settings.phases:
        if phase.source is not None and phase.name not in sets:
            heldout, traffic = split_prompts(load_prompts(phase.source), settings.eval_prompts, settings.seed)
            sets[phase.name] = PromptSet(heldout, traffic)
    return sets


def _traffic_of(phase: Phase, sets: dict[str, PromptSet], seed: int) -> list[PromptItem]:
    """The phase's traffic in a seeded order; mix interleaves every set's."""
    if phase.source is not None:
        items = list(sets[phase.name].traffic)
    else:
        items = [item for group in itertools.zip_longest(*(s.traffic for s in sets.values())) for item in group if item]
    random.Random(f"{seed}:{phase.name}").shuffle(items)
    return items


def _heldout_of(phase: Phase, sets: dict[str, PromptSet]) -> list[tuple[PromptItem, str]]:
    chosen = [sets[phase.name]] if phase.source is not None else list(sets.values())
    return [pair for s in chosen for pair in zip(s.heldout, s.reference, strict=True)]


# ---------------------------------------------------------------------------------------- processes


def _register_start(adapter_dir: Path, data_dir: Path) -> str:
    """The start version as the adaptive run's champion (drift.py `promote_start`); its version there."""
    registry = run_registry(data_dir)
    try:
        return promote_start(registry, adapter_dir)
    finally:
        registry.close()


def _frozen(serve: ServeBenchSettings, adapter_dir: Path | None) -> ServeBenchSettings:
    """The static server's settings: the base draft, or the start version served as it is (no registry)."""
    return serve if adapter_dir is None else dataclasses.replace(serve, adapter=str(adapter_dir))


@contextmanager
def _trainer(settings: ScenarioSettings, data_dir: Path, env_extra: dict[str, str], log: Callable[[str], None]):
    """`adaptive-spec train` on the adaptive server's Redis and MLflow, until the scenario ends."""
    train = TrainerSettings(**vars(settings.models), data_dir=data_dir, threads=1, max_domains=settings.max_domains)
    command = [*settings.cli, "train", *train.argv(), "--redis-url", env_extra[REDIS_URL_ENV], *settings.trainer_args]
    trainer = Child(command, data_dir / "trainer.log", env=child_env(env_extra))
    log(f"starting the trainer (log: {trainer.log_path})")
    trainer.start()
    try:
        trainer.wait_until(lambda: "online trainer" in trainer.log(), TRAINER_START_TIMEOUT_S, "the trainer's start")
        yield trainer
    finally:
        trainer.stop(120)  # a round under way finishes and checkpoints first


# ---------------------------------------------------------------------------------------- clients


def _body(item: PromptItem, max_tokens: int, speculative: bool, log_record: bool) -> tuple[str, dict]:
    body = {
        "model": SERVED_NAME,
        "max_tokens": max_tokens,
        "temperature": 0,
        "adaptive_spec": {"speculative": speculative, "log": log_record},
    }
    body |= item.request_fields()  # response_format, tools, tool_choice
    if item.domain:
        body["adaptive_spec"]["domain"] = item.domain
    if isinstance(item.prompt, str):
        return "/v1/completions", {**body, "prompt": item.prompt}
    return "/v1/chat/completions", {**body, "messages": item.prompt}


async def _ask(
    client: httpx.AsyncClient,
    url: str,
    item: PromptItem,
    settings: ScenarioSettings,
    *,
    speculative: bool = True,
    log_record: bool = False,
) -> tuple[dict, float]:
    path, body = _body(item, settings.max_new_tokens, speculative, log_record)
    sent = time.monotonic()
    reply = (await client.post(url + path, json=body)).raise_for_status().json()
    return reply, time.monotonic() - sent


def _reply(server: str, phase: int, prompt: int, end_s: float, body: dict, latency_s: float) -> Reply:
    choice = body["choices"][0]
    spec = body["usage"].get("spec_decode") or {}
    tokens = body["usage"]["completion_tokens"]
    length = spec.get("mean_acceptance_length")
    return Reply(
        server,
        phase,
        prompt,
        end_s,
        latency_s,
        tokens,
        tokens / length if length else 0.0,
        spec.get("num_draft_tokens", 0),
        spec.get("num_accepted_tokens", 0),
        spec.get("adapter_version"),
        reply_text(choice["message"]) if "message" in choice else choice["text"],
    )


async def _live(
    urls: dict[str, str],
    items: list[PromptItem],
    phase: int,
    seconds: float,
    started: float,
    settings: ScenarioSettings,
    log: Callable[[str], None],
) -> list[Reply]:
    """`concurrency` users for `seconds`: each sends a prompt to the adaptive server, then to the static one."""
    deadline = time.monotonic() + seconds
    order = itertools.count()
    replies: list[Reply] = []

    async def user(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            index = next(order)
            item = items[index % len(items)]
            # Turns alternate: the trainer's rounds start when the adaptive server's records arrive, so a
            # fixed order would always put them on the static server's turn.
            for server in ("adaptive", "static") if index % 2 == 0 else ("static", "adaptive"):
                body, latency = await _ask(client, urls[server], item, settings, log_record=server == "adaptive")
                replies.append(_reply(server, phase, index, time.monotonic() - started, body, latency))
                _progress(replies, settings, log)

    async with httpx.AsyncClient(timeout=3600) as client:
        await asyncio.gather(*(user(client) for _ in range(settings.concurrency)))
    return replies


async def _once(url: str, items: list[PromptItem], settings: ScenarioSettings, speculative: bool) -> list[Reply]:
    """Each prompt once, one at a time, not logged (held-out prompts never reach the trainer)."""
    async with httpx.AsyncClient(timeout=3600) as client:
        out = []
        for i, item in enumerate(items):
            body, latency = await _ask(client, url, item, settings, speculative=speculative)
            out.append(_reply("", -1, i, 0.0, body, latency))
        return out


def _events(url: str, since: float) -> list[dict]:
    """The adaptive server's swap and rollback markers, in seconds since the traffic began."""
    found = httpx.get(url + "/api/stats/events", params={"from": since - 60}, timeout=30).raise_for_status().json()
    return [{**event, "t_s": round(event["t"] - since, 1)} for event in found["events"]]


def _progress(replies: list[Reply], settings: ScenarioSettings, log: Callable[[str], None]) -> None:
    """A line per window of live traffic, when the first reply of the next window comes in."""
    window = settings.window_s
    current = int(replies[-1].end_s // window)
    if len(replies) < 2 or int(replies[-2].end_s // window) == current:
        return
    done = [r for r in replies if int(r.end_s // window) == current - 1]
    figures = {s: window_figures(done, s) for s in ("adaptive", "static")}
    versions = sorted({str(r.adapter_version) for r in done if r.server == "adaptive"})
    log(
        f"  {current * window:6.0f} s: acceptance adaptive {_fmt(figures['adaptive']['acceptance'])} "
        f"(adapter {', '.join(versions) or '-'}), static {_fmt(figures['static']['acceptance'])}; "
        f"mean acceptance length {_fmt(figures['adaptive']['mean_acceptance_length'])} vs "
        f"{_fmt(figures['static']['mean_acceptance_length'])}"
    )


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
