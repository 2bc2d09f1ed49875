"""The online trainer: read correction records, distil them into the draft's LoRA adapter, and
promote a new adapter version only when it beats the one served on held-out recent traffic.

    stream = CorrectionStream(settings.redis_url, consumer="trainer-1")   # stable across restarts
    pending = PendingRegistrations(registry, data_dir / "registry-pending.json").start()
    trainer = OnlineTrainer(build_early_exit(target, 4), stream, data_dir / "adapters",
                            checkpoint_dir=data_dir / "trainer", target_id="smollm2-135m-instruct",
                            draft_id="early-exit:4", on_promote=pending.submit,
                            champion_source=RegistryChampion(registry, pending))
    trainer.run(stop_event, budget_s=600)          # poll -> train_round -> checkpoint + ack, until stopped

Small CPU check (tiny random models, a real redis-server, about 20 s):
`.venv/bin/python -m pytest tests/trainer/test_online.py -q`.

The loop (`run`), one verb each:

- `poll()` takes records from the stream: on its first call the consumer's own pending entries
  (XREADGROUP id 0: what this consumer name read before a restart and never acknowledged), then
  entries that another consumer left idle for `reclaim_idle_ms` (XAUTOCLAIM), then new ones. Each
  record goes to the held-out set (HoldoutSplit, about 1 in 10 by a hash of its request id) or,
  as a training example, to the replay buffer. Duplicates (same request id) are dropped there.
- `train_round()`, once `min_new_records` new training records have arrived: `round_steps`
  optimiser steps on batches sampled from the buffer, then both the candidate and the champion
  (the adapter promoted last, or the base draft with adapters disabled) are scored with
  `draft_agreement` on the same snapshot of the held-out set, and `Gate.decide` judges.
  Example (the test's tiny model): 40 steps; over the same 432 held-out positions the base draft
  matches the target's greedy token 0.067 of the time and the candidate 0.363, expected acceptance
  0.177 -> 0.229. The gain +0.296 clears the margin (0.01), so the candidate is saved as
  `adapters_dir/v0001` and becomes the champion that training continues from. The next round
  reached +0.0095 and was rolled back.
- `checkpoint()` makes the state durable, then acknowledges what it covers (see below).

The registry has the last word (`champion_source`, trainer/champion.py `RegistryChampion`). Before
each round and again before each promotion, `sync_registry()` asks which version the `champion`
alias names. If it is not the trainer's champion (and none of the trainer's own promotions is
still on its way there), an operator moved it: a rollback, a promotion of an older version, or the
alias removed (the base draft). The trainer then adopts it: it downloads that version, checks
checksum.sha256 and the registry's sha256 tag, loads its LoRA weights (optimiser moments cleared;
for the base draft the LoRA is re-initialised to its zero delta), and makes it the champion the
gate compares against. Example: the trainer promoted v0005 (registry version 5); an operator
rolls back to 4; the next round logs "champion moved in the registry from 5 to 4 by cli:alice@host;
training from 4", trains from 4's weights, and its candidate is promoted only if it beats 4 by the
gate's margin, so 5 cannot come back without earning it. A candidate whose round saw the champion
move is discarded. MLflow down: the trainer keeps its champion and asks again `registry_retry_s`
later. An adopted version that is not already a local directory is installed as the next vNNNN
with `registry_version` in its metadata; `registry_versions` maps local directories to registry
versions.

Rejected candidates are rolled back. When the gate refuses, the LoRA weights are copied back
from the champion and the optimiser's moments are cleared, so every round starts from the
adapter that is served. A round that overfits or diverges thus costs its own steps and nothing
more, and the checkpoint always holds the champion. The price: progress smaller than the gate's
margin per round is thrown away, so on a plateau where `round_steps` steps gain less than the
margin (0.01 by default) the trainer stops improving. Raise `round_steps` rather than lowering
the margin if that happens.

Acknowledgement (at-least-once, DESIGN.md "Trainer killed mid-batch"):

- with `checkpoint_dir`: an entry is acknowledged only after a checkpoint that contains what it
  contributed (its record in the buffer or the held-out set, and every adapter trained on it).
  A trainer killed at any point loses nothing: the entries since its last checkpoint are still
  pending and come back, to the same consumer name at once (XREADGROUP 0) or to any other after
  `reclaim_idle_ms` (XAUTOCLAIM). Keep `checkpoint_every_s` well under `reclaim_idle_ms`, or a
  second trainer may claim entries this one holds unacknowledged.
- without it: entries are acknowledged as soon as `poll()` has put them in the buffer or the
  held-out set. A crash then loses the in-memory buffer (promoted adapters are safe on disk), so
  this mode is for tests and benchmarks, not for a long-lived trainer.

A checkpoint is a directory `checkpoint_dir/ckpt-NNNNNN` written under a temporary name, renamed,
and named by the file `LATEST` (replaced atomically), so a crash mid-write leaves the previous one:

    adapter/       the champion's LoRA weights (PEFT; the base draft's zero adapter before any promotion)
    buffer.bin     replay-buffer records, oldest first   } each a uint32 little-endian byte length
    holdout.bin    held-out records, oldest first        } + CorrectionRecord.encode()
    state.json     counters, the champion's version and sha256, the next version number, the sampler's
                   state, the registry version in sync and the local -> registry version map

The optimiser's moments are not saved: a resumed trainer starts them afresh, as
`DraftTrainer.load` does.

A promoted version directory `adapters_dir/vNNNN` (written as `.vNNNN.tmp`, then renamed) holds
PEFT's adapter_config.json and adapter_model.safetensors, `checksum.sha256` (sha256sum format,
`sha256sum -c` checks it) and adaptive_spec_adapter.json with DraftTrainer's metadata plus
`version`, `parent_version`, `parent_sha256`, `parent_registry_version`, `base_version`, `gate`
(candidate and champion figures, reason),
`loss`, `domain_mix` and `adapter_sha256`. Version numbers never reuse a directory that exists.

Not thread-safe: one thread drives poll, train_round and checkpoint (run() does). The trainer
owns `draft_model`: PEFT injects the LoRA layers into it in place.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import struct
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis
import torch

from adaptive_spec.adapters import AdapterDir, AdapterError, sha256_file, trainer_versions
from adaptive_spec.contracts import SHA_TAG, WEIGHTS_FILE
from adaptive_spec.record import CorrectionRecord
from trainer.buffer import HoldoutSplit, ReplayBuffer
from trainer.distill import DraftTrainer, LoraSettings, examples_from_record
from trainer.gate import Gate, GateFigures, adapters_disabled, draft_agreement
from trainer.stream import CorrectionStream

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
LATEST = "LATEST"  # names the complete checkpoint directory
UNTAGGED = "untagged"  # the domain_mix key of records without a domain
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class AdapterVersion:
    """A promoted adapter, as handed to `on_promote` (e.g. to register it in MLflow)."""

    version: int
    path: Path  # adapters_dir / f"v{version:04d}"
    candidate: GateFigures  # this adapter on the held-out set
    champion: GateFigures  # the adapter it replaced (or the base draft) on the same positions
    loss: float  # mean training loss over its last round
    sha256: str  # of adapter_model.safetensors
    domain_mix: dict[str, int]  # distinct records of its last round, by domain
    parent_version: int | None  # None: trained from the base draft
    parent_sha256: str | None = None  # the weights it was trained from (None: the base draft)

    @property
    def name(self) -> str:
        return self.path.name


@dataclass(frozen=True)
class RoundResult:
    """What one call of train_round() did. `trained` is False when it was not time for a round."""

    trained: bool
    promoted: bool
    reason: str  # the gate's reason, or why no round ran
    round: int = 0  # rounds trained so far, this one included (0 when it did not train)
    steps: int = 0
    loss: float = math.nan  # mean of the round's step losses
    first_loss: float = math.nan
    last_loss: float = math.nan
    new_records: int = 0  # training records that arrived since the previous round
    train_s: float = 0.0  # wall time of the train steps
    candidate: GateFigures | None = None
    champion: GateFigures | None = None
    version: int | None = None  # the new champion's version when promoted


class OnlineTrainer:
    """Consumes `stream`, trains a LoRA adapter on `draft_model` and writes promoted versions to
    `adapters_dir`; with `checkpoint_dir`, resumes from the checkpoint found there."""

    def __init__(
        self,
        draft_model,
        stream: CorrectionStream,
        adapters_dir: Path,
        *,
        settings: LoraSettings | None = None,
        gate: Gate = Gate(),
        holdout: HoldoutSplit | None = None,
        buffer_tokens: int = 200_000,
        min_new_records: int = 16,
        round_steps: int = 20,
        batch_tokens: int | None = None,  # input tokens sampled per step; settings.batch_tokens if None
        checkpoint_dir: Path | None = None,
        target_id: str = "target",
        draft_id: str = "draft",
        on_promote: Callable[[AdapterVersion], None] | None = None,
        base_version: str | int | None = None,  # an opaque label of what the lineage starts from
        read_count: int = 64,  # entries per XREADGROUP / XAUTOCLAIM
        reclaim_idle_ms: int = 60_000,
        champion_source=None,  # the registry's champion (trainer.champion.RegistryChampion); None: ours only
        registry_retry_s: float = 30.0,  # while the registry is unreachable, ask it again after this long
    ) -> None:
        if min_new_records < 1 or round_steps < 1:
            raise ValueError("min_new_records and round_steps must be >= 1")
        self.stream = stream
        self.adapters_dir = Path(adapters_dir)
        self.adapters_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.gate = gate
        self.holdout = holdout if holdout is not None else HoldoutSplit()
        self.buffer = ReplayBuffer(buffer_tokens)
        self.min_new_records = min_new_records
        self.round_steps = round_steps
        self.on_promote = on_promote
        self.base_version = base_version
        self.read_count = read_count
        self.reclaim_idle_ms = reclaim_idle_ms
        self.champion_source = champion_source
        self.registry_retry_s = registry_retry_s

        self.records_consumed = 0  # distinct records taken from the stream (held out or for training)
        self.tokens_consumed = 0  # their output tokens
        self.duplicates = 0  # records dropped because their request id was already kept
        self.train_s = 0.0
        self.adapters_promoted = 0
        self.rounds = 0
        self.promote_errors = 0  # on_promote raised
        self.new_records = 0  # training records since the last round
        self.last_result: RoundResult | None = None
        self.champion_version: int | None = None
        self.champion_sha256: str | None = None  # of the champion's weights; None for the base draft
        self.registry_champion: str | None = None  # the registry version last seen serving our champion
        self.registry_versions: dict[str, str] = {}  # local directory (v0004) -> registry version ("4")
        self.adoptions = 0  # champions taken over from the registry
        self.next_version = 1
        self._checkpoint_seq = 0
        self._unacked: dict[str, None] = {}  # stream entry ids routed but not yet acknowledged, in order
        self._buffer_records: OrderedDict[str, tuple[str | None, bytes]] = OrderedDict()  # the buffer's records
        self._reread_own_pending = True
        self._changed = False  # anything to checkpoint since the last checkpoint
        self._champion_cache: tuple[tuple, GateFigures] | None = None  # (holdout revision, version) -> figures
        self._registry_down = False
        self._registry_retry_at = 0.0  # monotonic time before which an unreachable registry is not asked
        self._refused: dict[str, str] = {}  # registry version -> why it could not be adopted (not retried)

        state, adapter = self._latest_checkpoint()
        settings = settings or LoraSettings()
        self.trainer = DraftTrainer(draft_model, settings, init_adapter=adapter, target_id=target_id,
                                    draft_id=draft_id)  # fmt: skip
        self.batch_tokens = batch_tokens or self.trainer.settings.batch_tokens
        self.rng = np.random.default_rng(self.trainer.settings.seed)
        if state is not None:
            self._restore(state, adapter.parent)
        self.next_version = max(self.next_version, max(trainer_versions(self.adapters_dir), default=0) + 1)
        self._champion_state = self._lora_state()
        self.stream.ensure_group()

    # ---------------------------------------------------------------- the loop

    def run(self, stop: threading.Event, budget_s: float | None = None, checkpoint_every_s: float = 30.0,
            poll_block_ms: int = 1000) -> dict:  # fmt: skip
        """Poll, train a round whenever enough new records are in, checkpoint every `checkpoint_every_s`.

        Returns (with the counters()) once `stop` is set or `budget_s` of wall time is spent,
        checked between steps of the loop, so a round under way finishes first. On a clean exit
        it checkpoints a last time (if anything changed). If it raises, nothing after the last
        checkpoint is acknowledged, and a restarted trainer reads those entries again. While
        Redis is unreachable it keeps its state and retries every second.
        """
        started = time.monotonic()
        deadline = started + budget_s if budget_s is not None else math.inf
        last_checkpoint = started
        redis_down = False
        log.info("online trainer %s: %d buffered, %d held out, champion %s, next version v%04d", self.stream.consumer,
                 len(self.buffer), len(self.holdout), self._champion_name(), self.next_version)  # fmt: skip
        while not stop.is_set() and time.monotonic() < deadline:
            block_ms = int(min(poll_block_ms, max(1.0, (deadline - time.monotonic()) * 1000)))
            try:
                self.poll(block_ms=block_ms)
            except (redis.ConnectionError, redis.TimeoutError) as error:  # Redis down: keep what we have, retry
                if not redis_down:
                    log.warning("correction stream unavailable (%s); retrying", error)
                redis_down = True
                stop.wait(min(1.0, max(0.0, deadline - time.monotonic())))
                continue
            redis_down = False
            if self.new_records >= self.min_new_records:
                self.train_round()
            if time.monotonic() - last_checkpoint >= checkpoint_every_s:
                if self.checkpoint_dir is not None and (self._changed or self._unacked):
                    self.checkpoint()
                last_checkpoint = time.monotonic()
                log.info("progress: %s", self._progress())
        if self.checkpoint_dir is not None and (self._changed or self._unacked):
            self.checkpoint()
        log.info("online trainer stopped after %.0f s: %s", time.monotonic() - started, self._progress())
        return self.counters()

    def poll(self, block_ms: int | None = 1000) -> int:
        """Take what the stream has for this consumer, route it, and return how many records came.

        Waits up to `block_ms` for new entries only when nothing pending or reclaimable came first
        (0 or None: do not wait).
        """
        received = 0
        if self._reread_own_pending:
            received += self._route(self._own_pending())
            self._reread_own_pending = False
        claimed = self.stream.reclaim(self.reclaim_idle_ms, count=self.read_count)
        received += self._route(claimed)
        waited = None if received or claimed else (block_ms or None)
        received += self._route(self.stream.read(count=self.read_count, block_ms=waited))
        if received:
            self._changed = True
            log.debug("polled %d records: %d buffered, %d held out", received, len(self.buffer), len(self.holdout))
        return received

    def train_round(self) -> RoundResult:
        """Train `round_steps` steps from the champion, gate the candidate, promote it or roll it back."""
        if self.new_records < self.min_new_records or not len(self.buffer):
            return RoundResult(False, False, f"{self.new_records} new training records, need {self.min_new_records}")
        heldout = self.holdout.records  # one snapshot for both sides of the gate
        heldout_positions = sum(len(record.output_ids) for record in heldout)
        if heldout_positions < self.gate.min_positions:
            return RoundResult(False, False, (f"held-out set has {heldout_positions} positions, the gate needs "
                                              f"{self.gate.min_positions}"))  # fmt: skip
        self.sync_registry()  # the gate must compare against what is served, and training start from it
        champion = self._champion_figures(heldout)
        new_records, self.new_records = self.new_records, 0
        losses, trained_ids = [], set()
        started = time.perf_counter()
        for _ in range(self.round_steps):
            batch = self.buffer.sample_batch(self.rng, self.batch_tokens)
            losses.append(self.trainer.train_step(batch))
            trained_ids.update(example.request_id for example in batch)
        train_s = time.perf_counter() - started
        self.train_s += train_s
        candidate = draft_agreement(self.trainer.model, heldout, self.trainer.settings.batch_tokens,
                                    self.trainer.settings.max_seq_len)  # fmt: skip
        accepted, reason = self.gate.decide(candidate, champion)
        if accepted and self.sync_registry():  # adopting replaced the candidate's weights
            accepted, reason = False, (f"the registry's champion moved during the round; candidate discarded, "
                                       f"training from {self._champion_name()}")  # fmt: skip
        self.rounds += 1
        self._changed = True
        result = RoundResult(True, accepted, reason, self.rounds, len(losses), float(np.mean(losses)), losses[0],
                             losses[-1], new_records, train_s, candidate, champion)  # fmt: skip
        if accepted:
            version = self._promote(result, self._domain_mix(trained_ids))
            result = dataclasses.replace(result, version=version.version)
        else:
            self._roll_back()
        self.last_result = result
        log.info("round %d: %d steps in %.1f s, loss %.4f -> %.4f; held-out greedy match %.4f vs champion %.4f, "
                 "expected acceptance %.4f vs %.4f: %s", result.round, result.steps, train_s, result.first_loss,
                 result.last_loss, candidate.greedy_match, champion.greedy_match, candidate.expected_acceptance,
                 champion.expected_acceptance,
                 f"promoted v{result.version:04d}" if accepted else f"rolled back ({reason})")  # fmt: skip
        return result

    def sync_registry(self) -> bool:
        """Adopt the registry's champion if an operator moved it; True when the champion changed.

        Cheap when nothing moved: one or two MLflow reads. Never raises for the registry: while it
        is unreachable the trainer keeps its champion and asks again after `registry_retry_s`; a
        version it cannot adopt (corrupt, untagged, another LoRA shape) is logged and not tried
        again until the alias moves.
        """
        if self.champion_source is None or time.monotonic() < self._registry_retry_at:
            return False
        try:
            served = self.champion_source.served()
        except Exception as error:  # MLflow down or broken: training goes on from our champion
            if not self._registry_down:
                log.warning("registry unavailable (%s); training on from %s, asking again in %.0f s", error,
                            self._champion_name(), self.registry_retry_s)  # fmt: skip
            self._registry_down = True
            self._registry_retry_at = time.monotonic() + self.registry_retry_s
            return False
        if self._registry_down:
            log.info("registry reachable again")
            self._registry_down = False
        if served is None:  # our own promotions are still on their way: the registry lags behind us
            return False
        ours = (self.champion_version is None, self.champion_sha256)
        if (served.version is None, served.sha256) == ours:
            if served.version != self.registry_champion:
                self.registry_champion = served.version
                if self.champion_version is not None:
                    self.registry_versions[f"v{self.champion_version:04d}"] = served.version
                self._changed = True
            return False
        self._refused = {version: why for version, why in self._refused.items() if version == served.version}
        if served.version in self._refused:  # tried again once the alias has moved elsewhere and back
            return False
        try:
            self._adopt(served)
        except (AdapterError, ValueError) as error:  # corrupt, untagged, or not shaped like our LoRA
            self._refused[served.version] = str(error)
            self._roll_back()  # a half-loaded adapter must not stay in the model
            log.error("the registry's champion is %s (moved by %s) but it cannot be adopted: %s; training on from "
                      "%s, whose promotions will not move the champion", served.version, served.by, error,
                      self._champion_name())  # fmt: skip
            return False
        except Exception as error:  # MLflow went away mid-download, a full disk: try again next time
            self._roll_back()
            log.warning("could not adopt the registry's champion %s yet (%s); asking again before the next round",
                        served.version, error)  # fmt: skip
            return False
        return True

    def checkpoint(self) -> Path:
        """Write the champion, buffer, held-out set and counters atomically, then acknowledge the
        entries they contain. Returns the checkpoint directory."""
        if self.checkpoint_dir is None:
            raise ValueError("this trainer has no checkpoint_dir")
        covered = list(self._unacked)  # everything routed so far is in what is written below
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self._checkpoint_seq += 1
        name = f"ckpt-{self._checkpoint_seq:06d}"
        temporary = self.checkpoint_dir / f".{name}.tmp"
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
        self.trainer.save(temporary / "adapter")  # between rounds the weights are the champion's
        _write_records(temporary / "buffer.bin", (encoded for _, encoded in self._buffer_records.values()))
        _write_records(temporary / "holdout.bin", (record.encode() for record in self.holdout.records))
        _write_durably(temporary / "state.json", json.dumps(self._state(), indent=2, sort_keys=True).encode())
        shutil.rmtree(self.checkpoint_dir / name, ignore_errors=True)  # left by a crash before LATEST named it
        os.rename(temporary, self.checkpoint_dir / name)
        _write_durably(self.checkpoint_dir / f".{LATEST}.tmp", name.encode())
        os.replace(self.checkpoint_dir / f".{LATEST}.tmp", self.checkpoint_dir / LATEST)
        _fsync_dir(self.checkpoint_dir)
        for old in self.checkpoint_dir.glob("ckpt-*"):
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
        self._changed = False
        self._ack(covered)
        return self.checkpoint_dir / name

    def counters(self) -> dict:
        """Figures for reports (bench-drift's records_consumed, tokens_consumed, train_s, adapters_promoted)."""
        return {
            "records_consumed": self.records_consumed,
            "tokens_consumed": self.tokens_consumed,
            "train_s": self.train_s,
            "adapters_promoted": self.adapters_promoted,
            "rounds": self.rounds,
            "duplicates": self.duplicates,
            "buffer_records": len(self.buffer),
            "holdout_records": len(self.holdout),
            "unacknowledged": len(self._unacked),
            "corrupt": self.stream.corrupt,
            "trimmed": self.stream.trimmed,
            "promote_errors": self.promote_errors,
            "champion_version": self.champion_version,
            "next_version": self.next_version,
            "adoptions": self.adoptions,
            "registry_champion": self.registry_champion,
        }

    @property
    def champion_path(self) -> Path | None:
        """The champion's version directory; None while the base draft is the champion."""
        return None if self.champion_version is None else self.adapters_dir / f"v{self.champion_version:04d}"

    @classmethod
    def resume(cls, draft_model, stream: CorrectionStream, adapters_dir: Path, checkpoint_dir: Path,
               **kwargs) -> OnlineTrainer:  # fmt: skip
        """The constructor with `checkpoint_dir`: restores its latest checkpoint if there is one."""
        return cls(draft_model, stream, adapters_dir, checkpoint_dir=checkpoint_dir, **kwargs)

    # ---------------------------------------------------------------- routing records

    def _own_pending(self) -> list[tuple[str, CorrectionRecord]]:
        """Entries this consumer name read before (e.g. before a crash) and never acknowledged."""
        stream = self.stream
        entries = stream.read_own_pending(self.read_count)
        if entries:
            log.info("re-reading %d entries that consumer %s read before and never acknowledged", len(entries),
                     stream.consumer)  # fmt: skip
        return entries

    def _route(self, entries: list[tuple[str, CorrectionRecord]]) -> int:
        """Keep each entry's record and track its id; acknowledge at once when there is no checkpoint_dir."""
        routed = 0
        for entry_id, record in entries:
            if entry_id in self._unacked:  # ours already; XAUTOCLAIM handed it back after it idled
                continue
            self._keep(record)
            self._unacked[entry_id] = None
            routed += 1
        if self.checkpoint_dir is None:
            self._ack()
        return routed

    def _keep(self, record: CorrectionRecord) -> None:
        """Held out, or into the replay buffer as a training example; duplicates are dropped."""
        duplicates = self.holdout.duplicates + self.buffer.duplicates
        if not self.holdout.add(record):
            evicted = self.buffer.evicted
            if self.buffer.add(examples_from_record(record, self.trainer.settings.max_seq_len)):
                self._buffer_records[record.request_id] = (record.domain, record.encode())
                for _ in range(self.buffer.evicted - evicted):  # the buffer evicts oldest first, as this mirror
                    self._buffer_records.popitem(last=False)
                self.new_records += 1
        if self.holdout.duplicates + self.buffer.duplicates > duplicates:
            self.duplicates += 1
            return
        self.records_consumed += 1
        self.tokens_consumed += len(record.output_ids)

    def _ack(self, ids: Iterable[str] | None = None) -> None:
        """Acknowledge `ids` (all tracked ids if None); on a Redis error they stay tracked for the next try."""
        ids = list(self._unacked) if ids is None else list(ids)
        if not ids:
            return
        try:
            self.stream.ack(ids)
        except (redis.ConnectionError, redis.TimeoutError) as error:
            log.warning("could not acknowledge %d entries (%s); they stay pending until the next try", len(ids), error)
            return
        for entry_id in ids:
            self._unacked.pop(entry_id, None)

    # ---------------------------------------------------------------- champion and versions

    def _champion_figures(self, heldout: list[CorrectionRecord]) -> GateFigures:
        """The champion on the held-out snapshot, cached until the held-out set or the champion changes."""
        key = (self.holdout.revision, self.champion_version)
        if self._champion_cache is not None and self._champion_cache[0] == key:
            return self._champion_cache[1]
        settings = self.trainer.settings
        if self.champion_version is None:
            with adapters_disabled(self.trainer.model):
                figures = draft_agreement(self.trainer.model, heldout, settings.batch_tokens, settings.max_seq_len)
        else:  # between rounds the trained weights are the champion's
            figures = draft_agreement(self.trainer.model, heldout, settings.batch_tokens, settings.max_seq_len)
        self._champion_cache = (key, figures)
        return figures

    def _promote(self, result: RoundResult, domain_mix: dict[str, int]) -> AdapterVersion:
        """Save the candidate as the next version, make it the champion, checkpoint, call on_promote."""
        version = self.next_version
        final = self.adapters_dir / f"v{version:04d}"
        temporary = self.adapters_dir / f".{final.name}.tmp"
        shutil.rmtree(temporary, ignore_errors=True)
        self.trainer.save(temporary)
        staged = AdapterDir(temporary)
        digest = staged.seal(**{
            "version": version,
            "parent_version": self.champion_version,
            "parent_sha256": self.champion_sha256,
            "parent_registry_version": self.registry_versions.get(f"v{self.champion_version or 0:04d}"),
            "base_version": self.base_version,
            "round": result.round,
            "round_steps": result.steps,
            "loss": result.loss,
            "first_loss": result.first_loss,
            "last_loss": result.last_loss,
            "gate": {"candidate": dataclasses.asdict(result.candidate), "champion": dataclasses.asdict(result.champion),
                     "reason": result.reason, "min_positions": self.gate.min_positions, "margin": self.gate.margin},
            "domain_mix": domain_mix,
            "records_consumed": self.records_consumed,
            "tokens_consumed": self.tokens_consumed,
        })  # fmt: skip
        staged.write_vocab(self._draft_vocab())
        os.rename(temporary, final)  # fails rather than overwrite: next_version skips existing directories

        promoted = AdapterVersion(version, final, result.candidate, result.champion, result.loss, digest, domain_mix,
                                  self.champion_version, self.champion_sha256)  # fmt: skip
        self.champion_version = version
        self.champion_sha256 = digest
        self.next_version = version + 1
        self.adapters_promoted += 1
        self._champion_state = self._lora_state()
        self._champion_cache = ((self.holdout.revision, version), result.candidate)
        if self.checkpoint_dir is not None:  # a restart must not fall back to the previous champion
            self.checkpoint()
        if self.on_promote is not None:
            try:
                self.on_promote(promoted)
            except Exception:  # the version is saved and is the champion; the callback owns its retries
                self.promote_errors += 1
                log.exception("on_promote failed for %s", final)
        return promoted

    def _adopt(self, served) -> None:
        """Make the registry's champion ours: its weights in the model, fresh optimiser, gate figures anew."""
        ours = self._own_registry_version()  # maps the champion we leave, too
        moved_from = self._registry_name(getattr(served, "moved_from", None) or ours)
        if served.version is None:
            self._reset_lora()
            local = None
        else:
            if not served.sha256:
                raise AdapterError(f"version {served.version} has no adapter_sha256 tag: nothing to verify it against")
            with tempfile.TemporaryDirectory(prefix=".adopt-", dir=self.adapters_dir) as staging:
                downloaded = self.champion_source.download(served.version, Path(staging))
                AdapterDir(downloaded).verify(expected_sha256=served.sha256)  # as a server checks it
                self.trainer.load(downloaded)  # checks the LoRA's shape; a fresh optimiser
                local = self._local_version(served.sha256) or self._install(downloaded, served)
            self.registry_versions[f"v{local:04d}"] = served.version
        self.trainer.optimizer.state.clear()
        self.champion_version = local
        self.champion_sha256 = served.sha256
        self.registry_champion = served.version
        self.adoptions += 1
        self._champion_state = self._lora_state()
        self._champion_cache = None
        self._changed = True
        log.warning("champion moved in the registry from %s to %s by %s; training from %s (local %s)", moved_from,
                    self._registry_name(served.version), served.by, self._registry_name(served.version),
                    "base draft" if local is None else f"v{local:04d}")  # fmt: skip

    def _own_registry_version(self) -> str | None:
        """The registry version of our champion (asked by sha256 if our last promotion is not mapped yet)."""
        if self.champion_version is None:
            return None
        name = f"v{self.champion_version:04d}"
        if name not in self.registry_versions and self.champion_sha256:
            try:
                found = self.champion_source.version_of(self.champion_sha256)
            except Exception as error:  # only for the log line
                log.debug("no registry version for %s: %s", name, error)
                found = None
            if found is not None:
                self.registry_versions[name] = found
        return self.registry_versions.get(name, self.registry_champion)

    def _reset_lora(self) -> None:
        """LoRA back to its initial state: A as PEFT draws it (seeded), B = 0, so the draft is the base draft."""
        from peft.tuners.lora import LoraLayer

        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(self.trainer.settings.seed)
            for module in self.trainer.model.modules():
                if isinstance(module, LoraLayer):
                    for name in module.lora_A:
                        module.reset_lora_parameters(name, True)

    def _local_version(self, sha256: str) -> int | None:
        """The local version directory whose weights hash to sha256 (ours, registered before), or None."""
        for number, version in trainer_versions(self.adapters_dir).items():
            if version.metadata().get(SHA_TAG) == sha256:
                return number
        return None

    def _install(self, downloaded: Path, served) -> int:
        """Copy an adopted version in as the next vNNNN, its registry version added to its metadata."""
        version = self.next_version
        final = self.adapters_dir / f"v{version:04d}"
        temporary = self.adapters_dir / f".{final.name}.tmp"
        shutil.rmtree(temporary, ignore_errors=True)
        shutil.copytree(downloaded, temporary)
        AdapterDir(temporary).update_metadata(registry_version=served.version, adopted_at=time.time(),
                                              adopted_by=served.by, adopted_as=version)  # fmt: skip
        os.rename(temporary, final)
        self.next_version = version + 1
        return version

    def _draft_vocab(self) -> list[int]:
        """The tokens the target chose (its top-1) in the buffered traffic: the served draft's head.

        A domain's traffic uses a small part of the vocabulary: 64-token answers to a few hundred
        prompts of one kind touch about a thousand of the default model's 49152 tokens. The draft
        is restricted to them (`ModelDrafter.restrict_vocab`), which makes its step much cheaper.
        """
        chosen = {int(t) for example in self.buffer for t in example.target_topk_ids[:, 0].tolist()}
        chosen |= {int(t) for record in self.holdout.records for t in record.output_ids}
        return sorted(chosen)

    def _roll_back(self) -> None:
        """Copy the champion's LoRA weights back and clear the optimiser's moments."""
        with torch.no_grad():
            for name, parameter in self.trainer.model.named_parameters():
                if parameter.requires_grad:
                    parameter.copy_(self._champion_state[name])
        self.trainer.optimizer.state.clear()

    def _lora_state(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.trainer.model.named_parameters() if p.requires_grad}

    def _domain_mix(self, request_ids: set[str]) -> dict[str, int]:
        records = self._buffer_records
        domains = Counter(records[rid][0] or UNTAGGED for rid in request_ids if rid in records)
        return dict(sorted(domains.items()))

    def _champion_name(self) -> str:
        """E.g. v0004, or v0004 (registry version 4) once the registry is known to hold it, or base draft."""
        if self.champion_version is None:
            return "base draft"
        name = f"v{self.champion_version:04d}"
        registered = self.registry_versions.get(name)
        return f"{name} (registry version {registered})" if registered else name

    @staticmethod
    def _registry_name(version: str | None) -> str:
        return "the base draft" if version is None else version

    def _progress(self) -> str:
        last = self.last_result
        figures = (f", last round greedy match {last.candidate.greedy_match:.4f} vs champion "
                   f"{last.champion.greedy_match:.4f}, loss {last.loss:.4f}") if last else ""  # fmt: skip
        return (f"{self.records_consumed} records ({self.tokens_consumed} tokens) consumed, {len(self.buffer)} "
                f"buffered, {len(self.holdout)} held out, {len(self._unacked)} unacknowledged, {self.rounds} rounds "
                f"in {self.train_s:.1f} s, {self.adapters_promoted} promoted, champion {self._champion_name()}"
                f"{figures}")  # fmt: skip

    # ---------------------------------------------------------------- checkpoint state

    def _state(self) -> dict:
        return {
            "format": CHECKPOINT_FORMAT,
            "created_at": time.time(),
            "consumer": self.stream.consumer,
            "checkpoint_seq": self._checkpoint_seq,
            "champion_version": self.champion_version,
            "champion_sha256": self.champion_sha256,
            "registry_champion": self.registry_champion,
            "registry_versions": self.registry_versions,
            "adoptions": self.adoptions,
            "next_version": self.next_version,
            "base_version": self.base_version,
            "new_records": self.new_records,
            "counters": {name: getattr(self, name) for name in _COUNTERS},
            "rng": self.rng.bit_generator.state,
            "last_result": dataclasses.asdict(self.last_result) if self.last_result else None,
        }

    def _latest_checkpoint(self) -> tuple[dict | None, Path | None]:
        """(state.json, its adapter directory) of the checkpoint LATEST names, or (None, None)."""
        if self.checkpoint_dir is None or not (self.checkpoint_dir / LATEST).exists():
            return None, None
        directory = self.checkpoint_dir / (self.checkpoint_dir / LATEST).read_text().strip()
        state = json.loads((directory / "state.json").read_text())
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"checkpoint {directory} has format {state.get('format')}, this build reads "
                             f"{CHECKPOINT_FORMAT}")  # fmt: skip
        return state, directory / "adapter"

    def _restore(self, state: dict, directory: Path) -> None:
        if state["consumer"] != self.stream.consumer:
            log.warning("checkpoint %s was written by consumer %r, this trainer reads as %r: that consumer's "
                        "unacknowledged entries come back only after %d ms idle (XAUTOCLAIM)", directory,
                        state["consumer"], self.stream.consumer, self.reclaim_idle_ms)  # fmt: skip
        for record in _read_records(directory / "holdout.bin"):
            self._keep(record)
        for record in _read_records(directory / "buffer.bin"):
            self._keep(record)
        for name in _COUNTERS:
            setattr(self, name, state["counters"][name])
        self.champion_version = state["champion_version"]
        self.champion_sha256 = state.get("champion_sha256")
        weights = self.champion_path / WEIGHTS_FILE if self.champion_path is not None else None
        if "champion_sha256" not in state and weights is not None and weights.is_file():  # an older checkpoint
            self.champion_sha256 = sha256_file(weights)
        self.registry_champion = state.get("registry_champion")
        self.registry_versions = dict(state.get("registry_versions") or {})
        self.adoptions = state.get("adoptions", 0)
        self.next_version = state["next_version"]
        self.new_records = state["new_records"]
        self._checkpoint_seq = state["checkpoint_seq"]
        self.rng.bit_generator.state = state["rng"]
        if state["last_result"]:
            last = dict(state["last_result"])
            for side in ("candidate", "champion"):
                last[side] = GateFigures(**last[side]) if last[side] else None
            self.last_result = RoundResult(**last)
        log.info("resumed from %s: %d buffered, %d held out, champion %s, next version v%04d", directory,
                 len(self.buffer), len(self.holdout), self._champion_name(), self.next_version)  # fmt: skip


_COUNTERS = ("records_consumed", "tokens_consumed", "duplicates", "train_s", "adapters_promoted", "rounds",
             "promote_errors")  # fmt: skip


def _write_records(path: Path, encoded: Iterable[bytes]) -> None:
    _write_durably(path, b"".join(_LENGTH.pack(len(data)) + data for data in encoded))


def _read_records(path: Path) -> list[CorrectionRecord]:
    data, offset, records = path.read_bytes(), 0, []
    while offset < len(data):
        (length,) = _LENGTH.unpack_from(data, offset)
        offset += _LENGTH.size
        records.append(CorrectionRecord.decode(data[offset : offset + length]))
        offset += length
    return records


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
