"""How many correction records per second one online trainer consumes on this machine: how many replicas one trainer keeps up with.

    adaptive-spec bench-intake --records 2000 --json intake.json   # the default model, ~4 min
    # small CPU variant (a local tiny model directory, a few seconds):
    adaptive-spec bench-intake --target ./tiny --draft early-exit:1 --records 48 \\
        --prompt-tokens 8,16 --output-tokens 24 --topk 8 --loop-minutes 0.5

A loopback redis-server is started (or REDIS_URL is used, with a stream of its own, deleted at the
end) and the correction stream is filled with `--records` synthetic records of real shape, through
the server's own writer (service/correction_log.py): a prompt of 100-200 tokens, 64 output tokens,
the target's top-16 log-probabilities at each (the server's `record_topk`), token ids within the
model's vocabulary, greedy and untagged, drafted k = 4 at a time with half the draft tokens
accepted. Only the shape is real: no model served them. With the default model a record is about
4.8 kB. Then, side by side on the same records (two consumer groups of one stream):

1. Intake alone: an `OnlineTrainer` as `adaptive-spec train` assembles it (trainer/process/main.py), with
   its checkpoint directory, but a `min_new_records` no backlog reaches, so no round runs. Its loop
   polls (decode, route into the held-out set or the replay buffer) until the group has read every
   entry, then writes its last checkpoint, which acknowledges them. `intake_records_s` = records /
   seconds from the first poll until every entry is read and acknowledged (the group's entries-read
   == records, pending == 0, and XACK acknowledged each entry exactly once).
2. The trainer loop: a second `OnlineTrainer` with every default of `adaptive-spec train` (16 new
   records per round, 20 steps per round, the statistical gate, checkpoints every 30 s, promotions
   registered in an MLflow registry of its own) runs for `--loop-minutes` or until every entry is
   read. `loop_records_s` = records consumed / seconds, training rounds included; `rounds`,
   `round_s` (the mean wall time of a round: steps, gate and promotion) and `round_train_s` (its
   optimiser steps).

How to read it: with a backlog, each pass of the trainer's loop reads up to `read_count` (64)
entries and then trains one round, so loop_records_s is about 64 / round_s. That is the most
traffic one trainer keeps up with while it trains; example: 2.5 records/s and replicas that each
finish 0.5 requests/s (one record each) -> one trainer keeps up with 5 replicas. Traffic beyond
that waits in the stream (MAXLEN ~100000, then the oldest records are trimmed unread);
intake_records_s is the ceiling a trainer that reads and never trains would reach.

Deliberate differences from `adaptive-spec train`: no leader lease (one trainer, and on a shared
Redis a real trainer's lease must not be touched); the registry is a sqlite file in a temporary
directory, opened before the clock starts, whatever MLFLOW_TRACKING_URI says, and its promotions
publish no adapter events (they would reach real replicas); the trainer status key the dashboard
reads is not written; an idle poll waits 10 ms instead of 1 s, so that a part ends as soon as
every entry is read. Load averages (os.getloadavg) at the start and the end say whether other work
shared the machine.

Test (tiny random model, a real redis-server): `OMP_NUM_THREADS=1 .venv/bin/python -m pytest
tests/benchmarks/test_bench_intake.py -x -q`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import redis
import torch

from adaptive_spec.contracts import (
    CORRECTION_STREAM,
    PENDING_FILE,
    REDIS_URL_ENV,
    TRAINER_GROUP,
    sqlite_tracking_uri,
)
from adaptive_spec.models import resolve_device, resolve_dtype
from benchmarks.settings import IntakeBenchSettings
from benchmarks.synthetic import fill_stream, synthetic_record
from launch.redis import started_server
from registry.client import AdapterRegistry
from trainer.intake.stream import CorrectionStream
from trainer.loop.online import OnlineSettings, OnlineTrainer
from trainer.loop.status import TrainerStatus
from trainer.process.build import build_trainer, load_draft
from trainer.promotion.champion import RegistryChampion
from trainer.promotion.pending import PendingRegistrations
from trainer.settings import TrainerSettings

log = logging.getLogger(__name__)

IDLE_POLL_MS = 10  # a poll that finds nothing new waits this long (the trainer's 1 s would pad each part)


# ---------------------------------------------------------------- the two measurements


class _CountedStream(CorrectionStream):
    """A CorrectionStream that adds up what XACK acknowledged. XACK of an entry that is no longer
    pending returns 0, so `acknowledged` == records and pending == 0 mean each entry was acknowledged once."""

    acknowledged = 0

    def ack(self, ids) -> int:
        acknowledged = super().ack(ids)
        self.acknowledged += acknowledged
        return acknowledged


class _TimedTrainer(OnlineTrainer):
    """The OnlineTrainer, keeping the wall time of every round it trains (steps, gate and promotion)."""

    def __init__(self, *args, **kwargs) -> None:
        self.round_seconds: list[float] = []
        super().__init__(*args, **kwargs)

    def train_round(self, lineage=None, keep_training=None):
        started = time.perf_counter()
        result = super().train_round(lineage, keep_training)
        if result.trained:
            self.round_seconds.append(time.perf_counter() - started)
        return result


def group_info(client: redis.Redis, stream: str, group: str) -> dict:
    """XINFO GROUPS for one group: {"entries-read": ..., "pending": ..., ...}."""
    for info in client.xinfo_groups(stream):
        name = info["name"]
        if (name.decode() if isinstance(name, bytes) else name) == group:
            return info
    raise LookupError(f"no consumer group {group} on {stream}")


def _stop_when_read(client: redis.Redis, stream: str, group: str, records: int, stop: threading.Event) -> None:
    """Set `stop` once the group has read `records` entries (or someone else set it); on an error too,
    so that a part never waits for entries it can no longer count."""
    try:
        while not stop.wait(0.02):
            if (group_info(client, stream, group).get("entries-read") or 0) >= records:
                stop.set()
    except (redis.RedisError, LookupError):
        log.exception("cannot read the consumer group's progress; stopping the trainer")
        stop.set()


def _consume(
    trainer: OnlineTrainer, client: redis.Redis, records: int, budget_s: float | None, checkpoint_every_s: float
) -> float:
    """Run the trainer's loop until every entry is read (or `budget_s` is spent); returns its seconds,
    its last checkpoint (the acknowledgement) included."""
    stream = trainer.stream
    stop = threading.Event()
    watcher = threading.Thread(
        target=_stop_when_read, args=(client, stream.stream, stream.group, records, stop), daemon=True
    )
    watcher.start()
    started = time.perf_counter()
    try:
        trainer.run(stop, budget_s=budget_s, checkpoint_every_s=checkpoint_every_s, poll_block_ms=IDLE_POLL_MS)
    finally:
        elapsed = time.perf_counter() - started
        stop.set()
        watcher.join()
    return elapsed


def _after(client: redis.Redis, stream: CorrectionStream) -> dict:
    info = group_info(client, stream.stream, stream.group)
    return {"entries_read": info.get("entries-read"), "pending": info["pending"], "acknowledged": stream.acknowledged}


def measure_intake(
    draft: torch.nn.Module, client: redis.Redis, stream_name: str, train: TrainerSettings, workdir: Path, records: int
) -> dict:
    """Part 1: the trainer's loop with no rounds, until every entry is read and acknowledged."""
    stream = _CountedStream(client, stream=stream_name, group=f"{TRAINER_GROUP}-intake-alone", consumer="intake")
    never = records + 1  # new training records for a round: no round starts
    trainer = build_trainer(
        dataclasses.replace(train, data_dir=workdir / "intake"), draft, stream, min_new_records=never
    )
    trainer.status = TrainerStatus(None, stream.consumer)
    seconds = _consume(trainer, client, records, None, train.checkpoint_every_s)
    return {"intake_s": seconds, "intake_records": trainer.records_consumed, "intake_rounds": trainer.rounds} | {
        f"intake_{key}": value for key, value in _after(client, stream).items()
    }


