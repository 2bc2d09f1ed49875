"""The one place a trainer is assembled from its settings: `adaptive-spec train` (and so `up`, which runs
it as a child) and every benchmark that trains build theirs here.

    draft, vocab = load_draft(settings)                       # the draft module the trainer owns
    trainer = build_trainer(settings, draft, stream, on_promote=pending.submit,
                            champion_source=RegistryChampion(registry, pending))
    trainer = build_trainer(settings, draft, stream, checkpoints=False, holdout_fraction=0.2)   # a benchmark's

`online_settings` turns the process's settings into the loop's (`OnlineSettings`: the version and
checkpoint directories under `data_dir`, the statistical gate at the settings' confidence and floor);
keyword overrides set any other field of the loop's, such as a benchmark's larger held-out share.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from adaptive_spec.contracts import ADAPTERS_DIR, CHECKPOINT_DIR
from adaptive_spec.drafters.spec import DraftSpecError, parse_draft_spec
from adaptive_spec.models import load_model, resolve_device, resolve_dtype
from trainer.evaluation.decision import StatisticalGate, Thresholds
from trainer.intake.stream import CorrectionStream
from trainer.learning.distill import LoraSettings
from trainer.learning.drafts import TARGET_DRAFTS, trainable_draft
from trainer.loop.online import OnlineSettings, OnlineTrainer
from trainer.settings import TrainerSettings

log = logging.getLogger(__name__)


def online_settings(settings: TrainerSettings, *, checkpoints: bool = True, **overrides) -> OnlineSettings:
    """The loop's settings for these process settings; `checkpoints=False`: none (acknowledge at once)."""
    data_dir = Path(settings.data_dir)
    values = dict(
        checkpoint_dir=data_dir / CHECKPOINT_DIR if checkpoints else None,
        target_id=settings.target,
        draft_id=settings.draft,
        gate=StatisticalGate(
            Thresholds(confidence=settings.gate_confidence, min_positions=settings.gate_min_positions)
        ),
        min_new_records=settings.min_new_records,
        round_steps=settings.round_steps,
        max_round_steps=max(settings.max_round_steps, settings.round_steps),
        idle_after_s=settings.idle_after_s or None,
        max_domains=settings.max_domains,
        lora=LoraSettings(autocast=settings.autocast),
    )
    return OnlineSettings(data_dir / ADAPTERS_DIR, **{**values, **overrides})


def build_trainer(
    settings: TrainerSettings,
    draft_model: torch.nn.Module,
    stream: CorrectionStream,
    *,
    checkpoints: bool = True,
    on_promote=None,
    champion_source=None,
    trainer_class: type[OnlineTrainer] = OnlineTrainer,
    **overrides,
) -> OnlineTrainer:
    """An online trainer over `stream` training `draft_model` (which it owns: LoRA goes into it in place)."""
    online = online_settings(settings, checkpoints=checkpoints, **overrides)
    return trainer_class(draft_model, stream, online, on_promote=on_promote, champion_source=champion_source)


def lendable(target: torch.nn.Module, settings: TrainerSettings) -> torch.nn.Module | None:
    """`target` when it is in the dtype and on the device the trainer trains in, so that a serving engine can
    lend it to an in-process trainer (bench-drift, distill); None otherwise, and `load_draft` loads the
    trainer's own, as `adaptive-spec train` does (a server in bf16, a trainer in fp32: the draft's fp32 layers
    cannot take bf16 states)."""
    weight = next(target.parameters())
    device = resolve_device(settings.device)
    same = weight.dtype == resolve_dtype(settings.dtype, device) and weight.device.type == device.type
    return target if same else None


def load_draft(settings: TrainerSettings, target: torch.nn.Module | None = None) -> tuple[torch.nn.Module, int]:
    """(the draft module a trainer owns, the vocabulary size) for the settings' draft spec: an early exit, a head
    or an EAGLE-3 head (over `draft_vocab_size` tokens) built on `target` (loaded from the settings when None), or
    a separate draft model."""
    spec = parse_draft_spec(settings.draft)
    if not spec.trainable:
        raise DraftSpecError(
            f"the {spec} draft has no weights to train; use early-exit:N, head, eagle3 or a draft model"
        )
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    if spec.kind in TARGET_DRAFTS:  # the target lends its layers (and, to a head, its hidden states)
        if target is None:
            log.info("loading %s for the draft %s on %s in %s", settings.target, spec, device, dtype)
            target = load_model(settings.target, device, dtype)[0]
        return trainable_draft(spec, target, draft_vocab_size=settings.draft_vocab_size), target.config.vocab_size
    log.info("loading the draft %s on %s in %s", spec, device, dtype)
    model = load_model(spec.source, device, dtype)[0]
    return model, model.config.vocab_size
