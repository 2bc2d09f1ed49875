"""What a row's logits go through before a token is chosen: penalties, logit bias, a grammar.

Applied in the same way to the target's logits at every verified position and to the draft's
logits at every drafted position, so that a constrained request stays lossless: the target
alone would choose from exactly these processed logits, and the draft proposes from its own
processed logits (a better draft, not a condition of correctness: the target verifies all).

Per position, in this order (the formulas of OpenAI's API and of vLLM):

    repetition:  logit / p if logit > 0 else logit * p     for tokens in the prompt or the output
    frequency:   logit -= frequency_penalty * count          count = times in the output so far
    presence:    logit -= presence_penalty * (count > 0)
    logit_bias:  logit += bias[token]
    grammar:     logit = -inf where the JSON grammar forbids the token

At verified position i the "output so far" includes the drafts d1..di before it, exactly as it
would for the target alone had it produced them. Example: the output so far is [7, 9, 7] and the
draft is [9, 4]; with frequency_penalty 0.5, token 7 loses 1.0 at every position, token 9 loses
0.5 at the first position (after the pending token) and 1.0 at the next (after d1 = 9).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaptive_spec.outputs.grammar import Matcher

# A smaller one divides logits to infinity (5e-324 is a float > 0): NaN probabilities.
MIN_REPETITION_PENALTY = 0.01


@dataclass(frozen=True)
class Penalties:
    frequency: float = 0.0  # OpenAI: -2 .. 2
    presence: float = 0.0  # OpenAI: -2 .. 2
    repetition: float = 1.0  # Hugging Face / vLLM: in [MIN_REPETITION_PENALTY, 10], 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in -100 .. 100)

    @property
    def active(self) -> bool:
        return bool(self.frequency or self.presence or self.repetition != 1.0 or self.logit_bias)

    def validate(self, vocab_size: int) -> None:
        for name, value in (("frequency_penalty", self.frequency), ("presence_penalty", self.presence)):
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not MIN_REPETITION_PENALTY <= self.repetition <= 10.0:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 10], got {self.repetition}")
        for token, bias in self.logit_bias:
            if not 0 <= token < vocab_size:
                raise ValueError(f"logit_bias: token id {token} is not in [0, {vocab_size})")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias: the bias of token {token} must be in [-100, 100], got {bias}")


class Constraints:
    """One row's processing state: the counts of its output tokens and its grammar matcher."""

    def __init__(
        self,
        penalties: Penalties,
        matcher: Matcher | None,
        prompt_ids: list[int],
        vocab_size: int,
        device: torch.device,
    ):
        self.penalties = penalties
        self.matcher = matcher
        self.counts = torch.zeros(vocab_size, device=device)  # [vocab] times each token is in the output
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [vocab]
        self.in_prompt[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
        self.bias = None
        if penalties.logit_bias:
            self.bias = torch.zeros(vocab_size, device=device)  # [vocab]
            for token, value in penalties.logit_bias:
                self.bias[token] = value
        self._ahead = 0  # tokens the matcher consumed past the committed output (while drafting)

    def target(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """logits [m, vocab] at the pending position and after each of drafts[: m - 1] -> processed."""
        m = logits.shape[0]
        counts = self.counts.expand(m, -1).clone()  # [m, vocab]
        for i, token in enumerate(drafts[: m - 1]):
            counts[i + 1 :, token] += 1
        out = self._penalise(logits.float(), counts)
        if self.matcher is not None:
            out = out.masked_fill(~self._masks_along(drafts[: m - 1], m), float("-inf"))
        return out

    def draft(self, logits: torch.Tensor, drafted: list[int], ids: torch.Tensor | None) -> torch.Tensor:
        """A draft's logits [n_vocab] after the output plus `drafted` -> processed; `ids` maps a
        restricted vocabulary to token ids (None: the whole vocabulary)."""
        counts = self.counts.clone()
        for token in drafted:
            counts[token] += 1
        if ids is not None:
            counts = counts[ids]
        out = self._penalise(logits.float()[None], counts[None], ids)[0]
        if self.matcher is not None:
            self._advance(drafted)
            mask = self.matcher.mask().to(out.device)
            out = out.masked_fill(~(mask if ids is None else mask[ids]), float("-inf"))
        return out

    def forced_after(self, drafted: list[int], limit: int) -> list[int]:
        """At most `limit` tokens the grammar forces after the output plus `drafted` (grammar.py
        `Matcher.forced`); [] without a grammar, or where the grammar refuses a drafted token (the target
        rejects the draft there)."""
        if self.matcher is None or limit <= 0:
            return []
        self._advance(drafted)
        if self._ahead < len(drafted):
            return []
        return self.matcher.forced(limit)

    def commit(self, tokens: list[int]) -> None:
        """The row's output grew by `tokens` (every one allowed: each was chosen from processed logits)."""
        for token in tokens:
            self.counts[token] += 1
        if self.matcher is not None:
            self._advance([])
            for token in tokens:
                if self.matcher.ended:  # tokens after an EOS are cut from the output
                    break
                if not self.matcher.accept(token):
                    raise RuntimeError(f"token {token} was emitted but the grammar forbids it")

    def _penalise(self, logits: torch.Tensor, counts: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """logits, counts [m, n] (n = vocab, or the restricted ids) -> penalised logits [m, n]."""
        p = self.penalties
        if p.repetition != 1.0:
            seen = (counts > 0) | (self.in_prompt if ids is None else self.in_prompt[ids])
            scaled = torch.where(logits > 0, logits / p.repetition, logits * p.repetition)
            logits = torch.where(seen, scaled, logits)
        if p.frequency:
            logits = logits - p.frequency * counts
        if p.presence:
            logits = logits - p.presence * (counts > 0).to(logits.dtype)
        if self.bias is not None:
            logits = logits + (self.bias if ids is None else self.bias[ids])
        return logits

    def _matcher(self):
        """The grammar's matcher; the grammar paths run only for rows that have one."""
        if self.matcher is None:
            raise AssertionError("a row without a grammar has no grammar masks")
        return self.matcher

    def _masks_along(self, drafts: list[int], m: int) -> torch.Tensor:
        """Grammar masks [m, vocab] at the pending position and after each draft token the grammar
        accepts; past a forbidden draft (which the target then rejects) the last mask repeats."""
        matcher = self._matcher()
        self._advance([])
        masks = [matcher.mask()]
        taken = 0
        for token in drafts:
            if not matcher.accept(token):
                break
            taken += 1
            mask = matcher.mask()
            masks.append(mask if mask.any() else masks[-1])  # after an accepted EOS the row ends there
        matcher.rollback(taken)
        masks += [masks[-1]] * (m - len(masks))
        return torch.stack(masks).to(self.counts.device)

    def _advance(self, drafted: list[int]) -> None:
        """Put the matcher at the committed output followed by `drafted` (as far as it allows)."""
        matcher = self._matcher()
        if self._ahead:
            matcher.rollback(self._ahead)
            self._ahead = 0
        for token in drafted:
            if not matcher.accept(token):
                break
            self._ahead += 1
