"""Build a drafter from what `Engine(target, draft)` takes: a spec string, a draft model or a Drafter.

drafter = make_drafter("ngram+head", target, vocab_size(target), torch.device("cpu"))
"""

from __future__ import annotations

import torch

from adaptive_spec.drafters import Drafter
from adaptive_spec.drafters.eagle3 import Eagle3Drafter
from adaptive_spec.drafters.early_exit import build_early_exit
from adaptive_spec.drafters.free_first import FreeFirstDrafter
from adaptive_spec.drafters.head import HeadDrafter
from adaptive_spec.drafters.model import ModelDrafter
from adaptive_spec.drafters.ngram import NgramDrafter
from adaptive_spec.drafters.spec import DraftSpec, DraftSpecError, parse_draft_spec


def vocab_size(model) -> int:
    """Rows of the model's LM head (the config's vocab_size may differ from it)."""
    head = model.get_output_embeddings()
    return head.weight.shape[0] if head is not None else model.config.vocab_size


def make_drafter(draft, target, target_vocab: int, device: torch.device) -> Drafter | None:
    """None for no draft; a Drafter passes through."""
    if draft is None:
        return None
    if isinstance(draft, str):
        spec = parse_draft_spec(draft)
        if spec.kind == "ngram":
            return NgramDrafter(spec.max_ngram, device)
        drafter: Drafter
        if spec.kind == "early-exit":
            drafter = ModelDrafter(
                build_early_exit(target, spec.layers), name=str(DraftSpec("early-exit", spec.layers))
            )
        elif spec.kind == "head":
            drafter = HeadDrafter(target)
        elif spec.kind == "eagle3":
            drafter = Eagle3Drafter(target)
        else:
            raise DraftSpecError(
                f"unknown draft spec {draft!r}: use early-exit:N, head, eagle3, ngram, ngram:N, ngram+<draft>, or a model "
                f"(Engine.from_pretrained loads a draft model by name)"
            )
        return FreeFirstDrafter(NgramDrafter(spec.max_ngram, device), drafter) if spec.free_first else drafter
    if isinstance(draft, torch.nn.Module):
        return model_drafter(draft, target_vocab, type(draft).__name__)
    if isinstance(draft, Drafter):
        return draft
    raise DraftSpecError(f"draft must be a spec string, a model or a Drafter, got {type(draft).__name__}")


def model_drafter(draft: torch.nn.Module, target_vocab: int, name: str) -> ModelDrafter:
    """A separate draft model, checked to share the target's vocabulary."""
    draft_vocab = vocab_size(draft)
    if draft_vocab != target_vocab:
        raise DraftSpecError(
            f"the draft's vocabulary has {draft_vocab} tokens and the target's {target_vocab}; a separate "
            f"draft must share the target's tokenizer and vocabulary (or use early-exit:N or ngram)"
        )
    return ModelDrafter(draft.eval().requires_grad_(False), name=name)


def loaded_drafter(spec: DraftSpec, draft: torch.nn.Module, target_vocab: int) -> Drafter:
    """The drafter of a `model` spec whose model is loaded: the model, behind free proposals for
    `ngram+<model>`."""
    drafter = model_drafter(draft, target_vocab, spec.source)
    if spec.free_first:
        return FreeFirstDrafter(NgramDrafter(spec.max_ngram, next(draft.parameters()).device), drafter)
    return drafter
