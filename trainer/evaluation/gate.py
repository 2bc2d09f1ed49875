"""The evaluation gate: is a candidate adapter better than the champion on held-out recent traffic?

    champion = draft_agreement(trainer.model, holdout.records)          # before training, or the served adapter
    with adapters_disabled(trainer.model):
        base = draft_agreement(trainer.model, holdout.records)          # the draft with no adapter
    ...train...
    candidate = draft_agreement(trainer.model, holdout.records)
    accept, reason = Gate().decide(candidate, champion)

Run its tests: `.venv/bin/python -m pytest tests/trainer/test_gate.py -q`.

Both figures are teacher-forced over the held-out records: the draft reads the context the target
saw and is scored at every output position, with no generation and no target forward (the record
holds the target's top-m).

- greedy_match = mean over positions of [argmax draft logits == the target's top-1]. Under greedy
  serving a drafted token is accepted exactly when this holds, so it is the per-token acceptance
  of greedy decoding.
- expected_acceptance = mean over positions of sum over the target's top-m ids i of
  min(q(i), p_t(i)), with q the draft's softmax and p_t = exp(logged logprob), not renormalised.
  Sum over the whole vocabulary, this is the probability that rejection sampling at temperature 1
  accepts a drafted token (Leviathan et al. 2023, "beta"). The ids outside the top-m are missing
  from the sum and every term is >= 0, so the figure is a lower bound; the gap is at most the
  target's mass outside its top-m (1 - sum of p_t), tiny at m = 16.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from peft import PeftModel
from peft.tuners.tuners_utils import BaseTunerLayer

from adaptive_spec.formats.record import CorrectionRecord
from trainer.evaluation.decision import RecordScores
from trainer.intake.examples import Batch, TrainingExample, collate, examples_from_record, micro_batches


def causal_lm(model):
    """The transformers causal LM inside a PeftModel, or the model itself."""
    return model.get_base_model() if isinstance(model, PeftModel) else model


def draft_logits(model, batch: Batch) -> torch.Tensor:
    """The draft's logits at the batch's positions only: [positions, vocab], float32.

    The LM head runs on the kept positions alone (for a 49k vocabulary that is most of the cost
    saved). This assumes logits = lm_head(final hidden state), true of the Llama family that
    early exit supports (Llama, Mistral, Qwen, SmolLM).
    """
    lm = causal_lm(model)
    hidden = lm.get_decoder()(
        input_ids=batch.input_ids.to(lm.device), attention_mask=batch.attention_mask.to(lm.device), use_cache=False
    ).last_hidden_state  # [batch, seq, hidden]
    picked = hidden[batch.rows.to(lm.device), batch.cols.to(lm.device)]  # [positions, hidden]
    return lm.get_output_embeddings()(picked).float()  # [positions, vocab]


@dataclass(frozen=True)
class GateFigures:
    """Agreement of one draft with the target over a held-out set; NaN figures when positions == 0."""

    expected_acceptance: float  # mean sum_i min(q(i), p_t(i)) over the top-m: a lower bound
    greedy_match: float  # fraction of positions where the draft's argmax is the target's top-1
    positions: int  # output positions scored
    # per held-out record, for the statistical gate (trainer/evaluation/decision.py); not kept in metadata or checkpoints
    records: RecordScores | None = field(default=None, compare=False, repr=False)

    def as_dict(self) -> dict:
        """The figures as adapter metadata and checkpoints keep them."""
        return {
            "expected_acceptance": self.expected_acceptance,
            "greedy_match": self.greedy_match,
            "positions": self.positions,
        }


@torch.inference_mode()
def draft_agreement(
    draft_model,
    records: Iterable[CorrectionRecord | TrainingExample],
    batch_tokens: int = 2048,
    max_seq_len: int = 1024,
) -> GateFigures:
    """Teacher-forced agreement of `draft_model` (plain, PEFT-wrapped, or with transformers-loaded
    adapters, in whatever adapter state it is in) with the target's logged top-m.

    A draft that needs more than the tokens to run scores itself through its own `gate_figures`
    (same arguments): a head draft reads the target's hidden states (trainer/learning/head_distill.py).
    """
    own = getattr(causal_lm(draft_model), "gate_figures", None)
    if own is not None:
        return own(records, batch_tokens, max_seq_len)
    examples = [r if isinstance(r, TrainingExample) else examples_from_record(r, max_seq_len) for r in records]
    tally = Tally()
    for group in micro_batches([example for example in examples if example.num_positions], batch_tokens):
        batch = collate(group)
        owners = [group[row].request_id for row in batch.rows.tolist()]
        tally.add(draft_logits(draft_model, batch), batch.target_topk_ids, batch.target_topk_logprobs, owners)
    return tally.figures()


class Tally:
    """Sums of the gate's figures over batches of positions, in total and per held-out record."""

    def __init__(self) -> None:
        self.expected, self.matched, self.positions = 0.0, 0, 0
        self.by_record: dict[str, list[float]] = {}  # record -> [matched, expected, positions]

    def add(
        self,
        logits: torch.Tensor,
        target_topk_ids: torch.Tensor,
        target_topk_logprobs: torch.Tensor,
        owners: Sequence[str] | None = None,
    ) -> None:
        """logits [positions, vocab]; the target's top-m ids [positions, m] and logprobs [positions, m]
        (-inf where padded); `owners`, the record each position belongs to (for per-record scores)."""
        topk_ids = target_topk_ids.to(logits.device)  # [positions, m]
        logprobs = target_topk_logprobs.to(logits.device)  # [positions, m]
        draft_probs = torch.softmax(logits.float(), dim=-1).gather(-1, topk_ids)  # [positions, m]
        expected = torch.minimum(draft_probs, logprobs.exp()).double().sum(-1)  # [positions]; padding: exp(-inf) = 0
        target_top1 = topk_ids.gather(-1, logprobs.argmax(-1, keepdim=True))[:, 0]  # [positions]
        matched = logits.argmax(-1) == target_top1  # [positions]
        self.expected += float(expected.sum())
        self.matched += int(matched.sum())
        self.positions += len(target_top1)
        if owners is not None:
            for owner, hit, share in zip(owners, matched.tolist(), expected.tolist(), strict=True):
                sums = self.by_record.setdefault(owner, [0, 0.0, 0])
                sums[0] += hit
                sums[1] += share
                sums[2] += 1

    def figures(self) -> GateFigures:
        if self.positions == 0:
            return GateFigures(math.nan, math.nan, 0)
        records = None
        if self.by_record:
            ordered = [self.by_record[key] for key in sorted(self.by_record)]  # the same order on both sides
            records = RecordScores(*(list(column) for column in zip(*ordered, strict=True)))
        return GateFigures(self.expected / self.positions, self.matched / self.positions, self.positions, records)


