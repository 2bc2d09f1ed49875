"""What an online trainer's state.json holds, and how a trainer is rebuilt from a checkpoint.

    write_checkpoint(..., trainer_state(trainer))     # trainer/online.py OnlineTrainer.checkpoint
    restore_trainer(trainer, state, checkpoint_dir)   # OnlineTrainer.__init__, on the latest checkpoint

state.json (trainer/checkpoint.py writes it atomically with the records and the champion's adapter):
the consumer name, the checkpoint sequence, the general champion (version, sha256, registry map),
each domain's champion and new-record count (trainer/domains.py), the next version number, the
counters, the sampler's state and the last round's result. A restored trainer re-routes the
checkpoint's records (held-out first, so every record keeps its place), then loads each domain
champion's weights from its version directory and puts the general champion's back in the model.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from trainer.checkpoint import read_records
from trainer.gate import GateFigures
from trainer.rounds import RoundResult, result_state

log = logging.getLogger("trainer.online")

INTAKE_COUNTERS = ("records_consumed", "tokens_consumed", "duplicates", "rejected")
COUNTERS = (*INTAKE_COUNTERS, "train_s", "adapters_promoted", "rounds", "promote_errors", "rounds_failed",
            "records_set_aside")  # fmt: skip


def trainer_state(trainer) -> dict:
    """What state.json holds (trainer/checkpoint.py lists it)."""
    return {
        "created_at": time.time(),
        "consumer": trainer.stream.consumer,
        "checkpoint_seq": trainer.checkpoint_seq,
        **trainer.champion.state(),
        "next_version": trainer.versions.next,
        "base_version": trainer.settings.base_version,
        "new_records": trainer.general.new_records,
        "counters": {name: getattr(trainer, name) for name in COUNTERS},
        "rng": trainer.rng.bit_generator.state,
        "last_result": result_state(trainer.last_result) if trainer.last_result else None,
        "domains": trainer.lineages.state(),
    }


def restore_trainer(trainer, state: dict, checkpoint: Path) -> None:
    if state["consumer"] != trainer.stream.consumer:
        log.warning(
            "checkpoint %s was written by consumer %r, this trainer reads as %r: that consumer's unacknowledged "
            "entries come back only after %d ms idle (XAUTOCLAIM)",
            checkpoint,
            state["consumer"],
            trainer.stream.consumer,
            trainer.settings.reclaim_idle_ms,
        )
    for record in read_records(checkpoint / "holdout.bin") + read_records(checkpoint / "buffer.bin"):
        trainer.intake.keep(record)
    # the screen refused some of them (kept before it existed): counted on top of the counters restored
    refused, trainer.intake.rejected = trainer.intake.rejected, {}
    for name, value in state["counters"].items():
        setattr(trainer.intake if name in INTAKE_COUNTERS else trainer, name, value)
    for reason, count in refused.items():
        trainer.intake.rejected[reason] = trainer.intake.rejected.get(reason, 0) + count
    trainer.champion.load_state(state)
    trainer.lineages.load_state(state.get("domains", {}))
    trainer.champion.roll_back()  # a domain's champion was loaded into the model to read its weights
    trainer.versions.next = max(trainer.versions.next, state["next_version"])
    trainer.general.new_records = state["new_records"]
    trainer.checkpoint_seq = state["checkpoint_seq"]
    trainer.rng.bit_generator.state = state["rng"]
    if state["last_result"]:
        last = dict(state["last_result"])
        for side in ("candidate", "champion"):
            last[side] = GateFigures(**last[side]) if last[side] else None
        trainer.last_result = RoundResult(**last)
    log.info("resumed from %s: %s", checkpoint, trainer.progress())
