"""What a request asks for, what it gets back, and what each row records on the way.

`Request` is a checked request (`Engine.request` builds it); `GenerationOutput` is the finished
result, `Chunk` what one decoding step adds while streaming, and `Trace` the per-position record
(proposed, accepted, the target's top-m) that becomes a correction record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from adaptive_spec.drafters import Proposal
from adaptive_spec.formats.stats import RequestStats
from adaptive_spec.outputs.constraints import Penalties
from adaptive_spec.outputs.grammar import Grammar
from adaptive_spec.sample.acceptance import Verdict
from adaptive_spec.sample.sampling import SamplingParams


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    k: int | None  # a fixed k for this request; None = the policy's
    stop: tuple[str, ...]
    speculative: bool
    generator: torch.Generator | None  # None for greedy requests
    domain: str | None = None  # drafts with this domain's adapter when the engine holds one
    penalties: Penalties = field(default_factory=Penalties)
    grammar: Grammar | None = None  # a compiled response_format (grammar.py)
    logprobs: int | None = None  # None: none; n: the emitted token's log-probability and the n most likely
    # whether the output keeps the target's top-m per position (Engine.record_topk) for a correction record;
    # a server sets False where none will be written (no correction log, or the request opted out of it)
    record: bool = True
    # whether a client reads the tokens as they come: at dynamic k its first step is then the target's alone, so
    # the first token does not wait for the draft to catch up on the prompt (Engine.generate's need not)
    streamed: bool = True


@dataclass
class GenerationOutput:
    token_ids: list[int]  # generated tokens only; EOS, or the token completing a stop string, included
    text: str | None  # None without a tokenizer; ends before a stop string, which it does not contain
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: RequestStats
    prompt_ids: list[int]
    proposed: list[int]  # [n_out] the draft token proposed at each output position, or -1
    accepted: list[bool]  # [n_out] whether the output token is an accepted draft token
    target_topk_ids: torch.Tensor | None = None  # [n_out, m] the target's top-m tokens per position
    target_topk_logprobs: torch.Tensor | None = None  # [n_out, m] their log-probabilities
    logprobs: list[float] | None = None  # [n_out] the target's log-probability of each output token
    top_logprobs: list[list[tuple[int, float]]] | None = None  # [n_out][n] the n most likely, when asked


@dataclass
class Chunk:
    """What one decoding step adds while streaming. The last chunk carries the whole output."""

    token_ids: list[int]
    finish_reason: str | None = None
    output: GenerationOutput | None = None
    index: int = 0  # which of a request's n choices (a server sets it)


@dataclass
class Trace:
    """Per output position: what was proposed, what was kept, the target's top-m (for the
    correction record) and, when the request asks, the log-probabilities it reports.

    Log-probabilities are the target's own, from its raw logits (before penalties, bias, grammar
    or temperature), as a plain forward over the output gives them: the same with and without
    speculation, since the target computed them while verifying.
    """

    topk: int
    logprobs: int | None = None  # None: not asked; n: the emitted token's and the n most likely
    proposed: list[int] = field(default_factory=list)
    accepted: list[bool] = field(default_factory=list)
    topk_ids: list[torch.Tensor] = field(default_factory=list)  # each [emitted, m]
    topk_logprobs: list[torch.Tensor] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    def record(self, proposal: Proposal, verdict: Verdict, target_logits: torch.Tensor, emitted: list[int]) -> None:
        """target_logits: [k + 1, vocab] the row's raw logits at the verified positions."""
        drafted = proposal.tokens.tolist()
        n = verdict.num_accepted
        self.proposed += drafted[: n + 1] + [-1] * (n + 1 - len(drafted[: n + 1]))
        self.accepted += [True] * n + [False]
        if not self.topk and self.logprobs is None:
            return
        logprobs = torch.log_softmax(target_logits[: n + 1].float(), dim=-1)  # [n + 1, vocab]
        if self.topk:
            top = logprobs.topk(self.topk, dim=-1)
            self.topk_ids.append(top.indices)
            self.topk_logprobs.append(top.values)
        if self.logprobs is not None:
            chosen = torch.tensor(emitted, device=logprobs.device)
            self.token_logprobs += logprobs.gather(1, chosen[:, None])[:, 0].tolist()
            if self.logprobs:
                top = logprobs.topk(self.logprobs, dim=-1)
                self.top_logprobs += [
                    list(zip(ids, values, strict=True))
                    for ids, values in zip(top.indices.tolist(), top.values.tolist(), strict=True)
                ]

    def truncate(self, length: int) -> None:
        del self.proposed[length:], self.accepted[length:], self.token_logprobs[length:], self.top_logprobs[length:]

    def stacked(self, length: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not self.topk:
            return None, None
        if not self.topk_ids:
            return torch.zeros(0, self.topk, dtype=torch.long), torch.zeros(0, self.topk)
        return torch.cat(self.topk_ids)[:length].cpu(), torch.cat(self.topk_logprobs)[:length].cpu()


def cut_at_stop(text: str | None, stops: tuple[str, ...]) -> str | None:
    """The text before the first stop string, which is not part of the output (as in OpenAI's API)."""
    if text is None or not stops:
        return text
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]
