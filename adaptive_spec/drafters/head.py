"""Proposing with a head draft (`DraftHead`, draft_head.py, EAGLE-style): `HeadDrafter` drafts for all
the rows that draft with the same head version in one head forward per draft token, as chains or as trees.

    drafter = HeadDrafter(target)                         # the base head; trained versions come as adapters
    proposals = drafter.propose(cache, rows, ks)          # a Proposal a row: up to ks[i] tokens, a forward each

The target's hidden states come from the target's own forwards: the batch captures them while
prefilling and verifying (`feeding.feed(..., hidden=True)`) and hands them to the drafter, which keeps
them per row (`Features`).
After every verify the head's cache keeps only what it computed from exact states: positions up
to the pending token. The accepted drafts are fed again next step with the target's states in
place of the head's own, so every round starts from exact features (`HeadDrafter.on_commit`).

Cost of a draft step: the head's layer and fuse plus the LM head restricted to the traffic's tokens
(vocab.py), against 30 layers and a 49152-row head for the target; the reduction runs once a step, on the
target's states only (`HeadDrafter._feed`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch
from torch import nn

from adaptive_spec.cache import kv
from adaptive_spec.drafters import Drafter, DraftRow, Proposal, by_adapter, no_proposal
from adaptive_spec.drafters.draft_head import DraftHead
from adaptive_spec.drafters.eagle3_head import Eagle3Head
from adaptive_spec.drafters.tree import TOPK, RowTree
from adaptive_spec.drafters.vocab import DraftVocab, draft_logits, greedy_picks
from adaptive_spec.kernels import compiled, exact

CATCH_UP_ALONE = 8  # a row with more unfed context than this catches up in a forward of its own
COMPILED_FEED_MAX = 64  # tokens (rows x width) a compiled head forward takes; a prompt's catch-up runs eager
# A head version's fuse and reduction as PEFT names them (modules_to_save), which build_weights reads
_FUSE_KEY = re.compile(r"^(?:base_model\.model\.)?fuse(?:\.modules_to_save\.[^.]+)?\.weight$")
_REDUCE_KEY = re.compile(r"^(?:base_model\.model\.)?reduce(?:\.modules_to_save\.[^.]+)?\.weight$")


def _head_step(head: DraftHead | Eagle3Head, ids, features, positions, mask, cache, vocab_rows, vocab_bias, columns):
    """A draft step: the head's predicted states at `columns` [n, c, hidden], the draft vocabulary's logits there
    [n, c, n_vocab], and their greedy picks [n, c] (vocab.greedy_picks). What HeadDrafter.compile compiles: the
    head version and the vocabulary's rows are arguments, so their weights are the graph's inputs; the norm,
    the LM head's rows and the argmax run in the graph, not as a dozen small eager operations after it."""
    states = head(ids, features, positions, mask, cache).index_select(1, columns)
    logits = draft_logits(head.final_norm(states), vocab_rows, vocab_bias)
    return states, logits, greedy_picks(logits)


class Features:
    """A row's target states by position, `[positions, layers * hidden]` (feeding.state_layers), grown by appending.

    A head draft reads the target's state at position t - 1 to draft token t + 1. The
    target computes them while prefilling and verifying; a row keeps every one of its context
    (3.5 KB per token for the default model in bf16, three layers of 576), so that a head whose cache was cleared (an
    adapter swap) can catch up without running the target again.
    """

    def __init__(self, first: torch.Tensor):
        self._data = first.clone()  # [capacity, layers * hidden]
        self.length = first.shape[0]

    def append(self, states: torch.Tensor) -> None:
        """states: [m, hidden], the positions right after the last one held."""
        needed = self.length + states.shape[0]
        if needed > self._data.shape[0]:
            grown = self._data.new_empty((max(needed, 2 * self._data.shape[0]), self._data.shape[1]))
            grown[: self.length] = self._data[: self.length]
            self._data = grown
        self._data[self.length : needed] = states
        self.length = needed

    def get(self, start: int, stop: int) -> torch.Tensor:
        """Positions [start, stop), `[stop - start, hidden]`; position -1 (before the first token) is zeros."""
        if start >= 0:
            return self._data[start:stop]
        zeros = self._data.new_zeros((-start, self._data.shape[1]))
        return torch.cat([zeros, self._data[:stop]])