def measure_loop(
    draft: torch.nn.Module,
    client: redis.Redis,
    stream_name: str,
    train: TrainerSettings,
    workdir: Path,
    records: int,
    budget_s: float,
) -> dict:
    """Part 2: the trainer loop with `adaptive-spec train`'s defaults for `budget_s` or until every entry is read."""
    data_dir = workdir / "loop"
    registry = AdapterRegistry(sqlite_tracking_uri(data_dir), data_dir=data_dir)
    registry.served()  # opens MLflow and creates its tables now, not inside the measured loop
    pending = PendingRegistrations(registry, data_dir / PENDING_FILE, by="bench-intake", retry_s=train.retry_s).start()
    stream = _CountedStream(client, stream=stream_name, consumer="loop")
    trainer = build_trainer(
        dataclasses.replace(train, data_dir=data_dir),
        draft,
        stream,
        on_promote=pending.submit,
        champion_source=RegistryChampion(registry, pending),
        trainer_class=_TimedTrainer,
    )
    trainer.status = TrainerStatus(None, stream.consumer)
    try:
        seconds = _consume(trainer, client, records, budget_s, train.checkpoint_every_s)
    finally:
        pending.stop(timeout=15.0)
        registry.close()
    rounds = trainer.rounds
    return {
        "loop_s": seconds,
        "loop_budget_s": budget_s,
        "loop_records": trainer.records_consumed,
        "rounds": rounds,
        "round_s": float(np.mean(trainer.round_seconds)) if trainer.round_seconds else None,
        "round_train_s": trainer.train_s / rounds if rounds else None,
        "adapters_promoted": trainer.adapters_promoted,
    } | {f"loop_{key}": value for key, value in _after(client, stream).items()}


