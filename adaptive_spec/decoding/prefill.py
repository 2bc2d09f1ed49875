"""Chunked prefill: a long prompt joins a busy batch one chunk per step, so that the rows already
decoding are not stalled behind it (cf. vLLM's chunked prefill).

    prefills = ChunkedPrefill(engine.target, wants_hidden=True)
    prefills.stage(row)                 # a 4,000-token prompt arrives while 7 rows decode
    ...each batch step: finished = prefills.advance(); the rows then decode as usual...

Prefilling 4,000 tokens of the default model takes seconds on 2 cores. Run at once, it holds every
decoding row for that long: their time per output token jumps from ~40 ms to seconds for one step.
Staged, the prompt is fed one chunk of `feeding.PREFILL_CHUNK` tokens per batch step into a cache of its
own, and its row joins the batch when the last chunk is in (its keys and values copied into a row of
the batch's cache). The others wait one chunk per step instead of the whole prompt.

Exactness: the chunks follow `feeding.prefill_chunks`, the same boundaries as a prompt fed at once, and
each is the same single-row forward, so the row's keys and values are bitwise what an unstaged
prefill gives, and its output stays the target's own. After a prefix-cache hit the chunks are cut
from the rest of the prompt, as an unstaged prefill after the same hit cuts them; that a split
prefill changes no bit is what exact.check measured before the cache was turned on.

Only a prompt longer than one chunk, arriving while other rows decode, is staged; rows are staged
one after another (first come, first fed).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from adaptive_spec.cache import feeding, kv


@dataclass(eq=False)
class _Staged:
    row: Any  # batch.Row
    chunks: list[slice]  # of row.ids[:-1], in order
    fed: int = 0  # chunks fed so far
    states: list[torch.Tensor] = field(default_factory=list)  # the target's states per chunk, when wanted
    seconds: float = 0.0
    hit: Any = None  # prefix_cache.Hit: the prompt's cached prefix, written into the cache before the chunks


class ChunkedPrefill:
    def __init__(self, target, wants_hidden: bool):
        self.target = target
        self.wants_hidden = wants_hidden
        self.cache = kv.BatchCache.for_model(target)
        self.cache.add_row()
        self._queue: deque[_Staged] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, row) -> bool:
        return any(staged.row is row for staged in self._queue)

    @staticmethod
    def worth_staging(prompt_tokens: int, decoding_rows: int) -> bool:
        """A prompt longer than one chunk, while others decode (alone, it may as well go at once)."""
        return decoding_rows > 0 and prompt_tokens - 1 > feeding.PREFILL_CHUNK

    def stage(self, row, hit=None) -> None:
        """Queue a row's prompt; with `hit` (a cached prefix, prefix_cache.py) only the rest is fed."""
        start = 0 if hit is None else hit.length
        chunks = [slice(start + c.start, start + c.stop) for c in feeding.prefill_chunks(len(row.ids) - 1 - start)]
        self._queue.append(_Staged(row, chunks, hit=hit))

    def remove(self, row) -> bool:
        """Drop a staged row (cancelled); True if it was staged."""
        for staged in self._queue:
            if staged.row is row:
                if staged is self._queue[0]:
                    self.cache.set_length(0, 0)
                self._queue.remove(staged)
                return True
        return False

    def advance(self, clock) -> tuple[Any, torch.Tensor | None, float] | None:
        """Feed the next chunk of the first staged prompt. When that was its last chunk, return
        (row, the target's states at its prompt positions or None, seconds spent); the caller moves
        the row into the batch (`copy_into`)."""
        if not self._queue:
            return None
        staged = self._queue[0]
        started = clock()
        if staged.fed == 0 and staged.hit is not None:
            self.cache.write_row(0, staged.hit.keys, staged.hit.values)
            if self.wants_hidden:
                staged.states.append(staged.hit.states)
        tokens = staged.row.ids[:-1][staged.chunks[staged.fed]]
        out = feeding.feed(self.target, self.cache, [0], [tokens], decoder_only=True, hidden=self.wants_hidden)
        if self.wants_hidden:
            staged.states.append(out[1][0])
        staged.fed += 1
        staged.seconds += clock() - started
        if staged.fed < len(staged.chunks):
            return None
        self._queue.popleft()
        return staged.row, torch.cat(staged.states) if staged.states else None, staged.seconds

    def copy_into(self, cache: kv.BatchCache, slot: int) -> None:
        """The finished prompt's keys and values into row `slot` of the batch's cache."""
        cache.copy_from(self.cache, 0, slot)
        self.cache.set_length(0, 0)
