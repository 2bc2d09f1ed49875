"""The module a trainer trains for a draft spec, built on the target that lends it its weights, and the trainer
that trains it.

    draft = trainable_draft(parse_draft_spec("head"), target)          # TrainableHead(target)
    draft = trainable_draft(parse_draft_spec("eagle3"), target, draft_vocab_size=4096)  # TrainableEagle3Head
    draft = trainable_draft(parse_draft_spec("early-exit:4"), target)  # the target's first 4 layers
    trainer_for(draft)        # Eagle3Trainer, HeadTrainer or DraftTrainer: what OnlineTrainer builds for it

`ngram+<draft>` trains the draft after the plus: prompt lookup has nothing to learn. A separate
draft model is loaded by the caller (it needs no target); prompt lookup alone trains nothing.
"""

from __future__ import annotations

import torch

from adaptive_spec.drafters.early_exit import build_early_exit
from adaptive_spec.drafters.spec import DraftSpec, DraftSpecError
from trainer.learning.distill import DraftTrainer, TrainedWeights
from trainer.learning.eagle3_distill import Eagle3Trainer
from trainer.learning.eagle3_model import DRAFT_VOCAB_SIZE, TrainableEagle3Head
from trainer.learning.head_distill import HeadTrainer
from trainer.learning.head_model import TrainableHead

TARGET_DRAFTS = ("early-exit", "head", "eagle3")  # draft kinds built from the target's own weights


def trainable_draft(
    spec: DraftSpec, target: torch.nn.Module, *, draft_vocab_size: int = DRAFT_VOCAB_SIZE
) -> torch.nn.Module:
    """The draft module of `spec` over `target` (which stays untouched: what trains is the draft's own);
    `draft_vocab_size` is an EAGLE-3 head's (at most the target's vocabulary: all of it then)."""
    if spec.kind == "early-exit":
        return build_early_exit(target, spec.layers)
    if spec.kind == "head":
        return TrainableHead(target)
    if spec.kind == "eagle3":
        return TrainableEagle3Head(target, draft_vocab_size)
    raise DraftSpecError(f"the {spec} draft is not built from the target; this trains {', '.join(TARGET_DRAFTS)}")


def trainer_for(draft_model: torch.nn.Module) -> type[TrainedWeights]:
    """The trainer class of a draft module: a head in the standard EAGLE-3 layout trains whole (Eagle3Trainer),
    the project's head (HeadTrainer) and every other draft (DraftTrainer) through LoRA."""
    if isinstance(draft_model, TrainableEagle3Head):
        return Eagle3Trainer
    if isinstance(draft_model, TrainableHead):
        return HeadTrainer
    return DraftTrainer
