"""`adaptive-spec bench-drift`: acceptance and speed on a domain before and after online training.

    adaptive-spec bench-drift --domain json_extraction --budget-minutes 30 --json drift.json
    adaptive-spec bench-drift --domain sql --budget-minutes 8 --eval-prompts 8    # a quick look

The run, within `--budget-minutes` in all:

1. Split the domain's prompts (a shipped set, or `--prompts FILE.jsonl`) into held-out
   evaluation prompts and traffic prompts, deterministically. Evaluation prompts are never
   served as traffic, so nothing is trained on them.
2. Before: on the evaluation prompts, time the target alone and speculative decoding with the
   starting draft, interleaved (`bench.run_bench` without the HF paths). The starting draft is the
   base draft, or with `--start-version` a version `adaptive-spec distill` made (a deployment that
   starts warm): it is registered and promoted in the run's own registry (MLflow on sqlite in the
   run's directory), served from the first measurement, and the trainer adopts it as the champion it
   trains from and gates against, as a server's trainer adopts the registry's champion.
3. Traffic: serve the traffic prompts through the engine, each leaving a correction record in a
   real Redis stream (a loopback redis-server is started unless REDIS_URL is set). Meanwhile
   an `OnlineTrainer` consumes the stream through its consumer group, trains a LoRA adapter
   on its own copy of the draft, gates each candidate on its held-out records, and every
   promoted adapter is loaded into the serving engine at once.
4. After: the same measurement as 2, with the last promoted adapter; then, for each `--after-k`,
   the same again at that fixed k (`after_fixed_k` in the figures), so one run shows what the
   adapter gives at every depth.
5. Draft cost: one draft forward with that adapter as a fraction of a one-token target forward
   (`draft_step_fraction`), timed side by side on a few held-out prompts (draft_cost.py).

While the traffic runs, the acceptance of what it drafted is kept in windows of `window_s` seconds
since training started (`live`, with the promotions in `promoted_s`): the learning curve that
`--compare-drafts` plots per draft (compare.py).

Traffic and training share the machine: each gets one torch thread during phase 3; the two
measurements use all threads, with the trainer stopped, so before and after are comparable.
"""

from __future__ import annotations

import logging
import math
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import redis
import torch
from tqdm import tqdm

from adaptive_spec.contracts import CORRECTION_STREAM, PENDING_FILE, REDIS_URL_ENV, sqlite_tracking_uri
from adaptive_spec.drafters.spec import DraftSpecError, parse_draft_spec
from adaptive_spec.engine import Engine
from adaptive_spec.formats.stats import Totals
from adaptive_spec.outputs.prompts import PromptItem, encode_item
from benchmarks.bench import depths, run_bench
from benchmarks.draft_cost import COST_K, measure_draft_cost
from registry.client import AdapterRegistry
from service.correction_log import CorrectionLogWriter
from trainer.intake.stream import CorrectionStream
from trainer.learning.drafts import TARGET_DRAFTS
from trainer.process.build import build_trainer, lendable, load_draft
from trainer.promotion.champion import RegistryChampion
from trainer.promotion.pending import PendingRegistrations
from trainer.settings import TrainerSettings

log = logging.getLogger(__name__)

PHASE_KEYS = (
    "acceptance_rate",
    "mean_acceptance_length",
    "tokens_verified_per_step",
    "acceptance_by_depth",
    "speedup_vs_target",
    "identical",
)


@dataclass
class DriftBenchSettings:
    budget_minutes: float = 30.0
    eval_prompts: int = 24
    max_new_tokens: int = 64  # of each held-out measurement
    # of each traffic answer, what the trainer learns from (None: max_new_tokens). Answers longer than the
    # measurement's make more records of the same prompts: at 64 tokens the 376 traffic prompts of a shipped
    # domain run out after 5-7 of the budget's 30 minutes on the fast path, and the trainer then idles. At 256
    # the head was no better on python or stdlib (docs/benchmarks.md, "More text per record did not pay").
    traffic_new_tokens: int | None = None
    k: int | None = None
    # After the traffic ends the trainer may go on this long (None: until the budget's measurements are due),
    # and stops sooner once it has nothing left to try: no round due, its idle rounds exhausted
    # (trainer/loop/online.py OnlineSettings.idle_after_s). It used to be 120 s, with no idle rounds.
    train_tail_s: float | None = None
    seed: int = 0
    holdout_fraction: float = 0.2  # of traffic records, kept for the trainer's gate
    gate_min_positions: int = 128
    after_k: tuple[int, ...] = ()  # extra after-measurements at these fixed k
    cost_prompts: int = 4  # held-out prompts the draft cost is timed on, after training
    window_s: float = 30.0  # live acceptance windows of the traffic
    start_adapter: Path | None = None  # a version's directory to start warm from (step 2); None: the base draft
    start_version: str | None = None  # its name, for the report (bench-drift --start-version)


