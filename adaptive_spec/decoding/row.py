"""One request in a batch: its record (STYLE.md §17), and what the step does for one row alone.

A batch (batch.py) keeps a `Row` per request next to the caches that hold all rows: the context, the
row's slot in those caches, its adapter, constraints, acceptance estimates, trace and output so far.
What the step decides for each row on its own lives here too: how far it may draft (`draft_limit`), the
tokens its grammar forces after its draft (`forced_tail`), its verdict on what it drafted (`verdict`:
greedy or rejection sampling, a chain or a tree, under its constraints), and its finished output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from adaptive_spec.decoding.request import GenerationOutput, Request, Trace, cut_at_stop
from adaptive_spec.drafters import Proposal
from adaptive_spec.drafters.slots import AdapterSlot
from adaptive_spec.formats.stats import RequestStats
from adaptive_spec.outputs.constraints import Constraints
from adaptive_spec.sample.acceptance import (
    Verdict,
    greedy_accept,
    greedy_accept_choices,
    rejection_sample,
    tree_greedy_accept,
    tree_rejection_sample,
)
from adaptive_spec.sample.sampling import logits_to_probs

MAX_FORCED = 16  # grammar-forced tokens appended to a row's chain in one step (each widens the verify)


@dataclass(eq=False)
class Row:
    """One request in a batch: its context, its place in the caches, and what it has produced."""

    request: Request
    slot: int  # the row's index in the batch's caches (rows stay packed: it moves when others leave)
    alpha: float  # where the row starts (DynamicK.alpha_for); it drafts by its key's profile once that is measured
    ids: list[int]  # the context; its last token is pending (not yet in the target's cache)
    stats: RequestStats
    trace: Trace
    started: float
    out: list[int] = field(default_factory=list)
    finish: str | None = None
    draft_state: object = None  # what the drafter keeps for this row (the head: the target's states)
    adapter: AdapterSlot | None = None  # what the row drafts with: its domain's adapter, the general one, or none
    constraints: Constraints | None = None  # penalties, logit bias, grammar: applied to target and draft logits
    free_alpha: float = 0.5  # its acceptance estimate of free proposals (ngram+ drafts), for dynamic k
    emitted_last: int = 0  # tokens its last step emitted: the most a draft that was there feeds at the next

    @property
    def key(self) -> tuple[str | None, str | None]:
        """What the row's acceptance is kept by (dynamic_k.py): its domain and adapter version."""
        return self.request.domain, None if self.adapter is None else self.adapter.version

    @property
    def params(self):
        return self.request.params

    @property
    def generator(self) -> torch.Generator | None:
        return self.request.generator

    def draft_limit(self, max_context: int | None, can_draft: bool) -> int:
        """How many tokens this row may draft now: a step emits k + 1 tokens at most."""
        limit = self.request.max_new_tokens - len(self.out) - 1
        if max_context is not None:
            limit = min(limit, max_context - len(self.ids) - 1)
        if not (can_draft and self.request.speculative) or limit <= 0:
            return 0
        if self.request.k is None and self.request.streamed and not self.out:
            return 0  # time to first token: a streamed request's first step is the target's alone (Request.streamed)
        return limit

    def forced_tail(self, proposal: Proposal, limit: int) -> Proposal:
        """The row's chain extended by the tokens its grammar forces after it (grammar.py `Matcher.forced`), up
        to `limit` (the most the row may draft now) and MAX_FORCED: one more verify column each, no draft
        forward, and accepted wherever the target writes the forced bytes as usual. Only a dynamic-k row with
        a grammar proposing a chain gets them, even one the policy left to plain decoding. Example: a forced
        tool call whose draft proposed `search_flights` gets `", "arguments": ` appended to verify in the same
        forward. Lossless as any draft is: the target verifies every token, and a sampled row's forced token is
        a one-hot draft distribution (rejection sampling keeps it with the target's probability). Rows of a
        fixed k draft exactly k, as asked."""
        if self.constraints is None or self.request.k is not None or proposal.parents is not None:
            return proposal
        drafted = proposal.tokens.tolist()
        tail = self.constraints.forced_after(drafted, min(limit - len(drafted), MAX_FORCED))
        return _extended(proposal, tail) if tail else proposal

    def verdict(
        self, proposal: Proposal, raw: torch.Tensor, choices: list[int] | None
    ) -> tuple[Proposal, torch.Tensor, Verdict]:
        """The row's verdict on its proposal from the target's logits `raw` [k + 1, vocab] (a tree's: [nodes + 1,
        vocab]); `choices`: the target's argmaxes where the batch computed them for a plain greedy row. A tree's
        verdict is the path the target kept: from here on the row's proposal is that path (with the columns it
        was verified at) and its logits those of the path. The trace keeps the raw logits: what the target wanted."""
        if proposal.parents is not None:
            return self._tree_verdict(proposal, raw)
        logits = raw if self.constraints is None else self.constraints.target(raw, proposal.tokens.tolist())
        if choices is not None:
            verdict = greedy_accept_choices(proposal.tokens.tolist(), choices)
        elif self.params.greedy:
            verdict = greedy_accept(proposal.tokens, logits)
        else:
            target_probs = logits_to_probs(logits, self.params)  # [k + 1, vocab]
            verdict = rejection_sample(proposal.tokens, proposal.probs, target_probs, self.generator)
        return proposal, raw, verdict

    def _tree_verdict(self, tree: Proposal, raw: torch.Tensor) -> tuple[Proposal, torch.Tensor, Verdict]:
        """A tree's verdict (acceptance.py), as the chain of the path it kept. raw: [nodes + 1, vocab]."""
        tokens, parents = tree.tokens.tolist(), tree.parents
        assert parents is not None, "a tree proposal has parents"
        paths: list[list[int]] = [[]]  # per verify column: the draft tokens before it (column 0: the pending token)
        for node, parent in enumerate(parents):
            paths.append([*paths[parent + 1], tokens[node]])
        logits = raw
        if self.constraints is not None:  # each node's distribution under the grammar and penalties of its own path
            per_node = [self.constraints.target(raw[[0]], [])[0]]
            for node in range(len(tokens)):
                along = raw[[0, *_columns(parents, node)]]  # [depth + 1, vocab]: the root, then the path
                per_node.append(self.constraints.target(along, paths[node + 1])[-1])
            logits = torch.stack(per_node)
        if self.params.greedy:
            kept = tree_greedy_accept(tree.tokens, parents, logits)
        else:
            kept = tree_rejection_sample(tree.tokens, parents, logits_to_probs(logits, self.params), self.generator)
        columns = [0, *(node + 1 for node in kept.path)]
        depth = max(len(path) for path in paths)
        path = Proposal(
            tree.tokens[kept.path],
            None,
            tree.forwards,
            tree.fed,
            tree.free,
            verified=len(tokens),
            depth=depth,
            columns=columns,
        )
        return path, raw[columns], Verdict(len(kept.path), kept.next_token)

    def output(self, decode) -> GenerationOutput:
        """The finished row's output; `decode` turns token ids into text (None without a tokenizer)."""
        self.trace.truncate(len(self.out))
        self.stats.wall_s = time.perf_counter() - self.started
        self.stats.adapter_version = None if self.adapter is None else self.adapter.version  # at the end, if it changed
        topk_ids, topk_logprobs = self.trace.stacked(len(self.out))
        assert self.finish is not None, "an output is made once its row finished"
        text = cut_at_stop(decode(self.out), self.request.stop)
        logprobs = self.trace.token_logprobs if self.request.logprobs is not None else None
        top_logprobs = self.trace.top_logprobs if self.request.logprobs else None
        return GenerationOutput(
            self.out,
            text,
            self.finish,
            self.stats,
            list(self.request.prompt_ids),
            self.trace.proposed,
            self.trace.accepted,
            topk_ids,
            topk_logprobs,
            logprobs,
            top_logprobs,
        )


def _columns(parents: list[int], node: int) -> list[int]:
    """The verify columns of `node`'s ancestors and itself, root first (column = node + 1)."""
    chain = []
    while node >= 0:
        chain.append(node + 1)
        node = parents[node]
    return chain[::-1]


def _extended(proposal: Proposal, tail: list[int]) -> Proposal:
    """A chain with the grammar's forced tokens `tail` after it (Row.forced_tail)."""
    extra = torch.tensor(tail, dtype=torch.long, device=proposal.tokens.device)
    probs = proposal.probs
    if probs is not None:  # a sampled chain: each forced token a one-hot draft distribution
        probs = torch.cat([probs, torch.nn.functional.one_hot(extra, probs.shape[-1]).to(probs.dtype)])
    return replace(proposal, tokens=torch.cat([proposal.tokens, extra]), probs=probs, forced=len(tail))
