"""The module a trainer trains for a draft spec, built on the target that lends it its weights.

    draft = trainable_draft(parse_draft_spec("head"), target)          # TrainableHead(target)
    draft = trainable_draft(parse_draft_spec("early-exit:4"), target)  # the target's first 4 layers
    OnlineTrainer(draft, stream, settings)     # builds a HeadTrainer or a DraftTrainer for it

`ngram+<draft>` trains the draft after the plus: prompt lookup has nothing to learn. A separate
draft model is loaded by the caller (it needs no target); prompt lookup alone trains nothing.
"""

from __future__ import annotations

import torch

from adaptive_spec.drafters.early_exit import build_early_exit
from adaptive_spec.drafters.spec import DraftSpec, DraftSpecError
from trainer.learning.head_model import TrainableHead

TARGET_DRAFTS = ("early-exit", "head")  # draft kinds built from the target's own weights


def trainable_draft(spec: DraftSpec, target: torch.nn.Module) -> torch.nn.Module:
    """The draft module of `spec` over `target` (which stays untouched: LoRA goes into the draft)."""
    if spec.kind == "early-exit":
        return build_early_exit(target, spec.layers)
    if spec.kind == "head":
        return TrainableHead(target)
    raise DraftSpecError(f"the {spec} draft is not built from the target; this trains {' or '.join(TARGET_DRAFTS)}")