def split_prompts(items: list[PromptItem], eval_count: int, seed: int) -> tuple[list[PromptItem], list[PromptItem]]:
    """(held-out evaluation, traffic): a seeded shuffle, the first `eval_count` held out."""
    if len(items) < eval_count + 8:
        raise ValueError(
            f"need at least {eval_count + 8} prompts for {eval_count} held-out ones plus traffic, got {len(items)}"
        )
    order = list(items)
    random.Random(seed).shuffle(order)
    return order[:eval_count], order[eval_count:]


def run_drift(
    engine: Engine,
    items: list[PromptItem],
    domain: str,
    settings: DriftBenchSettings,
    redis_url: str,
    workdir: Path,
    progress: bool = True,
    stream_name: str | None = None,
) -> dict:
    """`stream_name`: the correction stream to use; by default the standard one on a private Redis, a fresh
    one (deleted at the end) when REDIS_URL names a shared server."""
    started = time.monotonic()
    deadline = started + settings.budget_minutes * 60
    draft = _draft_to_train(engine)
    held_out, traffic = split_prompts(items, settings.eval_prompts, settings.seed)
    warm = settings.start_adapter is not None
    registry = None
    if warm:  # a bad adapter, or another model's, stops the run here
        registry = run_registry(workdir)
        engine.load_adapter(settings.start_adapter, promote_start(registry, settings.start_adapter))

    measuring = time.monotonic()
    before = run_bench(
        engine, held_out, settings.max_new_tokens, settings.k, hf=False, progress=progress, desc="before"
    )
    eval_s = time.monotonic() - measuring
    # Leave room for the second measurement (it may run slower with a larger k), the draft cost's
    # pass (two generations per prompt, as the measurement) and the write-up.
    cost_share = min(settings.cost_prompts, len(held_out)) / len(held_out)
    traffic_deadline = deadline - 1.3 * eval_s * (1 + len(settings.after_k) + cost_share) - 15

    stream_name = stream_name or (
        CORRECTION_STREAM
        if os.environ.get(REDIS_URL_ENV) is None
        else f"{CORRECTION_STREAM}:drift-{uuid.uuid4().hex[:8]}"
    )
    writer = CorrectionLogWriter(redis_url, stream=stream_name)
    client = redis.Redis.from_url(redis_url)
    stream = CorrectionStream(client, stream=stream_name, consumer="bench-drift-trainer")
    stream.ensure_group()
    swaps: list[float] = []
    promoted_s: list[float] = []  # when each promoted adapter was served, in seconds since training started
    served_requests: list[tuple[float, int, int]] = []  # (seconds since training started, drafted, accepted)

    def promote(version) -> None:
        if pending is not None:
            pending.submit(version)
        swaps.append(engine.load_adapter(version.path, str(version.version)))
        promoted_s.append(time.monotonic() - training_started)

    # A benchmark sees minutes of traffic, not hours: a larger held-out share than a server's trainer
    # keeps, so the statistical gate has its first records sooner; the gate itself is the trainer's.
    # Warm, the trainer trains one general adapter from the start version, as distill does; else the traffic's
    # domain gets a lineage of its own (trainer/loop/domains.py), trained from the base draft.
    train = TrainerSettings(
        target=engine.target_id,
        draft=engine.draft_id,
        data_dir=workdir,
        gate_min_positions=settings.gate_min_positions,
        max_domains=0 if warm else TrainerSettings.max_domains,
    )
    pending = PendingRegistrations(registry, workdir / PENDING_FILE, by="bench-drift").start() if registry else None
    trainer = build_trainer(
        train,
        draft,
        stream,
        checkpoints=False,
        on_promote=promote,
        champion_source=None if registry is None else RegistryChampion(registry, pending),
        holdout_fraction=settings.holdout_fraction,
    )
    stop = threading.Event()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    worker = threading.Thread(target=_train, args=(trainer, stop, deadline), name="trainer", daemon=True)
    served = 0
    traffic_new_tokens = settings.traffic_new_tokens or settings.max_new_tokens
    engine.record_topk = 16
    unregistered = None
    try:
        if warm and not trainer.sync_registry():  # the start version: the champion it trains from
            raise ValueError(f"the trainer cannot train on from --start-version {settings.start_version}: see the log")
        training_started = time.monotonic()
        worker.start()
        bar = tqdm(traffic, desc="traffic", unit="prompt", disable=not progress, file=sys.stderr)
        for item in bar:
            if time.monotonic() > traffic_deadline:
                break
            ids, response_format = encode_item(item, engine)  # tools and forced calls as the server does
            out = engine.generate(ids, traffic_new_tokens, k=settings.k, response_format=response_format)
            writer.log(  # as the server logs a finished request
                out,
                request_id=uuid.uuid4().hex,
                domain=item.domain or domain,
                target_id=engine.target_id,
                draft_id=engine.draft_id,
                temperature=0.0,
            )
            served += 1
            served_requests.append((time.monotonic() - training_started, out.stats.drafted, out.stats.accepted))
            bar.set_postfix(
                adapter=engine.adapter_version or "base",
                promoted=trainer.adapters_promoted,
                consumed=trainer.records_consumed,
            )
        tail = math.inf if settings.train_tail_s is None else settings.train_tail_s
        tail_end = min(time.monotonic() + tail, traffic_deadline)
        while time.monotonic() < tail_end and worker.is_alive() and not trainer.nothing_to_train:
            time.sleep(1.0)
    finally:
        engine.record_topk = 0
        stop.set()
        if worker.ident is not None:
            worker.join()
        torch.set_num_threads(threads)
        writer.close(timeout=5)
        if stream_name != CORRECTION_STREAM:
            client.delete(stream_name)
        client.close()
        if pending is not None:
            unregistered = pending.stop(timeout=30.0)
            registry.close()

    after = run_bench(engine, held_out, settings.max_new_tokens, settings.k, hf=False, progress=progress, desc="after")
    fixed = {
        k: run_bench(engine, held_out, settings.max_new_tokens, k, hf=False, progress=progress, desc=f"after, k={k}")
        for k in settings.after_k
    }
    cost_prompts = [encode_item(item, engine)[0] for item in held_out[: settings.cost_prompts]]
    cost = measure_draft_cost(engine, cost_prompts, settings.max_new_tokens, settings.k or COST_K)
    return {
        "domain": domain,
        "before": {key: before[key] for key in PHASE_KEYS} | _extras(before),
        "after": {key: after[key] for key in PHASE_KEYS} | _extras(after),
        "after_fixed_k": {str(k): {key: f[key] for key in PHASE_KEYS} | _extras(f) for k, f in fixed.items()},
        "records_consumed": trainer.records_consumed,
        "tokens_consumed": trainer.tokens_consumed,
        "train_s": trainer.train_s,
        "adapters_promoted": trainer.adapters_promoted,
        "budget_minutes": settings.budget_minutes,
        "elapsed_minutes": (time.monotonic() - started) / 60,
        "traffic_prompts_served": served,
        "eval_prompts": len(held_out),
        "adapter_version": engine.adapter_version,
        "swap_pause_ms_max": max(swaps) * 1000 if swaps else None,
        "records_written": writer.written,
        "records_dropped": writer.dropped,
        "target": engine.target_id,
        "draft": engine.draft_id,
        "k": settings.k if settings.k is not None else "dynamic",
        "max_new_tokens": settings.max_new_tokens,
        "traffic_new_tokens": traffic_new_tokens,
        **cost,
        "live": live_windows(served_requests, settings.window_s),
        "window_s": settings.window_s,
        "promoted_s": promoted_s,
        "start_version": settings.start_version,
        "versions_not_registered": unregistered,  # warm: still queued for the run's registry at the end
        "adoptions": trainer.champion.adoptions,
    }