@contextlib.contextmanager
def adapters_disabled(model) -> Iterator[None]:
    """Run the base draft: PEFT's disable_adapter() for a PeftModel; for a model with adapters
    injected in place (transformers' load_adapter) every LoRA layer is switched off and then back
    to its own previous state; nothing to do for a plain model."""
    if isinstance(model, PeftModel):
        with model.disable_adapter():
            yield
        return
    layers = [module for module in model.modules() if isinstance(module, BaseTunerLayer)]
    were_disabled = [layer.disable_adapters for layer in layers]
    requires_grad = [(p, p.requires_grad) for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer, disabled in zip(layers, were_disabled, strict=True):
            layer.enable_adapters(not disabled)
        for parameter, flag in requires_grad:  # PEFT's enable_adapters(True) marks adapters trainable
            parameter.requires_grad_(flag)


@dataclass(frozen=True)
class Gate:
    """Promote a candidate only when it clearly beats the champion on the same held-out positions.

    Accept iff all hold:
      1. both figures come from the same held-out set (equal `positions`), and there are at least
         `min_positions` of them;
      2. candidate.greedy_match >= champion.greedy_match + margin;
      3. candidate.expected_acceptance >= champion.expected_acceptance (not worse under sampling).

    Why these defaults: the figures are paired (same positions), so the noise in the difference
    comes only from the positions where the two drafts disagree. With a fraction d of such
    positions over n, its standard error is about sqrt(d / n): 0.01 at d = 0.1, n = 1000. A margin
    of 0.01 at >= 1000 positions (about 16 records of 64 tokens) thus asks for roughly one standard
    error of real gain; this refuses a copy of the champion and noise-level changes while letting
    the steady gains of online training through (DESIGN.md: 0.02 -> 0.63 in 2 minutes).
    """

    min_positions: int = 1000
    margin: float = 0.01

    def decide(self, candidate: GateFigures, champion: GateFigures) -> tuple[bool, str]:
        if candidate.positions != champion.positions:
            return False, (
                f"figures come from different held-out sets ({candidate.positions} vs {champion.positions} positions)"
            )
        if candidate.positions < self.min_positions:
            return False, f"only {candidate.positions} held-out positions, need {self.min_positions}"
        gain = candidate.greedy_match - champion.greedy_match
        if not gain >= self.margin:
            return False, (
                f"greedy match {candidate.greedy_match:.4f} vs champion {champion.greedy_match:.4f}: "
                f"gain {gain:+.4f} below the margin {self.margin}"
            )
        if not candidate.expected_acceptance >= champion.expected_acceptance:
            return False, (
                f"expected acceptance fell: {candidate.expected_acceptance:.4f} vs champion "
                f"{champion.expected_acceptance:.4f}"
            )
        return True, (
            f"greedy match {champion.greedy_match:.4f} -> {candidate.greedy_match:.4f} ({gain:+.4f}), "
            f"expected acceptance {champion.expected_acceptance:.4f} -> "
            f"{candidate.expected_acceptance:.4f} over {candidate.positions} positions"
        )
