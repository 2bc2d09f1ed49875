"""The standard EAGLE-3 head as the trainer holds it: `TrainableEagle3Head`, an `Eagle3Head`
(adaptive_spec/drafters/eagle3_head.py) that reads the target's aux states (`TargetStates`), scores itself for the
gate like the project's head (`ScoredHead`, trainer/learning/head_model.py), changes its draft vocabulary between
versions (`set_vocabulary`) and hands out and takes back its whole state (`state`, `put`). Trained by
trainer/learning/eagle3_distill.py.

    head = TrainableEagle3Head(target, draft_vocab_size=4096)   # untrained, over target ids 0..4095 until it trains
    head.set_vocabulary(torch.tensor([3, 7, 9, ...]))           # [4096] sorted target ids: their rows of the LM head
    head.gate_figures(records)                                  # GateFigures of its first draft token
    head.chain_figures(records, depth=4)                        # how it does on its own states, step by step

The draft vocabulary has one size for the head's life (the deployment's, TrainerSettings `draft_vocab_size`,
at most the target's vocabulary); which tokens it holds changes (trainer/learning/eagle3_vocab.py). The LM head's
rows are the target's rows of those tokens, so a new vocabulary is a new gather of them; a row whose token stays
keeps its own value (an LM head trained, or loaded from an imported version).

The gate scores the head over the target's vocabulary (`target_logits`: -inf off the draft vocabulary), as the
engine drafts with it, so its figures compare with any other draft's on the target's logged top-m.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from adaptive_spec.drafters.eagle3_head import Eagle3Head
from adaptive_spec.drafters.early_exit import decoder_layers
from trainer.learning.head_model import ScoredHead, TargetStates
from trainer.settings import TrainerSettings

DRAFT_VOCAB_SIZE = TrainerSettings.draft_vocab_size  # the deployment's setting, 4096 by default


class TrainableEagle3Head(ScoredHead, Eagle3Head):
    """An `Eagle3Head` with the target whose aux states it reads (`states`), a draft vocabulary of fixed size, and
    a switch to score it as the base draft is served (`whole_vocabulary`: the untrained head over the target's whole
    vocabulary, drafters/eagle3.py `Eagle3Drafter.base_head`)."""

    def __init__(
        self,
        target,
        draft_vocab_size: int = DRAFT_VOCAB_SIZE,
        state_dtype: torch.dtype = torch.float16,
        aux_layer_ids: tuple[int, ...] | None = None,
    ) -> None:
        if draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
        vocab = target.config.vocab_size
        super().__init__(target, aux_layer_ids, torch.arange(min(draft_vocab_size, vocab)))
        layers = len(decoder_layers(target, "eagle3"))
        if self.aux_layer_ids[-1] != layers:  # capture_states takes its last layer where it enters the final norm
            raise ValueError(
                f"aux layer ids {self.aux_layer_ids}: the trainer reads the last where it enters the target's final "
                f"norm, id {layers} (vLLM's numbering)"
            )
        self.states = TargetStates(target, state_dtype, tuple(i - 1 for i in self.aux_layer_ids))
        # the target's LM head (outside the module tree): every draft vocabulary's rows, and the base draft's
        self.lent = SimpleNamespace(lm_head=target.get_output_embeddings())
        self.whole_vocabulary = False
        self.draft_index: torch.Tensor  # [vocab] int64: each target id's draft id, -1 outside the draft vocabulary
        self.register_buffer("draft_index", torch.full((vocab,), -1, device=self.draft_ids.device), persistent=False)
        self.draft_index[self.draft_ids] = torch.arange(len(self.draft_ids), device=self.draft_ids.device)

    # ---------------------------------------------------------------- what the gate and the screen read

    def vocab_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """[positions, h] -> [positions, vocab]: the draft vocabulary's logits at their target ids, -inf elsewhere."""
        if self.whole_vocabulary:
            return self.lent.lm_head(self.norm(predicted))
        return self.target_logits(predicted)

    def draft_tokens(self, predicted: torch.Tensor) -> torch.Tensor:
        """[positions, h] -> [positions]: the greedy draft's target ids, without scattering the whole vocabulary."""
        if self.whole_vocabulary:
            return self.vocab_logits(predicted).argmax(-1)
        return self.draft_ids[self.logits(predicted).argmax(-1)]

    def get_input_embeddings(self) -> torch.nn.Module:
        """The target's embedding: the ids the head reads (the trainer's screen, trainer/intake/screening.py)."""
        return self.shared.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        """The target's LM head: the ids the head is scored on (`vocab_logits` covers the target's vocabulary)."""
        return self.lent.lm_head

    # ---------------------------------------------------------------- the draft vocabulary and the whole state

    def set_vocabulary(self, target_ids: torch.Tensor) -> bool:
        """Draft over `target_ids` ([draft_vocab] int64, sorted, as many as now); False when they are the same.

        Example: draft ids [2, 5, 9] -> [2, 9, 11]: the rows of 2 and 9 stay as they are, 11's is the target's."""
        target_ids = target_ids.long().flatten().to(self.draft_ids.device)
        if target_ids.shape != self.draft_ids.shape or bool((target_ids[1:] <= target_ids[:-1]).any()):
            raise ValueError(f"a draft vocabulary here is {len(self.draft_ids)} rising target ids")
        if torch.equal(target_ids, self.draft_ids):
            return False
        with torch.no_grad():
            was = self.draft_index[target_ids]  # [draft_vocab]: each token's row now, -1 for a new one
            rows = self.lent.lm_head.weight[target_ids.to(self.lent.lm_head.weight.device)].to(self.lm_head.weight)
            kept = was >= 0
            rows[kept] = self.lm_head.weight[was[kept]]
            self.lm_head.weight.copy_(rows)
            self.draft_ids.copy_(target_ids)
            self.draft_index.fill_(-1)
            self.draft_index[target_ids] = torch.arange(len(target_ids), device=target_ids.device)
        return True

    def state(self) -> dict[str, torch.Tensor]:
        """A copy of everything a version holds: every weight (fc, the layer, norm, lm_head), the draft vocabulary
        (`draft_ids`) and the residual's convention (`norm_before_residual`, a 0-d bool)."""
        state = {name: tensor.detach().clone() for name, tensor in self.state_dict().items()}
        state["draft_ids"] = self.draft_ids.clone()
        state["norm_before_residual"] = torch.tensor(self.norm_before_residual)
        return state

    def put(self, state: dict[str, torch.Tensor]) -> None:
        """The weights, vocabulary and convention of a `state()`, copied in place (an optimiser keeps its weights)."""
        self.set_vocabulary(state["draft_ids"])
        weights = {name: tensor for name, tensor in state.items() if name not in ("draft_ids", "norm_before_residual")}
        with torch.no_grad():
            self.load_state_dict(weights)
        self.norm_before_residual = bool(state["norm_before_residual"])
