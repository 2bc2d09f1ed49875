"""The online trainer's checkpoint: everything a restarted trainer needs, written atomically.

    path = write_checkpoint(data_dir / "trainer", 7, trainer.save, buffer_bytes, holdout_bytes, state)
    state, adapter_dir = latest_checkpoint(data_dir / "trainer")   # (None, None) before the first one

An online trainer (trainer/loop/online.py) writes and reads its parts through the two above: each gives
its share of the state and takes it back (the intake its records and counters, the rounds theirs, the
lineages their champions), and the entries a checkpoint covers are acknowledged once it is written:

    path = write_parts(data_dir / "trainer", 7, "trainer-1", trainer.save, lineages=lineages, intake=intake,
                       rounds=rounds, versions=versions, base_version=None)
    restore_parts(state, path, "trainer-1", lineages=lineages, intake=intake, rounds=rounds, versions=versions)
    parts_changed(lineages, intake, rounds)     # a round ran, a champion moved, or entries wait

A checkpoint is a directory `ckpt-NNNNNN` written under a temporary name, renamed, and named by the
file `LATEST` (replaced atomically), so a crash mid-write leaves the last complete one in place:

    adapter/       the champion's weights (a LoRA in PEFT's layout, the base draft's zero adapter before any promotion;
                   an EAGLE-3 head's whole checkpoint)
    buffer.bin     replay-buffer records, oldest first   } each a uint32 little-endian byte length
    holdout.bin    held-out records, oldest first        } + CorrectionRecord.encode()
    state.json     a `CheckpointState`: the counters, the champion's version and sha256, the next
                   version number, the sampler's state, the registry version in sync and the local ->
                   registry version map, each domain's champion and new-record count

Only the newest checkpoint is kept. The optimiser's moments are not saved: a resumed trainer starts
them afresh, as `DraftTrainer.load` does.

Tests: `.venv/bin/python -m pytest tests/trainer/test_online.py tests/reliability/test_trainer_kill.py -q`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from adaptive_spec.formats.record import CorrectionRecord
from trainer.intake.intake import StreamIntake
from trainer.loop.domains import DomainLineages
from trainer.loop.rounds import Rounds
from trainer.promotion.versions import VersionDirs

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
LATEST = "LATEST"  # names the complete checkpoint directory
_LENGTH = struct.Struct("<I")


@dataclass
class CheckpointState:
    """What state.json holds: one writer (`write_checkpoint`), one reader (`latest_checkpoint`). Each
    part of the trainer gives and takes its own share (`write_parts` and `restore_parts`)."""

    consumer: str  # the consumer name that wrote it
    checkpoint_seq: int
    champion: dict  # the general champion's state (trainer/promotion/champion.py `Champion.state`)
    next_version: int
    new_records: int  # the general lineage's training records since its last round
    counters: dict  # the intake's and the rounds' counters
    rng: dict  # the sampler's bit generator state
    last_result: dict | None = None  # the last round's result (trainer/loop/rounds.py `result_state`)
    domains: dict = field(default_factory=dict)  # each domain's champion state and new-record count
    base_version: str | int | None = None
    created_at: float = field(default_factory=time.time)

    def to_json(self) -> dict:
        """The flat layout of format 1: the champion's keys at the top level."""
        state = dataclasses.asdict(self)
        return {"format": CHECKPOINT_FORMAT, **state.pop("champion"), **state}

    @classmethod
    def from_json(cls, data: dict) -> CheckpointState:
        names = {f.name for f in dataclasses.fields(cls)} - {"champion"}
        champion = {key: value for key, value in data.items() if key not in names and key != "format"}
        return cls(champion=champion, **{key: value for key, value in data.items() if key in names})