def run_intake_bench(settings: IntakeBenchSettings, redis_url: str, workdir: Path, stream_name: str) -> dict:
    """Fill `stream_name` on `redis_url` and measure both parts on it; returns the figures."""
    load_start = os.getloadavg()
    train = TrainerSettings(**vars(settings.models), data_dir=workdir, redis_url=redis_url)
    client = redis.Redis.from_url(redis_url)
    try:
        draft, vocab = load_draft(train)
        rng = np.random.default_rng(settings.seed)
        records = [synthetic_record(rng, settings, vocab, settings.draft) for _ in range(settings.records)]
        record_bytes = float(np.mean([record.encoded_size for record in records]))
        written = fill_stream(redis_url, stream_name, records)
        if written != len(records):
            raise RuntimeError(f"only {written} of {len(records)} records reached the stream")
        del records
        print(f"{written} records in {stream_name}; part 1, intake alone ...", file=sys.stderr, flush=True)
        intake = measure_intake(draft, client, stream_name, train, workdir, written)
        del draft
        gc.collect()
        print(f"part 2, the trainer loop for up to {settings.loop_minutes:g} minutes ...", file=sys.stderr, flush=True)
        draft, _ = load_draft(train)  # a fresh one: the first trainer injected its LoRA into its draft in place
        loop = measure_loop(draft, client, stream_name, train, workdir, written, settings.loop_minutes * 60)
    finally:
        client.close()
    return {
        "records": written,
        "synthetic": "synthetic records of real shape: random token ids and top-m log-probabilities, "
        "no model served them",
        "target": settings.target,
        "draft": settings.draft,
        "device": str(resolve_device(settings.device)),
        "dtype": str(resolve_dtype(settings.dtype, resolve_device(settings.device))).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "prompt_tokens": list(settings.prompt_tokens),
        "output_tokens": settings.output_tokens,
        "topk": settings.topk,
        "record_bytes": record_bytes,
        "read_count": OnlineSettings.read_count,
        "intake_records_s": intake["intake_records"] / intake["intake_s"],
        **intake,
        "loop_records_s": loop["loop_records"] / loop["loop_s"],
        **loop,
        "load_average_start": list(load_start),
        "load_average_end": list(os.getloadavg()),
        "cpu_count": os.cpu_count(),
    }


def format_report(figures: dict) -> str:
    def number(value, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    low, high = figures["prompt_tokens"]
    start, end = figures["load_average_start"], figures["load_average_end"]
    busy = start[0] > 0.75 * (figures["cpu_count"] or 1)
    return "\n".join(
        [
            f"{figures['records']} synthetic records of real shape (no model served them): prompts of {low}-{high} "
            f"tokens, {figures['output_tokens']} output tokens, the target's top-{figures['topk']} log-probabilities "
            f"per token, {figures['record_bytes']:.0f} bytes each",
            f"{figures['target']}, draft {figures['draft']}, {figures['device']} {figures['dtype']}, "
            f"{figures['threads']} torch threads",
            "                                  records   seconds   records/s",
            f"  intake alone (no rounds)      {figures['intake_records']:9d} {figures['intake_s']:9.1f} "
            f"{figures['intake_records_s']:11.1f}   entries read {figures['intake_entries_read']}, "
            f"acknowledged {figures['intake_acknowledged']}, pending {figures['intake_pending']}",
            f"  trainer loop (train defaults) {figures['loop_records']:9d} {figures['loop_s']:9.1f} "
            f"{figures['loop_records_s']:11.2f}   {figures['rounds']} rounds, {number(figures['round_s'], '.1f')} s "
            f"per round ({number(figures['round_train_s'], '.1f')} s of optimiser steps), "
            f"{figures['adapters_promoted']} promoted",
            f"load average (1/5/15 min): {' '.join(f'{x:.2f}' for x in start)} at start, "
            f"{' '.join(f'{x:.2f}' for x in end)} at end"
            + (f"; other work shared the {figures['cpu_count']} cores, so both rates are low" if busy else ""),
        ]
    )


def measure(settings: IntakeBenchSettings) -> dict:
    """Both parts on a stream of their own: on REDIS_URL when it is set (a fresh stream, deleted at the
    end), else on a loopback redis-server started here (RedisStartError when it cannot be)."""
    shared = os.environ.get(REDIS_URL_ENV)
    stream = f"{CORRECTION_STREAM}:bench-intake-{uuid.uuid4().hex[:8]}" if shared else CORRECTION_STREAM
    with tempfile.TemporaryDirectory(prefix="bench-intake-") as tmp:
        workdir = Path(tmp)
        server = None if shared else started_server(workdir)
        url = shared or server.url
        try:
            return run_intake_bench(settings, url, workdir, stream)
        finally:
            if shared:
                with redis.Redis.from_url(url) as client:
                    client.delete(stream)
            if server is not None:
                server.stop()
