"""`adaptive-spec distill`: train the configured draft offline, so a deployment starts warm.

    adaptive-spec distill --prompts python --minutes 10                 # a shipped set, or a JSONL prompt file
    adaptive-spec distill --records .adaptive-spec/trainer/ckpt-000012/buffer.bin --minutes 5
    # small CPU variant (a local tiny model directory, promotes within a minute):
    adaptive-spec distill --target ./tiny --draft early-exit:1 --prompts p.jsonl --minutes 1 --gate-min-positions 64

It is the online trainer on traffic made here instead of live traffic, so what it registers is a
normal version: the target generates each prompt (greedy, max_new_tokens, through the engine with the
draft being trained, as a server would), each output becomes the correction record a server would log,
and the records go through a private Redis stream to the trainer that `adaptive-spec train` runs
(trainer/process/build.py: the same rounds, LoRA recipe, held-out split and statistical gate). Every
candidate the gate accepts is written to `<data-dir>/adapters/vNNNN`, registered in MLflow and
promoted to `champion` (trainer/promotion/pending.py), and served by this run's engine from then on.
So `up` and `serve` start from it (the watcher loads the champion before the first request), and an
online trainer started later adopts it as the champion it trains from and gates against.

From an export of correction records (`--records FILE`: length-prefixed encoded records, the format of
a trainer checkpoint's `buffer.bin` and `holdout.bin`, and of what `--save-records` writes) nothing is
generated: the records are replayed into the stream.

Before anything is generated, `--eval-prompts` prompts are held out (never trained on); at the end the
engine measures acceptance on them with the last promoted adapter and writes them to
`<data-dir>/distill-heldout.jsonl`, so `adaptive-spec bench --prompts <that file> --adapter vNNNN`
measures the same thing again. One general adapter is trained (every record goes to it, whatever its
domain tag). The whole run stays within `--minutes`: traffic stops in time for a last round and the
held-out measurement.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import redis
import torch
from tqdm import tqdm

from adaptive_spec.contracts import CORRECTION_STREAM, PAYLOAD_FIELD, PENDING_FILE
from adaptive_spec.formats.record import CorrectionRecord, record_from_output
from adaptive_spec.formats.stats import Totals
from adaptive_spec.outputs.prompts import PromptItem, encode_item
from trainer.intake.stream import CorrectionStream
from trainer.loop.checkpoint import read_records, write_records
from trainer.process.build import build_trainer, lendable, load_draft
from trainer.promotion.versions import AdapterVersion
from trainer.settings import TrainerSettings

log = logging.getLogger(__name__)

RECORD_TOPK = 16  # the target's top-m per position, as servers log it
HELDOUT_FILE = "distill-heldout.jsonl"


@dataclass(frozen=True)
class DistillSettings:
    minutes: float = 10.0
    max_new_tokens: int = 64
    eval_prompts: int = 12  # prompts held out of training, measured at the end (0: none)
    holdout_fraction: float = 0.2  # of records, for the gate (minutes of traffic, not hours: a larger share)
    tail_s: float = 60.0  # training allowed after the last prompt, for a last round
    seed: int = 0


def split_heldout(items: list[PromptItem], count: int, seed: int) -> tuple[list[PromptItem], list[PromptItem]]:
    """(held out, to train on): every `len // count`-th prompt from a seeded offset is held out, so the
    held-out prompts span the file (a domain file rotates its templates)."""
    if count <= 0:
        return [], list(items)
    if len(items) < count + 8:
        raise ValueError(f"need at least {count + 8} prompts to hold {count} out, got {len(items)}")
    step = len(items) // count
    chosen = {(seed % step) + i * step for i in range(count)}
    return [items[i] for i in sorted(chosen)], [item for i, item in enumerate(items) if i not in chosen]


def distill(
    engine,
    train: TrainerSettings,
    settings: DistillSettings,
    *,
    prompts: list[PromptItem] | None = None,
    records: list[CorrectionRecord] | None = None,
    save_records: Path | None = None,
    registry=None,
    progress: bool = True,
) -> dict:
    """Train `engine`'s draft on `prompts` (generated here) or `records` (replayed) within
    `settings.minutes`; versions go to `train.data_dir` and, with a `registry` (registry/client.py),
    are registered and promoted. Returns the figures `format_line` prints."""
    from trainer.promotion.champion import RegistryChampion
    from trainer.promotion.pending import PendingRegistrations

    started = time.monotonic()
    deadline = started + settings.minutes * 60
    heldout, traffic = split_heldout(prompts or [], settings.eval_prompts if prompts else 0, settings.seed)
    data_dir = Path(train.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    client = redis.Redis.from_url(train.redis_url)
    stream_name = f"{CORRECTION_STREAM}:distill-{uuid.uuid4().hex[:8]}"  # private: live traffic never mixes in
    stream = CorrectionStream(client, stream=stream_name, consumer="distill")
    stream.ensure_group()
    pending = None
    if registry is not None:
        pending = PendingRegistrations(registry, data_dir / PENDING_FILE, by="distill").start()
    promoted: list[AdapterVersion] = []

    def on_promote(version: AdapterVersion) -> None:
        if pending is not None:
            pending.submit(version)
        engine.load_adapter(version.path, str(version.version))  # what it generates next drafts with it
        promoted.append(version)

    draft = load_draft(train, target=lendable(engine.target, train))[0]
    trainer = build_trainer(
        train,
        draft,
        stream,
        checkpoints=False,
        on_promote=on_promote,
        champion_source=None if registry is None else RegistryChampion(registry, pending),
        holdout_fraction=settings.holdout_fraction,
        max_domains=0,  # one general adapter: what every request drafts with
    )
    if registry is not None and trainer.sync_registry():  # start from the deployment's champion, if it has one
        champion = trainer.champion
        engine.load_adapter(champion.path, champion.registry_champion)  # and generate with it, as a server would
    eval_reserve = _eval_reserve(len(heldout), settings.max_new_tokens)
    traffic_deadline = deadline - eval_reserve - min(settings.tail_s, settings.minutes * 60 * 0.2)
    stop = threading.Event()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # generation and training share the CPU: one thread each
    worker = threading.Thread(target=_train, args=(trainer, stop, deadline - eval_reserve), daemon=True)
    worker.start()
    made: list[CorrectionRecord] = []
    engine.record_topk = RECORD_TOPK
    try:
        feed = (
            _replay(records or [], client, stream_name)
            if records
            else _generate(engine, traffic, made, client, stream_name, settings)
        )
        bar = tqdm(
            total=len(records or traffic),
            desc="distill",
            unit="record" if records else "prompt",
            disable=not progress,
            file=sys.stderr,
        )
        for _ in feed:
            bar.update(1)
            bar.set_postfix(
                adapter=engine.adapter_version or "base", promoted=len(promoted), consumed=trainer.records_consumed
            )
            if time.monotonic() > traffic_deadline:
                break
        bar.close()
        tail_end = min(time.monotonic() + settings.tail_s, deadline - eval_reserve)
        while worker.is_alive() and time.monotonic() < tail_end:  # the records still unread, a last round
            time.sleep(1.0)
    finally:
        stop.set()
        worker.join()
        engine.record_topk = 0
        torch.set_num_threads(threads)
        client.delete(stream_name)
        client.close()
        if pending is not None:
            pending.stop(timeout=30.0)
    if save_records is not None:
        write_records(save_records, (record.encode() for record in made))
    measured = _measure(engine, heldout, settings.max_new_tokens, progress)
    if heldout:
        (data_dir / HELDOUT_FILE).write_text("".join(_line(item) for item in heldout), encoding="utf-8")
    last = trainer.last_result
    registered = [] if pending is None else pending.registered
    return {
        # what `up`, `serve` and `--adapter` name: the registry's version (the local directory's without one)
        "version": (registered[-1] if registered else None) if pending is not None else _name(promoted),
        "adapter_dir": str(promoted[-1].path) if promoted else None,
        "registered": registered,
        "versions_promoted": len(promoted),
        "rounds": trainer.rounds,
        "records_consumed": trainer.records_consumed,
        "records_rejected": dict(
            trainer.rejected
        ),  # another target's or draft's, or malformed (trainer/intake/screening.py)
        "tokens_consumed": trainer.tokens_consumed,
        "prompts_generated": len(made),
        "heldout_records_match": None if last is None or last.candidate is None else _gate_match(trainer),
        "heldout_prompts": len(heldout),
        "heldout_acceptance_rate": measured.acceptance_rate if heldout else None,
        "heldout_mean_acceptance_length": measured.mean_acceptance_length if heldout else None,
        "heldout_file": str(data_dir / HELDOUT_FILE) if heldout else None,
        "minutes": (time.monotonic() - started) / 60,
        "last_round": None if last is None else last.reason,
        "last_loss": None if last is None or not last.trained else last.loss,
    }


def format_line(figures: dict) -> str:
    """The line a run ends with: what was registered and the held-out figures."""

    def f(value, fmt=".3f"):
        return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)

    rejected = sum(figures["records_rejected"].values())
    version = figures["version"] or (
        "no version registered (see the log)"
        if figures["versions_promoted"]
        else "no version (the gate accepted no candidate)"
    )
    return (
        f"distill: {version}; held out: acceptance {f(figures['heldout_acceptance_rate'])} and mean acceptance "
        f"length {f(figures['heldout_mean_acceptance_length'], '.2f')} on {figures['heldout_prompts']} prompts, "
        f"greedy match {f(figures['heldout_records_match'])} on the gate's held-out records; "
        f"{figures['versions_promoted']} versions promoted in {figures['rounds']} rounds over "
        f"{figures['records_consumed']} records, {figures['minutes']:.1f} min"
        + (f"; {rejected} records rejected {figures['records_rejected']}" if rejected else "")
    )


def load_record_file(path: Path) -> list[CorrectionRecord]:
    """An export of correction records (length-prefixed encoded records, trainer/loop/checkpoint.py)."""
    if not path.is_file():
        raise ValueError(f"records file not found: {path}")
    try:
        records = read_records(path)
    except Exception as exc:  # truncated or not records at all
        raise ValueError(f"{path} is not a file of encoded correction records: {exc}") from None
    if not records:
        raise ValueError(f"{path} holds no correction records")
    return records


def _generate(engine, items: list[PromptItem], made: list, client, stream_name: str, settings: DistillSettings):
    """Generate each prompt greedily as a server would, and append its record to the stream; yields per prompt."""
    for item in items:
        ids, response_format = encode_item(item, engine)
        out = engine.generate(ids, settings.max_new_tokens, response_format=response_format)
        record = record_from_output(
            out,
            request_id=uuid.uuid4().hex,
            created_at=time.time(),
            domain=item.domain,
            target_id=engine.target_id,
            draft_id=engine.draft_id,
            temperature=0.0,
        )
        client.xadd(stream_name, {PAYLOAD_FIELD: record.encode()})
        made.append(record)
        yield record


def _replay(records: list[CorrectionRecord], client, stream_name: str):
    for record in records:
        client.xadd(stream_name, {PAYLOAD_FIELD: record.encode()})
        yield record


def _train(trainer, stop: threading.Event, deadline: float) -> None:
    torch.set_num_threads(1)
    try:
        trainer.run(stop, budget_s=max(0.0, deadline - time.monotonic()), poll_block_ms=200)
    except Exception:  # reported in the figures (no version); the generating side finishes cleanly
        log.exception("trainer stopped with an error")


def _eval_reserve(prompts: int, max_new_tokens: int) -> float:
    """Seconds kept for the held-out measurement: about 0.1 s per token on a 2-core CPU, and a margin."""
    return prompts * max_new_tokens * 0.1 + 10 if prompts else 5.0


def _measure(engine, items: list[PromptItem], max_new_tokens: int, progress: bool) -> Totals:
    totals = Totals()
    for item in tqdm(items, desc="held out", unit="prompt", disable=not progress or not items, file=sys.stderr):
        ids, response_format = encode_item(item, engine)
        totals.include(engine.generate(ids, max_new_tokens, response_format=response_format).stats)
    return totals


def _gate_match(trainer) -> float:
    result = trainer.last_result
    return result.candidate.greedy_match if result.promoted or result.champion is None else result.champion.greedy_match


def _name(promoted: list[AdapterVersion]) -> str | None:
    return promoted[-1].name if promoted else None


def _line(item: PromptItem) -> str:
    row: dict = {"prompt": item.prompt} if isinstance(item.prompt, str) else {"messages": item.prompt}
    row |= {"domain": item.domain} if item.domain else {}
    row |= item.request_fields()
    return json.dumps(row, ensure_ascii=False) + "\n"