class HeadDrafter(Drafter):
    """Drafts with a `DraftHead`: one forward per draft token for all the rows that draft with the
    same head version (the base head, or a trained version held in an adapter slot).

    A head version is a PEFT adapter directory on `DraftHead`: LoRA on its layer's linears
    (`layer.self_attn.q_proj`, ...) and the fuse saved whole (`modules_to_save=["fuse"]`), with
    the same metadata, checksum and draft vocabulary as an early-exit adapter.

    Each row's `draft_state` is its `Features`: the target's states from the row's prefill
    (`on_prefill`) and from every verified position it kept (`on_commit`).
    """

    wants_target_hidden = True
    takes_adapters = True
    builds_trees = True

    def __init__(self, target, name: str = "head"):
        self.head: DraftHead | Eagle3Head = self.base_head(target).eval().requires_grad_(False)
        exact.draft_products(self.head)  # its own linears (fuse, layer) may take the fast bf16 product
        self.name = name
        self.device = next(self.head.parameters()).device
        self.dtype = next(self.head.parameters()).dtype
        self.vocab = self.new_vocab()
        self._compiled: Callable | None = None  # _head_step through compiled.draft_forward, once compile() ran
        self._columns: dict[tuple[int, bool], torch.Tensor] = {}  # (width, every column) -> _head_step's columns

    def base_head(self, target) -> DraftHead | Eagle3Head:
        """The head before any trained version: it reads the target's states as feeding.feed gives them."""
        return DraftHead(target)

    def compile(self) -> None:
        """Run the draft steps' forwards compiled from now on, every head version through the same code, and
        compile now, not in the first request's step. Three graphs serve every feed, chains and trees alike
        (tests/adaptive_spec/test_compiled.py): several tokens of rows side by side, a single token, and rows
        that are not side by side (kv.BatchCache.update reads those through a tensor of rows, not a slice).
        Prompts' catch-ups of more than COMPILED_FEED_MAX tokens stay eager, where the compiled products, made
        for few rows, would be slower."""
        self._compiled = compiled.draft_forward(_head_step)
        cache = self.new_cache()
        first, _, third = (cache.add_row() for _ in range(3))
        zeros = torch.zeros(2, self.head.config.hidden_size, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            self._feed(self.head, self.vocab, cache, [first], [[0, 0]], [zeros])
            self._feed(self.head, self.vocab, cache, [first], [[0]], [zeros[:1]])
            self._feed(self.head, self.vocab, cache, [first, third], [[0], [0]], [zeros[:1], zeros[:1]])

    def new_cache(self) -> kv.BatchCache:
        cache = kv.BatchCache(1, self.device)
        if self.head.layer_type == "sliding_attention" or self.head.layer_type is None:
            cache.window = getattr(self.head.config, "sliding_window", None)  # as the layer it copies sees
        return cache

    def new_vocab(self, weights=None) -> DraftVocab:
        return DraftVocab(self.head.shared.lm_head)

    def models(self) -> list[nn.Module]:
        return [self.head]

    def on_prefill(self, row: DraftRow, hidden: torch.Tensor | None) -> None:
        if hidden is not None:  # positions 0 .. len(ids) - 2; a one-token prompt has none yet
            row.draft_state = Features(hidden)

    def on_copy_row(self, source: DraftRow, row: DraftRow) -> None:
        if source.draft_state is not None:
            row.draft_state = Features(source.draft_state.get(0, source.draft_state.length))

    def on_commit(self, cache, row: DraftRow, before: int, kept_hidden: torch.Tensor | None) -> None:
        """Keep the target's states of the pending token and the accepted drafts; the head's cache
        keeps only what it computed from exact states, up to the old pending token (position
        before - 1). The accepted drafts were fed with the head's own predictions and are fed again
        next step with the target's."""
        if kept_hidden is not None:
            if row.draft_state is None:
                row.draft_state = Features(kept_hidden)
            else:
                row.draft_state.append(kept_hidden)
        cache.set_length(row.slot, min(cache.lengths[row.slot], before))

    def build_weights(self, config: dict, tensors: dict[str, torch.Tensor]) -> DraftHead | Eagle3Head:
        """A head version, ready to decode with. Raises AdapterError if it does not fit this head."""
        from adaptive_spec.formats import adapters, lora

        assert isinstance(self.head, DraftHead)
        fuse = {key: t for key, t in tensors.items() if _FUSE_KEY.match(key)}
        pairs = lora.lora_pairs(
            config, {key: t for key, t in tensors.items() if key not in fuse and not _REDUCE_KEY.match(key)}
        )
        modules = dict(self.head.named_modules())
        for name, (lora_a, lora_b, _) in pairs.items():
            module = modules.get(name)
            if not name.startswith("layer.") or not isinstance(module, nn.Linear):
                raise adapters.AdapterError(f"{name}: a head version may only adapt the head's layer (layer.*)")
            if lora_a.shape[1] != module.in_features or lora_b.shape[0] != module.out_features:
                raise adapters.AdapterError(
                    f"{name}: adapter is {lora_b.shape[0]}x{lora_a.shape[1]}, the module is "
                    f"{module.out_features}x{module.in_features}"
                )
        weight = next(iter(fuse.values()), None)
        if weight is not None and tuple(weight.shape) != tuple(self.head.fuse.weight.shape):
            raise adapters.AdapterError(
                f"fuse: {tuple(weight.shape)} does not fit {tuple(self.head.fuse.weight.shape)}"
            )
        reduce = next((t for key, t in tensors.items() if _REDUCE_KEY.match(key)), None)
        if reduce is not None and (self.head.reduce is None or reduce.shape != self.head.reduce.weight.shape):
            wanted = None if self.head.reduce is None else tuple(self.head.reduce.weight.shape)
            raise adapters.AdapterError(
                f"reduce: {tuple(reduce.shape)} does not fit this head's {wanted} (the target's state layers "
                f"{self.head.feature_layers})"
            )
        return self.head.with_weights(weight, pairs, reduce)

    @torch.inference_mode()
    def propose(
        self,
        cache: kv.BatchCache,
        rows: Sequence[DraftRow],
        ks: list[int],
        free: list[list[int]] | None = None,
        depths: list[int] | None = None,
    ) -> list[Proposal]:
        ks = list(ks)  # a row whose constraints leave it nothing to propose stops early
        drafting = [i for i, k in enumerate(ks) if k > 0]
        feeds, fed, trees = {}, {}, {}
        drafted: dict[int, list[int]] = {i: [] for i in drafting}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in drafting}
        for adapter, group in by_adapter(rows, drafting):
            head = self.head if adapter is None else adapter.weights
            vocab = self.vocab if adapter is None else adapter.vocab
            for i in group:
                row, start = rows[i], cache.lengths[rows[i].slot]
                tokens = row.ids[start:]
                states = self._target_states(row, start)  # [len(tokens), hidden]
                fed[i] = len(tokens)
                if len(tokens) > CATCH_UP_ALONE:  # the prompt, the first time: alone, not padding the others
                    self._feed(head, vocab, cache, [row.slot], [tokens[:-1]], [states[:-1]])
                    tokens, states = tokens[-1:], states[-1:]
                feeds[i] = (tokens, states)
            if depths is not None:
                trees.update(self._grow(head, vocab, cache, rows, group, ks, depths, feeds, fed))
                continue
            while live := [i for i in group if len(drafted[i]) < ks[i]]:
                slots = [rows[i].slot for i in live]
                predicted, logits, picks = self._feed(
                    head, vocab, cache, slots, [feeds[i][0] for i in live], [feeds[i][1] for i in live]
                )
                predicted, logits = predicted[:, -1], logits[:, -1]  # [n, hidden], [n, n_vocab]
                choices = vocab.choose_rows(
                    logits, [rows[i] for i in live], [drafted[i] for i in live], picks[:, -1].tolist()
                )
                for j, (i, (token, row_probs)) in enumerate(zip(live, choices, strict=True)):
                    if token is None:  # its constraints allow none of its tokens, or its logits are NaN
                        ks[i] = len(drafted[i])
                        continue
                    drafted[i].append(token)
                    if row_probs is not None:
                        probs[i].append(row_probs)
                    feeds[i] = ([token], predicted[j : j + 1])
        if depths is not None:
            return [trees.get(i, no_proposal(self.device)) for i in range(len(rows))]
        return [
            Proposal(
                torch.tensor(drafted.get(i, []), dtype=torch.long, device=self.device),
                torch.stack(probs[i]) if probs.get(i) else None,  # [k, vocab]
                forwards=len(drafted.get(i, [])),
                fed=fed.get(i, 0),
            )
            for i in range(len(rows))
        ]

    def _grow(self, head, vocab, cache, rows, group, budgets, depths, feeds, fed) -> dict[int, Proposal]:
        """Each row's draft tree (tree.py): feed the rows' unseen context (the pending token last), offer
        its top candidates, then a forward per depth over the nodes each row expands, each node fed
        with its parent's predicted state and seeing only its ancestors (kv.TreeFeed). `fed[i]`: the context
        tokens row i caught up on, the prompt included, which the engine keeps out of the draft's step cost."""
        slots = [rows[i].slot for i in group]
        predicted, logits, _ = self._feed(
            head, vocab, cache, slots, [feeds[i][0] for i in group], [feeds[i][1] for i in group]
        )
        predicted, logits = predicted[:, -1], logits[:, -1]  # [n, hidden], [n, n_vocab]
        context = {i: cache.lengths[rows[i].slot] for i in group}  # the pending token is the last of it
        trees = {i: RowTree(budgets[i], depths[i]) for i in group}
        offers = vocab.candidates_rows(logits, [rows[i] for i in group], [[] for _ in group], TOPK)
        for j, i in enumerate(group):
            trees[i].offer(-1, offers[j], predicted[j])
        forwards = 1
        for depth in range(1, max(depths[i] for i in group)):
            expanding = {i: trees[i].frontier(depth) for i in group}
            live = [i for i in group if expanding[i]]
            if not live:
                break
            shapes = []
            for i in live:
                start, nodes = cache.lengths[rows[i].slot], expanding[i]
                for k, index in enumerate(nodes):
                    trees[i].nodes[index].slot = start + k
                sees = [[trees[i].nodes[a].fed_slot for a in trees[i].ancestors(index)] for index in nodes]
                shapes.append(kv.TreeFeed(context[i], [context[i] - 1 + depth] * len(nodes), sees))
            tokens = [[trees[i].nodes[index].token for index in expanding[i]] for i in live]
            states = [torch.stack([trees[i].nodes[index].state for index in expanding[i]]) for i in live]
            # [n, width, hidden], [n, width, n_vocab]
            predicted, logits, _ = self._feed(head, vocab, cache, [rows[i].slot for i in live], tokens, states, shapes)
            width = logits.shape[1]
            at = [
                (j, i, index, width - len(expanding[i]) + k)
                for j, i in enumerate(live)
                for k, index in enumerate(expanding[i])
            ]
            offers = vocab.candidates_rows(
                logits[[j for j, *_ in at], [column for *_, column in at]],  # [nodes, n_vocab]
                [rows[i] for _, i, _, _ in at],
                [trees[i].path(index) for _, i, index, _ in at],
                TOPK,
            )
            for (j, i, index, column), offer in zip(at, offers, strict=True):
                trees[i].offer(index, offer, predicted[j, column])
            forwards += 1
        proposals = {}
        for i in group:
            chosen, parents = trees[i].final()
            drafted = torch.tensor(chosen, dtype=torch.long, device=self.device)
            proposals[i] = Proposal(drafted, None, forwards=forwards, fed=fed[i], parents=parents)
        return proposals

    def _target_states(self, row: DraftRow, start: int) -> torch.Tensor:
        """The target's states at positions start - 1 .. len(ids) - 2: the inputs beside tokens
        start .. len(ids) - 1. A row whose prompt is one token has none yet (zeros before it)."""
        if row.draft_state is None:
            wide = self.head.state_width
            return torch.zeros(len(row.ids) - start, wide, dtype=self.dtype, device=self.device)
        return row.draft_state.get(start - 1, len(row.ids) - 1)

    def _feed(
        self,
        head: DraftHead | Eagle3Head,
        vocab: DraftVocab,
        cache: kv.BatchCache,
        slots: list[int],
        tokens: list[list[int]],
        states: list[torch.Tensor],
        trees: list[kv.TreeFeed] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run the head on each row's tokens with the states before them, right-aligned, and advance the rows'
        lengths. Returns `_head_step`'s predicted states, draft logits and greedy picks after each row's last
        token ([n, 1, ...]), or with `trees` (a depth of draft trees) after every fed token ([n, width, ...])."""
        fed = [len(t) for t in tokens]
        width = max(fed)
        ids = torch.tensor([[t[0]] * (width - len(t)) + list(t) for t in tokens], device=self.device)  # [n, width]
        if all(n == width for n in fed):
            features = torch.stack(states)  # [n, width, hidden]
        else:
            features = torch.zeros(len(tokens), width, states[0].shape[-1], dtype=states[0].dtype, device=self.device)
            for i, row_states in enumerate(states):
                features[i, width - len(row_states) :] = row_states
        features = head.reduced(features)  # here, not in the compiled step, so that it sees one width
        forward = self._compiled if len(tokens) * width <= COMPILED_FEED_MAX else None
        if forward is not None and cache.keys[0] is None:
            cache.allocate_for(head)  # not inside the graph (kv.BatchCache.allocate_for)
        positions, mask = cache.inputs(slots, fed, width, trees=trees)
        columns = self._columns_of(width, every=trees is not None)
        if forward is not None:  # a chain's positions are the cache's own tensor, a tree's are not: the copy keeps
            # the two from compiling graphs of their own (dynamo guards on inputs being one tensor)
            out = forward(head, ids, features, positions.clone(), mask, cache, vocab.rows, vocab.bias, columns)
        else:
            out = _head_step(head, ids, features, positions, mask, cache, vocab.rows, vocab.bias, columns)
        for slot, n in zip(slots, fed, strict=True):
            cache.set_length(slot, cache.lengths[slot] + n)
        return out

    def _columns_of(self, width: int, every: bool) -> torch.Tensor:
        """_head_step's columns: every one of `width`, or the last; a tensor made once per width. A tensor, not a
        number, so that one graph serves both (dynamo would specialise on a number)."""
        columns = self._columns.get((width, every))
        if columns is None:
            columns = (
                torch.arange(width, device=self.device) if every else torch.tensor([width - 1], device=self.device)
            )
            self._columns[(width, every)] = columns
        return columns
