"""The KV cache of a batch of rows, each with its own length: a padded cache.

Rows of a batch hold contexts of different lengths and accept different numbers of draft tokens
at each step, so each row is rolled back by its own amount. The cache keeps, per layer, one
buffer `[rows, kv_heads, capacity, head_dim]` for keys and one for values, and per row the
number of valid positions. Row r's context occupies positions `[0, lengths[r])` of its buffer
row; whatever lies past that is garbage that no query can see.

A forward over the batch feeds each row a few tokens, padded to one width. Real token i of row r
has position `lengths[r] + i`; its key and value are written there, and it attends to positions
`[0, lengths[r] + i]` (`BatchCache.inputs` builds the position ids and the 4D mask). After the forward the caller says how many of the fed tokens are now context
(`set_length`): rolling back is just a smaller length, so a rejected draft costs nothing.

Example: row 0 has 10 cached tokens and verifies [pending, d1, d2, d3]; row 1 has 6 and
verifies [pending] (padded to 4). Row 0 writes positions 10..13, row 1 writes 6..9, of which
7..9 are padding. Row 0 accepts d1 only: its context is the 10 + pending + d1, plus the
recovered token that is not yet cached, so `set_length(0, 12)`. Row 1: `set_length(1, 7)`.

`BatchCache` has the one method transformers' attention layers call, `update`; the forward that feeds rows
their tokens through it is feeding.py. Memory: a row
costs `2 * layers * kv_heads * head_dim * 4` bytes per token in fp32; for the default model
(30 layers, 3 KV heads of 64) that is 46 KB per token, 5.9 MB for a 128-token context, and the
`early-exit:4` draft adds 6 KB per token. Capacity grows (at least doubling, in
multiples of `GROW` tokens) as the longest row needs it, so a batch holds at most `rows x context
limit` positions.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

GROW = 256  # tokens of capacity added at a time


class BatchCache:
    """KV buffers for up to `max_rows` rows. Rows are 0..n-1; `remove_row` keeps them packed."""

    def __init__(self, num_layers: int, device: torch.device | str = "cpu"):
        self.num_layers = num_layers
        self.device = torch.device(device)
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # each [row_capacity, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths: list[int] = []  # [n] valid positions per row
        self.row_capacity = 1  # rows to allocate at once (a batch sets its maximum: no regrowth as rows join)
        self.max_positions: int | None = None  # the model's context: capacity never grows past it
        self._capacity = 0  # positions per row allocated
        self._active: slice | torch.Tensor = slice(0, 0)  # the rows the running forward covers
        self._positions: torch.Tensor | None = None  # [n_active, width] where the running forward writes
        self._kv_len = 0  # positions the running forward attends over
        self._whole = False  # the running forward covers rows 0..n-1 and attends over the whole capacity
        self._token_rows_made: dict[tuple[int, int], torch.Tensor] = {}  # (rows, width) -> _rows_by_token
        # Sliding-window attention (Mistral, Gemma 3...): a key is visible to a query at position p only
        # from position p - window + 1 on. Models with several layer types (layer_types) take one mask per
        # type ("full_attention", "sliding_attention"), as their own mask builders would make them.
        self.window: int | None = None
        self.layer_types: list[str] | None = None

    @classmethod
    def for_model(cls, model) -> BatchCache:
        config = model.config
        cache = cls(config.num_hidden_layers, next(model.parameters()).device)
        cache.max_positions = getattr(config, "max_position_embeddings", None)
        cache.window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        cache.layer_types = sorted(set(layer_types)) if layer_types else None
        return cache

    # ------------------------------------------------------------------ rows

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    def add_row(self) -> int:
        """A new empty row at the end; returns its index."""
        self.lengths.append(0)
        return len(self.lengths) - 1

    @torch.inference_mode()
    def remove_row(self, row: int) -> None:
        """Drop `row`; the last row moves into its place (the caller moves its own records alike)."""
        last = len(self.lengths) - 1
        if row != last:
            self.copy_row(last, row)
        self.lengths.pop()

    @torch.inference_mode()
    def copy_row(self, source: int, target: int) -> None:
        """Row `target` now holds a copy of row `source`'s positions (rows sharing a prompt)."""
        n = self.lengths[source]
        self._reserve(len(self.lengths), max(n, 1))
        for buffers in (self.keys, self.values):
            for layer in buffers:
                if layer is not None and n:
                    layer[target, :, :n] = layer[source, :, :n]
        self.lengths[target] = n

    @torch.inference_mode()
    def copy_from(self, source: BatchCache, source_row: int, row: int) -> None:
        """Row `row` now holds row `source_row` of another cache of the same model (a staged prefill)."""
        n = source.lengths[source_row]
        if n and any(layer is not None for layer in source.keys):
            keys = [None if layer is None else layer[source_row, :, :n] for layer in source.keys]
            values = [None if layer is None else layer[source_row, :, :n] for layer in source.values]
            self.write_row(row, keys, values)
            return
        self._reserve(len(self.lengths), max(n, 1))
        self.lengths[row] = n

    @torch.inference_mode()
    def write_row(self, row: int, keys: list[torch.Tensor | None], values: list[torch.Tensor | None]) -> None:
        """Row `row` now holds the given positions, per layer `[kv_heads, n, head_dim]` (a cached prefix,
        prefix_cache.py), or None for a layer the model never writes (it has no cache of its own)."""
        n = next(key.shape[1] for key in keys if key is not None)
        for layer, key in enumerate(keys):
            if self.keys[layer] is None and key is not None:
                self._allocate(layer, key[None])
        self._reserve(len(self.lengths), max(n, 1))
        for buffers, given in ((self.keys, keys), (self.values, values)):
            for buffer, tensor in zip(buffers, given, strict=True):
                if tensor is not None:
                    _present(buffer)[row, :, :n] = tensor
        self.lengths[row] = n

    def set_length(self, row: int, length: int) -> None:
        """Row `row` now holds `length` valid positions (at most what was written)."""
        self.lengths[row] = length

    def clear(self) -> None:
        """Forget every row's positions (their keys and values came from other weights)."""
        self.lengths = [0] * len(self.lengths)

    # ------------------------------------------------------------------ a forward

    def inputs(
        self,
        rows: list[int],
        fed: list[int],
        width: int,
        whole: bool = False,
        trees: list[TreeFeed] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | dict[str, torch.Tensor]]:
        """Position ids `[n, width]` and the attention mask `[n, 1, width, kv_len]` (True = attend; per
        layer type for a model with sliding-window layers: {"full_attention": ..., "sliding_attention": ...})
        for feeding `fed[i]` tokens to row `rows[i]`, right-aligned in `width` columns, and point
        `update` at those rows.

        Right-aligned, every row's last token is in the last column (`logits_to_keep=1` works for
        all rows). The padding columns in front get the slots just past the row's real tokens, so
        their keys land where no real query looks, and the row's real tokens are written at slots
        `lengths[r]`, `lengths[r] + 1`, ... Example: a row with 5 cached tokens fed 2 tokens in
        width 4 gets slots (and positions) [7, 8, 5, 6]. A padding column sees only its own slot: its
        output is thrown away, and a query over the whole context would cost as much as a real one
        (a compiled step pads a lone row's plain step to 2 tokens, a batched verify pads every row to
        the widest). No real query's result changes: each query's attention is its own.

        `trees` (draft trees, `TreeFeed` per row): each fed token is still written at its own slot,
        but its position and what it sees are the tree's: the row's context, its own ancestors and
        itself, not its siblings or cousins (`TreeFeed.from_parents` for a tree fed whole).
        Without `trees` every feed is a chain.

        `whole` (a compiled step, compiled.py): `rows` are 0..n-1 and the mask covers the whole
        capacity, so that the step's shapes change only when the capacity grows.
        """
        device = self.device
        starts = [self.lengths[r] for r in rows]
        # Row i's slots, built here in Python: one tensor made from a list cost less than the half-dozen small
        # operations that computed it (a draft step makes these several times a step). Its padding columns
        # come first and take the slots after its fed ones; every row's last slot is then start + width - 1.
        slots_list = [[*range(s + f, s + width), *range(s, s + f)] for s, f in zip(starts, fed, strict=True)]
        padded = any(f != width for f in fed)
        if padded:  # a padding column sees only its own slot: it attends from there (`lowest`) to there
            lowest = [[*range(s + f, s + width), *([0] * f)] for s, f in zip(starts, fed, strict=True)]
            slots, lowest_slots = torch.tensor([slots_list, lowest], device=device)  # [n, width] each
        else:
            slots = torch.tensor(slots_list, device=device)  # [n, width]
        kv_len = max(starts) + width
        self._reserve(len(self.lengths), kv_len)
        self._whole = whole
        if whole:
            kv_len = self._capacity
            self._token_rows = self._rows_by_token(len(rows), width)  # [n * width]
            self._token_positions = slots.reshape(-1)  # [n * width]
        self._active = slice(rows[0], rows[0] + len(rows)) if _contiguous(rows) else torch.tensor(rows, device=device)
        self._positions = slots
        self._kv_len = kv_len
        keys = torch.arange(kv_len, device=device)  # [kv_len]
        positions = slots
        mask = keys <= slots[:, :, None]  # [n, width, kv_len]
        if padded:
            mask &= keys >= lowest_slots[:, :, None]
        if trees is not None:
            positions, mask = _tree_inputs(trees, fed, width, slots, mask)
        mask = mask[:, None]  # [n, 1, width, kv_len]
        if self.window is None:
            return positions, mask
        sliding = mask & (keys[None, None, None, :] > positions[:, None, :, None] - self.window)
        if self.layer_types is None:  # every layer slides (Mistral)
            return positions, sliding
        return positions, {kind: sliding if kind == "sliding_attention" else mask for kind in self.layer_types}

    def _rows_by_token(self, rows: int, width: int) -> torch.Tensor:
        """[rows * width]: 0 repeated width times, then 1, ...; made once per shape (no forward writes to it)."""
        made = self._token_rows_made.get((rows, width))
        if made is None:
            made = torch.arange(rows, device=self.device).repeat_interleave(width)
            self._token_rows_made[(rows, width)] = made
        return made

    @torch.inference_mode()
    def keep(self, row: int, start: int, kept: list[int]) -> None:
        """After a tree was verified from slot `start` on: move the fed tokens at offsets `kept`
        (increasing; the path the target accepted) to slots start, start + 1, ..., in every layer.
        The row's length is the caller's to set. A chain's path [0, 1, 2] moves nothing."""
        moves = [(start + i, start + k) for i, k in enumerate(kept) if k != i]
        if not moves:
            return
        targets = torch.tensor([t for t, _ in moves], device=self.device)
        sources = torch.tensor([s for _, s in moves], device=self.device)
        for buffers in (self.keys, self.values):
            for layer in buffers:
                if layer is not None:
                    layer[row, :, targets] = layer[row, :, sources]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Called by each attention layer: write the fed tokens' keys and values, return every
        position the rows may attend to. key_states: [n, kv_heads, fed, head_dim]."""
        if self.keys[layer_idx] is None:
            self._allocate(layer_idx, key_states)
        if self._whole:  # written so that the compiler sees no Python number that changes between steps
            n, heads, _, dim = key_states.shape
            keys, values = _present(self.keys[layer_idx]), _present(self.values[layer_idx])
            # one (row, position) pair per fed token, flat: [n * fed]
            keys[self._token_rows, :, self._token_positions] = key_states.transpose(1, 2).reshape(-1, heads, dim)
            values[self._token_rows, :, self._token_positions] = value_states.transpose(1, 2).reshape(-1, heads, dim)
            return keys[:n], values[:n]
        kv_len = self._kv_len
        if isinstance(self._active, slice):
            rows = torch.arange(self._active.start, self._active.stop, device=self.device)
        else:
            rows = self._active
        # [n, fed, kv_heads, head_dim] written at (row, :, position, :), one flat (row, position) pair per fed
        # token: indices broadcast from [n, 1] and [n, fed] made a compiled draft's graph specialise on 1 row
        # and on 1 token (HeadDrafter.compile)
        n, heads, fed, dim = key_states.shape
        written_rows = rows.repeat_interleave(fed)
        if self._positions is None:
            raise RuntimeError("a cache's update before its inputs(): nothing says where the fed tokens go")
        written_positions = self._positions.reshape(-1)
        out = []
        for buffers, states in ((self.keys, key_states), (self.values, value_states)):
            buffer = _present(buffers[layer_idx])
            buffer[written_rows, :, written_positions] = (
                states.transpose(1, 2).reshape(n * fed, heads, dim).to(buffer.dtype)
            )
            out.append(buffer[self._active, :, :kv_len])
        return out[0], out[1]

    # transformers asks a cache these while building masks or positions; the engine always passes
    # both explicitly, so they are answered for completeness only.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths, default=0)

    # ------------------------------------------------------------------ memory

    def _allocate(self, layer_idx: int, like: torch.Tensor) -> None:
        _, heads, _, dim = like.shape
        rows = max(len(self.lengths), self.row_capacity)
        shape = (rows, heads, max(self._capacity, GROW), dim)
        self.keys[layer_idx] = _fixed_heads(torch.zeros(shape, dtype=like.dtype, device=self.device))
        self.values[layer_idx] = _fixed_heads(torch.zeros(shape, dtype=like.dtype, device=self.device))
        self._capacity = shape[2]

    def allocate_for(self, model) -> None:
        """Allocate every layer's buffers now, as the model's first forward would (a compiled step
        must not allocate inside the graph)."""
        config = model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        like = torch.empty((1, heads, 0, dim), dtype=next(model.parameters()).dtype)
        for layer in range(self.num_layers):
            if self.keys[layer] is None:
                self._allocate(layer, like)

    def _reserve(self, rows: int, positions: int) -> None:
        """Grow every allocated buffer to hold `rows` rows of `positions` positions."""
        capacity = self._capacity
        if positions > capacity:  # at least double, so a long generation reallocates a few times only
            capacity = -(-max(positions, 2 * capacity) // GROW) * GROW
            if self.max_positions is not None:
                capacity = max(positions, min(capacity, self.max_positions))
        for buffers in (self.keys, self.values):
            for i, layer in enumerate(buffers):
                if layer is None or (layer.shape[0] >= rows and layer.shape[2] >= capacity):
                    continue
                grown = _fixed_heads(
                    layer.new_zeros((max(rows, layer.shape[0]), layer.shape[1], capacity, layer.shape[3]))
                )
                grown[: layer.shape[0], :, : layer.shape[2]] = layer
                buffers[i] = grown
        self._capacity = capacity

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)


def _fixed_heads(buffer: torch.Tensor) -> torch.Tensor:
    """A cache buffer whose heads and head dimension a compiled step takes as constants (only its rows and
    capacity vary)."""
    torch._dynamo.mark_static(buffer, 1)
    torch._dynamo.mark_static(buffer, 3)
    return buffer


@dataclass
class TreeFeed:
    """Where one row's fed tokens sit in a draft tree (BatchCache.inputs).

    Example: 5 cached tokens fed [p, a, b, c] where a and b both follow p and c follows a:
    `TreeFeed.from_parents(5, [-1, 0, 0, 1])` gives positions [5, 6, 6, 7], and c sees slots 5
    (p) and 6 (a) besides the context 0-4 and itself (slot 8), not b (slot 7). A feed may also
    continue a tree fed in earlier forwards (a draft growing its tree depth by depth): its tokens
    then see slots written before, past the context.
    """

    context: int  # slots [0, context) are the row's context: every fed token sees them
    positions: list[int]  # each fed token's position
    sees: list[list[int]]  # each fed token's other visible slots past the context (its ancestors)

    @classmethod
    def from_parents(cls, start: int, parents: list[int]) -> TreeFeed:
        """A tree fed whole from slot `start` (the row's length): token j continues token
        parents[j] of the feed, or the context when -1."""
        positions: list[int] = []
        sees: list[list[int]] = []
        for j, parent in enumerate(parents):
            if not -1 <= parent < j:
                raise ValueError(f"token {j} has parent {parent}; a parent comes before its child")
            positions.append(start if parent < 0 else positions[parent] + 1)
            sees.append([] if parent < 0 else [*sees[parent], start + parent])
        return cls(start, positions, sees)


def _tree_inputs(trees: list[TreeFeed], fed: list[int], width: int, slots: torch.Tensor, causal: torch.Tensor):
    """Position ids and the [n, width, kv_len] mask of tree feeds; padding columns keep their
    slots and their view of their own slot alone, out of every real token's sight."""
    positions, mask = slots.clone(), causal.clone()
    seen_rows, seen_columns, seen_slots = [], [], []
    for i, (tree, count) in enumerate(zip(trees, fed, strict=True)):
        if len(tree.positions) != count or len(tree.sees) != count:
            raise ValueError(f"row {i}: a tree of {len(tree.positions)} tokens for {count} fed")
        pad = width - count
        positions[i, pad:] = torch.tensor(tree.positions, device=slots.device)
        mask[i, pad:] = False
        mask[i, pad:, : tree.context] = True
        for j, visible in enumerate(tree.sees):
            for slot in [*visible, int(slots[i, pad + j])]:
                seen_rows.append(i)
                seen_columns.append(pad + j)
                seen_slots.append(slot)
    mask[seen_rows, seen_columns, seen_slots] = True
    return positions, mask


def _contiguous(rows: list[int]) -> bool:
    return all(b == a + 1 for a, b in itertools.pairwise(rows))


def _present(buffer: torch.Tensor | None) -> torch.Tensor:
    """A layer's buffer once allocated (the first write to a layer allocates it)."""
    assert buffer is not None, "a layer's cache buffer is read before any write allocated it"
    return buffer