def write_checkpoint(
    directory: Path,
    seq: int,
    save_adapter: Callable[[Path], object],
    buffer: Iterable[bytes],
    holdout: Iterable[bytes],
    state: CheckpointState,
) -> Path:
    """Write checkpoint number `seq` (encoded records, the state, and the adapter `save_adapter`
    writes into the directory it is given), make it the LATEST, drop the older ones."""
    directory.mkdir(parents=True, exist_ok=True)
    name = f"ckpt-{seq:06d}"
    temporary = directory / f".{name}.tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    save_adapter(temporary / "adapter")
    write_records(temporary / "buffer.bin", buffer)
    write_records(temporary / "holdout.bin", holdout)
    _write_durably(temporary / "state.json", json.dumps(state.to_json(), indent=2, sort_keys=True).encode())
    shutil.rmtree(directory / name, ignore_errors=True)  # left by a crash before LATEST named it
    os.rename(temporary, directory / name)
    _write_durably(directory / f".{LATEST}.tmp", name.encode())
    os.replace(directory / f".{LATEST}.tmp", directory / LATEST)
    _fsync_dir(directory)
    for old in directory.glob("ckpt-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return directory / name


def latest_checkpoint(directory: Path | None) -> tuple[CheckpointState | None, Path | None]:
    """(state.json, the checkpoint directory) of the checkpoint LATEST names, or (None, None)."""
    if directory is None or not (directory / LATEST).exists():
        return None, None
    checkpoint = directory / (directory / LATEST).read_text().strip()
    state = json.loads((checkpoint / "state.json").read_text())
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"checkpoint {checkpoint} has format {state.get('format')}, this build reads {CHECKPOINT_FORMAT}"
        )
    return CheckpointState.from_json(state), checkpoint


def write_parts(
    directory: Path,
    seq: int,
    consumer: str,
    save_adapter: Callable[[Path], object],
    *,
    lineages: DomainLineages,
    intake: StreamIntake,
    rounds: Rounds,
    versions: VersionDirs,
    base_version: str | int | None,
) -> Path:
    """Checkpoint `seq` of an online trainer: the champion's weights (`save_adapter`; between rounds the
    model holds them), the buffer, the held-out set and every part's state, written atomically; then
    the entries they contain are acknowledged. Returns the checkpoint directory."""
    covered = intake.unacked  # everything routed so far is in what is written below
    round_state = rounds.state()
    state = CheckpointState(
        consumer=consumer,
        checkpoint_seq=seq,
        champion=lineages.general.champion.state(),
        next_version=versions.next,
        new_records=lineages.general.new_records,
        counters={**intake.counters(), **round_state["counters"]},
        rng=round_state["rng"],
        last_result=round_state["last_result"],
        domains=lineages.state(),
        base_version=base_version,
    )
    holdout = (record.encode() for record in intake.holdout.records)
    path = write_checkpoint(directory, seq, save_adapter, intake.encoded_buffer(), holdout, state)
    rounds.changed = False
    for lineage in lineages.every():
        lineage.champion.changed = False
    intake.ack(covered)
    return path


def restore_parts(
    state: CheckpointState,
    checkpoint: Path,
    consumer: str,
    *,
    lineages: DomainLineages,
    intake: StreamIntake,
    rounds: Rounds,
    versions: VersionDirs,
) -> None:
    """Each part takes its share of the checkpoint back: the records (held-out first, so every record
    keeps its place), the counters, the champions (each domain's weights from its version
    directory, then the general champion's back in the model), the next version, the sampler."""
    if state.consumer != consumer:
        log.warning(
            "checkpoint %s was written by consumer %r, this trainer reads as %r: that consumer's unacknowledged "
            "entries come back only after %d ms idle (XAUTOCLAIM)",
            checkpoint,
            state.consumer,
            consumer,
            intake.reclaim_idle_ms,
        )
    for record in read_records(checkpoint / "holdout.bin") + read_records(checkpoint / "buffer.bin"):
        intake.keep(record)
    intake.load_counters(state.counters)
    rounds.load_state(state.counters, state.rng, state.last_result)
    lineages.general.champion.load_state(state.champion)
    lineages.load_state(state.domains)
    lineages.general.champion.roll_back()  # a domain's champion was loaded into the model to read its weights
    versions.next = max(versions.next, state.next_version)
    lineages.general.new_records = state.new_records


def parts_changed(lineages: DomainLineages, intake: StreamIntake, rounds: Rounds) -> bool:
    """Whether a checkpoint now would write anything the last one did not: a round ran, a champion
    moved, or routed entries wait for one to be acknowledged."""
    champions_changed = any(lineage.champion.changed for lineage in lineages.every())
    return rounds.changed or champions_changed or bool(intake.unacked)


def write_records(path: Path, encoded: Iterable[bytes]) -> None:
    _write_durably(path, b"".join(_LENGTH.pack(len(data)) + data for data in encoded))


def read_records(path: Path) -> list[CorrectionRecord]:
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