def live_windows(served: list[tuple[float, int, int]], window_s: float) -> list[dict]:
    """Traffic requests, (finished at t seconds, drafted, accepted), pooled into windows of `window_s`:
    each window's acceptance is accepted / drafted over its requests (None when it drafted nothing),
    placed at the window's end. Requests at 3, 20 and 40 s with 30 s windows: two windows, at 30
    and 60 s."""
    windows: dict[int, list[int]] = {}
    for t, drafted, accepted in served:
        window = windows.setdefault(int(t // window_s), [0, 0, 0])
        window[0] += 1
        window[1] += drafted
        window[2] += accepted
    return [
        {
            "t_s": (index + 1) * window_s,
            "requests": requests,
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": Totals(drafted, accepted).acceptance_rate,
        }
        for index, (requests, drafted, accepted) in sorted(windows.items())
    ]


def run_registry(data_dir: Path) -> AdapterRegistry:
    """A run's own registry: MLflow on sqlite in `data_dir`."""
    data_dir.mkdir(parents=True, exist_ok=True)
    return AdapterRegistry(sqlite_tracking_uri(data_dir), data_dir=data_dir)


def promote_start(registry: AdapterRegistry, adapter_dir: Path) -> str:
    """The start version registered and promoted to the general champion, whatever domain the adapter was
    trained for (what every request drafts with), before a server or trainer starts on `registry`: a server's
    watcher serves the champion from the first request, a trainer adopts it as the champion it trains from.
    Returns its version there."""
    version = registry.register(adapter_dir, by="bench-drift", promote=False)
    registry.promote(version, by="bench-drift")
    return version


def _extras(figures: dict) -> dict:
    return {
        key: figures[key]
        for key in ("target_tok_s", "spec_tok_s", "drafted", "accepted", "free_drafted", "free_accepted")
    }


def _train(trainer, stop: threading.Event, deadline: float) -> None:
    torch.set_num_threads(1)
    try:
        trainer.run(stop, budget_s=max(0.0, deadline - time.monotonic()))
    except Exception:  # a dead trainer must not take the serving side with it; the figures will show it
        log.exception("trainer stopped with an error")


def _draft_to_train(engine):
    """The trainer's draft: an early-exit draft or a head (ngram+ as well), over the engine's target when it
    serves in the trainer's dtype, else over one of the trainer's own (build.lendable)."""
    if parse_draft_spec(engine.draft_id).kind not in TARGET_DRAFTS:
        raise DraftSpecError(f"bench-drift trains early-exit:N and head drafts; got draft {engine.draft_id!r}")
    settings = TrainerSettings(target=engine.target_id, draft=engine.draft_id)
    return load_draft(settings, target=lendable(engine.target, settings))[0]


def format_report(figures: dict) -> str:
    b, a = figures["before"], figures["after"]

    def f(value, fmt=".3f"):
        return "n/a" if value is None else format(value, fmt)

    return "\n".join(
        [
            f"domain {figures['domain']}: {figures['traffic_prompts_served']} traffic prompts served, "
            f"{figures['records_consumed']} records ({figures['tokens_consumed']} tokens) consumed, "
            f"{figures['adapters_promoted']} adapters promoted, {figures['train_s']:.0f} s training, "
            f"{figures['elapsed_minutes']:.1f} of {figures['budget_minutes']:g} minutes",
            *(
                [f"started warm from --start-version {figures['start_version']}"]
                if figures.get("start_version")
                else []
            ),
            f"                       before    after   (held-out prompts: {figures['eval_prompts']}, "
            f"{figures['max_new_tokens']} new tokens; traffic answers {figures.get('traffic_new_tokens', '?')})",
            f"  acceptance rate        {f(b['acceptance_rate'])}    {f(a['acceptance_rate'])}",
            f"  mean acceptance length {f(b['mean_acceptance_length'], '.2f')}     {f(a['mean_acceptance_length'], '.2f')}",
            f"  tokens verified/step   {f(b['tokens_verified_per_step'], '.2f')}     {f(a['tokens_verified_per_step'], '.2f')}",
            f"  speedup vs target      {f(b['speedup_vs_target'], '.2f')}x    {f(a['speedup_vs_target'], '.2f')}x",
            f"  acceptance by depth    before {depths(b['acceptance_by_depth'])}",
            f"                         after  {depths(a['acceptance_by_depth'])}",
            f"  identical to target    {b['identical']}     {a['identical']}",
            *(
                [f"  {figures['versions_not_registered']} promoted versions still queued for the run's registry"]
                if figures.get("versions_not_registered")
                else []
            ),
            f"  draft step / target step {f(figures['draft_step_fraction'])} after training "
            f"({f(figures['draft_step_ms'], '.2f')} / {f(figures['target_step_ms'], '.2f')} ms medians, "
            f"timed side by side at k={figures['cost_k']})",
            *(
                f"  after at fixed k={k}: acceptance rate {f(x['acceptance_rate'])}, mean acceptance length "
                f"{f(x['mean_acceptance_length'], '.2f')}, speedup {f(x['speedup_vs_target'], '.2f')}x, "
                f"identical {x['identical']}"
                for k, x in figures.get("after_fixed_k", {}).items()
            ),
        ]
    )


def temporary_workdir(data_dir: Path) -> Path:
    data_dir.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="bench-drift-", dir=data_dir))
