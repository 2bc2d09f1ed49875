"""A batch of rows decoded together, one speculative step at a time (continuous batching).

    batch = engine.new_batch(max_rows=8)
    row = batch.add(engine.request(prompt, max_new_tokens=64))   # its prefill runs now
    while len(batch):
        for row, chunk in batch.step():                          # every row advances one step
            ...                                                  # chunk.output is set once a row is done

Rows join between two steps (`add` runs the prompt's prefill into a free row of the caches) and
leave at the end of the step that finishes them, or whenever the caller removes them (a client
gone, a timeout). Nobody waits for the slowest row.

Each step is draft -> verify -> accept -> commit over every row at once:

- draft: the drafter proposes up to k_i tokens for each row (one draft forward per draft token
  covers all rows);
- verify: one target forward over [pending, d1..dk_i] of every row, padded to one width, each row
  at its own positions against its own cached context (kv.BatchCache);
- accept: each row keeps its own prefix of the draft, by its own rule (greedy, or rejection
  sampling with its own generator);
- commit: each row's context grows by what it kept, and each row's caches (target and draft) are
  rolled back by their own amount.

Per-row state lives in one record, `Row` (row.py), next to the caches that hold all rows, with what the step
decides for a row on its own (its verdict, its grammar's forced tokens, its output). k for the step
comes from the policy (dynamic_k.py), which weighs the batch's cost of drafting against its
rows' acceptance.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any

import torch

from adaptive_spec.cache import feeding, kv
from adaptive_spec.decoding.prefill import ChunkedPrefill
from adaptive_spec.decoding.request import Chunk, Request, Trace
from adaptive_spec.decoding.row import Row
from adaptive_spec.drafters import Proposal, no_proposal
from adaptive_spec.formats.stats import RequestStats, StepStats
from adaptive_spec.outputs.constraints import Constraints
from adaptive_spec.sample.acceptance import Verdict, target_choices

# Prompts prefilled together (Batch.add_many) when this many tokens or fewer are left after their cached prefix:
# the tails an exact repeat leaves (prefix_cache.BLOCK - 1 at most, or 16 where the last block is whole).
# Longer ones go alone: a forward over many tokens is bound by its arithmetic, and rows padded to the
# longest would cost more than they save.
JOINT_PREFILL_TOKENS = 16


class Batch:
    def __init__(self, engine, max_rows: int):
        if max_rows < 1:
            raise ValueError(f"a batch needs at least one row, got max_rows={max_rows}")
        self.engine = engine
        self.max_rows = max_rows
        self.rows: list[Row] = []
        self.target_cache = kv.BatchCache.for_model(engine.target)
        self.draft_cache = engine.drafter.new_cache() if engine.drafter is not None else None
        for cache in (self.target_cache, self.draft_cache):
            if cache is not None:
                cache.row_capacity = max_rows
        self.last_step = (0, 0)  # (rows, k) of the latest step: what a server's metrics count
        self.drafter = engine.drafter
        self.wants_hidden = self.drafter is not None and self.drafter.wants_target_hidden
        self._verified_hidden: list[torch.Tensor] | None = None  # per row [k + 1, hidden], from the last verify
        # per row, from the last verify: the target's k + 1 argmaxes (plain greedy rows), else None
        self._choices: list[list[int] | None] = []
        self.prefills = ChunkedPrefill(engine.target, self.wants_hidden)  # long prompts joining a busy batch
        self.prefixes = engine.prefix_cache  # prompts' cached prefixes (prefix_cache.py), or None

    def __len__(self) -> int:
        return len(self.rows) + len(self.prefills)

    @property
    def full(self) -> bool:
        return len(self) >= self.max_rows

    # ---------------------------------------------------------------- rows come and go

    def add(self, request: Request) -> Row:
        """Prefill a request's prompt into a new row; it decodes from the next step on. A long
        prompt arriving while other rows decode is prefilled a chunk per step instead (prefill.py)."""
        return self.add_many([request])[0]

    def add_many(self, requests: list[Request]) -> list[Row]:
        """Rows for requests that arrived together, as `add` makes them, in order. On the compiled path the
        prompts whose uncached rest is short (at most JOINT_PREFILL_TOKENS: the tail a prefix-cache hit
        leaves) are prefilled in one forward, as a step's rows are: a forward of a few tokens costs little
        more for 8 rows than for one, so 8 requests arriving at once no longer hold the batch for 8 forwards.
        Each row's keys and values are what it would get alone (the step's rows are invariant, exact.check).
        If anything fails on the way (a row's constraints, a prefill), none of the rows stays in the batch:
        a row that joined and was never prefilled would decode from an empty cache."""
        if self.full:
            raise RuntimeError(f"the batch is full ({self.max_rows} rows)")
        if len(self) + len(requests) > self.max_rows:
            raise RuntimeError(f"the batch has room for {self.max_rows - len(self)} rows, not {len(requests)}")
        rows: list[Row] = []
        with self._all_or_none(rows):
            prefills = []
            for request in requests:
                row = self._new_row(request)
                rows.append(row)
                prompt = row.ids[:-1]  # the last token is fed by the first step
                hit = self.prefixes.lookup(prompt) if self.prefixes is not None and prompt else None
                row.stats.cached_tokens = 0 if hit is None else hit.length
                if self.prefills.worth_staging(len(row.ids) - row.stats.cached_tokens, len(self.rows)):
                    self.prefills.stage(row, hit)
                    continue
                self._join(row)
                if prompt:
                    prefills.append((row, hit))
            together = self.engine.path == "compiled"
            joint: list[tuple[Row, Any]] = []
            alone: list[tuple[Row, Any]] = []
            for row, hit in prefills:
                short = len(row.ids) - 1 - row.stats.cached_tokens <= JOINT_PREFILL_TOKENS
                (joint if together and short else alone).append((row, hit))
            for group in ([joint] if joint else []) + [[p] for p in alone]:
                self._prefill(group)
        return rows

    @contextmanager
    def _all_or_none(self, rows: list[Row]):
        """If the block raises, the rows it made so far (`rows`, filled as it goes) leave the batch."""
        try:
            yield
        except BaseException:
            for row in rows:
                self.remove(row)
            raise

    def _prefill(self, group: list[tuple[Row, Any]]) -> None:
        """Prefill joined rows' prompts (each after its cached prefix, `prefix_cache.Hit` or None) in one forward."""
        started = self.engine.clock()  # no step lock: the prefill runs the target only, which swaps never touch
        for row, hit in group:
            if hit is not None:
                self.target_cache.write_row(row.slot, hit.keys, hit.values)
        feeds = [row.ids[row.stats.cached_tokens : -1] for row, _ in group]
        out = feeding.feed(
            self.engine.target, self.target_cache, [row.slot for row, _ in group], feeds, hidden=self.wants_hidden
        )
        for i, (row, hit) in enumerate(group):
            states = out[1][i, out[1].shape[1] - len(feeds[i]) :] if self.wants_hidden else None  # right-aligned
            if hit is not None and states is not None:
                states = torch.cat([hit.states, states])
            if self.prefixes is not None:
                self.prefixes.insert(row.ids[:-1], self.target_cache, row.slot, states)
            if self.drafter is not None:
                self.drafter.on_prefill(row, states)  # positions 0 .. len - 2
            row.stats.prefill_s = self.engine.clock() - started

    def _join_staged(self) -> None:
        """Feed one chunk of a staged prompt; a prompt whose last chunk is in joins the batch."""
        finished = self.prefills.advance(self.engine.clock)
        if finished is None:
            return
        row, states, seconds = finished
        self._join(row)
        if self.prefixes is not None:
            self.prefixes.insert(row.ids[:-1], self.prefills.cache, 0, states)
        self.prefills.copy_into(self.target_cache, row.slot)
        if self.drafter is not None:
            self.drafter.on_prefill(row, states)
        row.stats.prefill_s = seconds

    def add_group(self, requests: list[Request]) -> list[Row]:
        """Rows for requests that share one prompt (OpenAI's `n`): the first is prefilled, the others
        copy its cache, so the prompt is computed once. If one fails, none of the group stays in the batch
        (rows nobody reads would decode on, and the worker knows no job of theirs)."""
        if len(self) + len(requests) > self.max_rows:
            raise RuntimeError(f"the batch has room for {self.max_rows - len(self)} rows, not {len(requests)}")
        if any(request.prompt_ids != requests[0].prompt_ids for request in requests):
            raise ValueError("a group of rows shares one prompt")
        rows: list[Row] = []
        with self._all_or_none(rows):
            first = self.add(requests[0])
            rows.append(first)
            for request in requests[1:]:
                if first in self.prefills:  # its prompt is staged: the copies are prefilled on their own
                    rows.append(self.add(request))
                    continue
                row = self._new_row(request)
                rows.append(row)
                self._join(row)
                self.target_cache.copy_row(first.slot, row.slot)
                if self.drafter is not None:
                    self.drafter.on_copy_row(first, row)
        return rows

    def _new_row(self, request: Request) -> Row:
        """A row for a request, not yet in the batch (no slot: `_join` gives it one)."""
        trace = Trace(self.engine.record_topk if request.record else 0, request.logprobs)
        return Row(request, -1, 0.0, list(request.prompt_ids), RequestStats(), trace, time.perf_counter())

    def _join(self, row: Row) -> None:
        """Give a new row its slot, adapter, acceptance estimates and constraints."""
        engine, request = self.engine, row.request
        row.slot = len(self.rows)
        row.adapter = engine.adapters.for_domain(request.domain) if self.drafter is not None else None
        row.stats.adapter_version = None if row.adapter is None else row.adapter.version
        row.alpha = engine.policy.alpha_for(row.key, None if row.adapter is None else row.adapter.gated_alpha)
        row.free_alpha = engine.policy.free_alpha_for(row.key)
        if request.penalties.active or request.grammar is not None:
            matcher = None if request.grammar is None else request.grammar.new_matcher()
            row.constraints = Constraints(
                request.penalties, matcher, request.prompt_ids, engine.vocab_size, engine.device
            )
        self.target_cache.add_row()
        if self.draft_cache is not None:
            self.draft_cache.add_row()  # the draft catches up lazily, on the row's first proposal
        self.rows.append(row)

    def remove(self, row: Row) -> None:
        """Take a row out (finished, cancelled or timed out); the last row moves into its slot."""
        if self.prefills.remove(row):
            return
        slot = row.slot
        if not 0 <= slot < len(self.rows) or self.rows[slot] is not row:  # never joined (slot -1), or gone
            return
        last = self.rows.pop()
        for cache in (self.target_cache, self.draft_cache):
            if cache is not None:
                cache.remove_row(slot)
        if last is not row:
            self.rows[slot] = last
            last.slot = slot

    def adapters_changed(self) -> None:
        """The engine's adapters changed (a swap, a rollback, an eviction): each row drafts with what
        its domain now maps to. A row whose adapter changed forgets its draft cache (its keys and
        values came from other weights) and drafts by its new key's figures (for a new version: its gated one)."""
        for row in self.rows:
            adapter = self.engine.adapters.for_domain(row.request.domain)
            if adapter is row.adapter:
                continue
            row.adapter = adapter
            if self.draft_cache is not None:
                self.draft_cache.set_length(row.slot, 0)
            row.alpha = self.engine.policy.alpha_for(row.key, None if adapter is None else adapter.gated_alpha)
            row.free_alpha = self.engine.policy.free_alpha_for(row.key)

    # ---------------------------------------------------------------- the step

    def step(self) -> list[tuple[Row, Chunk]]:
        """Advance every row by one speculative step; finished rows leave the batch."""
        self._join_staged()
        if not self.rows:
            return []
        with self.engine.step_lock:
            ks, free, limits = self._choose_k()
            proposals, draft_s = self._draft(ks, free, limits)
            target_logits, verify_s = self._verify(proposals)
            proposals, target_logits, verdicts = self._accept(proposals, target_logits)
            self._observe(proposals, draft_s, verify_s)
            emitted = self._commit(proposals, verdicts)
        self.last_step = (len(self.rows), max(ks))
        results = [
            (row, self._advance(row, p, v, logits, tokens, draft_s, verify_s))
            for row, p, v, logits, tokens in zip(self.rows, proposals, verdicts, target_logits, emitted, strict=True)
        ]
        for row, _ in results:
            if row.finish is not None:
                self.remove(row)
        return results

    def _choose_k(self) -> tuple[list[int], list[list[int]] | None, list[int]]:
        """Per row, how many tokens to draft and, for a draft with free proposals, the one it copies or [];
        and the most it may draft now."""
        policy, drafter = self.engine.policy, self.drafter
        limits = [row.draft_limit(self.engine.max_context, drafter is not None) for row in self.rows]
        fixed = [row.request.k for row in self.rows]
        caps = [min(lim, policy.k_max if want is None else want) for want, lim in zip(fixed, limits, strict=True)]
        free = drafter.free_proposals(self.rows, caps) if drafter is not None else None
        profiles = [policy.profile_for(row.key, row.alpha) if row.request.k is None else None for row in self.rows]
        return (*policy.plan(fixed, limits, profiles, [row.free_alpha for row in self.rows], free), limits)

    def _draft(self, ks: list[int], free: list[list[int]] | None, limits: list[int]) -> tuple[list[Proposal], float]:
        started = self.engine.clock()
        if not any(ks):
            proposals = [no_proposal(self.engine.device) for _ in self.rows]
        else:
            policy, depths = self.engine.policy, None
            if policy.tree_budget is not None and self.drafter.builds_trees:  # k is each tree's depth
                depths = ks
                copied = free or [[] for _ in ks]
                ks = [k if copy else policy.tree_nodes(k) for k, copy in zip(ks, copied, strict=True)]
            proposals = self.drafter.propose(self.draft_cache, self.rows, ks, free, depths)
        proposals = [row.forced_tail(p, limit) for row, p, limit in zip(self.rows, proposals, limits, strict=True)]
        return proposals, self.engine.clock() - started

    def _verify(self, proposals: list[Proposal]) -> tuple[list[torch.Tensor], float]:
        """One target forward over every row's [pending, d1..dk], a chain or a tree: per row logits [k + 1, vocab]."""
        started = self.engine.clock()
        feeds = [[row.ids[-1], *p.tokens.tolist()] for row, p in zip(self.rows, proposals, strict=True)]
        trees = None
        if any(p.parents is not None for p in proposals):  # every node sees the context and its ancestors
            trees = [
                kv.TreeFeed.from_parents(
                    self.target_cache.lengths[row.slot],
                    [-1, *(q + 1 for q in p.parents)] if p.parents is not None else list(range(-1, len(p.tokens))),
                )
                for row, p in zip(self.rows, proposals, strict=True)
            ]
        out = feeding.feed(
            self.engine.target,
            self.target_cache,
            [row.slot for row in self.rows],
            feeds,
            all_logits=True,
            hidden=self.wants_hidden,
            trees=trees,
        )
        logits, hidden = out if self.wants_hidden else (out, None)  # [batch, width, vocab], [batch, width, hidden]
        width = logits.shape[1]
        per_row = [logits[i, width - len(feed) :] for i, feed in enumerate(feeds)]
        self._verified_hidden = (
            None if hidden is None else [hidden[i, width - len(feed) :] for i, feed in enumerate(feeds)]
        )
        plain = [  # rows whose verdict is the target's argmax as it stands: greedy, unconstrained, a chain
            row.params.greedy and row.constraints is None and p.parents is None
            for row, p in zip(self.rows, proposals, strict=True)
        ]
        every = target_choices(logits) if any(plain) else []  # [batch][width], in one operation
        self._choices = [
            every[i][width - len(f) :] if keep else None for i, (f, keep) in enumerate(zip(feeds, plain, strict=True))
        ]
        return per_row, self.engine.clock() - started

    def _accept(
        self, proposals: list[Proposal], target_logits: list[torch.Tensor]
    ) -> tuple[list[Proposal], list[torch.Tensor], list[Verdict]]:
        """Each row's verdict (Row.verdict); a tree's proposal and logits become those of the path it kept."""
        settled = [
            row.verdict(proposal, raw, choices)
            for row, proposal, raw, choices in zip(self.rows, proposals, target_logits, self._choices, strict=True)
        ]
        return [p for p, _, _ in settled], [raw for _, raw, _ in settled], [v for _, _, v in settled]

    def _commit(self, proposals: list[Proposal], verdicts: list[Verdict]) -> list[list[int]]:
        """Extend each row's context and roll its caches back to it; return the emitted tokens."""
        emitted = []
        for i, (row, proposal, verdict) in enumerate(zip(self.rows, proposals, verdicts, strict=True)):
            tokens = [*proposal.tokens[: verdict.num_accepted].tolist(), verdict.next_token]
            before = len(row.ids)
            row.ids += tokens
            if row.constraints is not None:
                row.constraints.commit(tokens)
            columns = proposal.columns or list(range(verdict.num_accepted + 1))
            if proposal.columns is not None:  # a tree's path: its keys and values to a chain's slots
                self.target_cache.keep(row.slot, before - 1, columns)
            self.target_cache.set_length(row.slot, len(row.ids) - 1)
            if self.drafter is not None:  # kept: the pending token's and the accepted drafts' states
                kept = None if self._verified_hidden is None else self._verified_hidden[i][columns]
                self.drafter.on_commit(self.draft_cache, row, before, kept)
            row.emitted_last = len(tokens)
            emitted.append(tokens)
        return emitted

    # ---------------------------------------------------------------- around the step

    def _observe(self, proposals: list[Proposal], draft_s: float, verify_s: float) -> None:
        width = 1 + max(p.drafted for p in proposals)
        draft_rows = sum(1 for p in proposals if p.forwards)
        forwards = max(p.forwards for p in proposals)
        # a catch-up: a draft fed more than the row's last step emitted (+1: a model draft feeds its last token
        # again), i.e. context it skipped (plain steps, the prompt). A head, whose cache keeps only the target's
        # states, feeds the accepted tokens again at every step: 4 after 3 accepted is its normal step, which
        # `fed > 2` counted as a catch-up and left out of the draft's cost (all its dearer first forwards)
        catch_up = any(p.fed > row.emitted_last + 1 for p, row in zip(proposals, self.rows, strict=True) if p.forwards)
        self.engine.policy.observe_step(len(self.rows), width, verify_s, draft_rows, forwards, draft_s, catch_up)

    def _advance(
        self,
        row: Row,
        proposal: Proposal,
        verdict: Verdict,
        target_logits: torch.Tensor,
        emitted: list[int],
        draft_s: float,
        verify_s: float,
    ) -> Chunk:
        """Record the step for one row, check whether it is done, and say what it adds."""
        row.trace.record(proposal, verdict, target_logits, emitted)
        row.out += emitted
        row.finish, keep = self.engine.finish(row.request, row.out, len(row.ids))
        cut = len(row.out) - keep
        del row.out[keep:]
        drafted, reach = proposal.drafted, proposal.reach  # a tree: its size, and its depth
        emitted_now = len(emitted) - cut
        row.stats.add(
            StepStats(
                drafted, verdict.num_accepted, emitted_now, proposal.forwards, draft_s, verify_s, proposal.free, reach
            )
        )
        own = reach - proposal.forced  # the draft's estimates count its own tokens, not the grammar's
        kept = min(verdict.num_accepted, own)
        if proposal.free:
            row.free_alpha = self.engine.policy.observe_free(row.free_alpha, own, kept, row.key)
        else:
            self.engine.policy.observe_row(row.alpha, own, kept, row.key)  # into the key's figures, which it drafts by
        if row.finish is None:
            return Chunk(emitted)
        return Chunk(emitted[: len(emitted) - cut], row.finish, row.output(self.engine.decode))
