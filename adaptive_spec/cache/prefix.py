"""Prefix caching: a prompt that starts as an earlier one reuses its keys and values instead of
computing them again (cf. vLLM's automatic prefix caching).

    cache = PrefixCache(max_bytes=512 << 20)
    hit = cache.lookup(ids)                        # the longest cached prefix, in whole blocks
    target_cache.write_row(slot, hit.keys, hit.values)
    ...prefill ids[hit.length:] after it, then:
    cache.insert(ids, target_cache, slot, states)  # the prompt's blocks, for the next request

Agents send the same system prompt and tool schemas with every request: on the shipped `tool_calls`
prompts a prompt shares about 300 of its ~500 tokens with an earlier one, and a prefill of the
default model costs about 0.6 ms a token on 2 cores, so those tokens are most of the time to the
first token.

Prompts are cut into blocks of `BLOCK` tokens. A block is keyed by its tokens and everything before
it (a SHA-256 of its tokens and the key of the block before it, as vLLM's hash chain), so a lookup walks the prompt's blocks
from the start until one is missing. A block holds, for its positions, the target's keys and values
in every layer and, when the draft reads them (a head draft), the target's hidden states, which the
draft's own prefill reads; the draft's cache depends on the adapter served, so it is not kept.
Blocks are evicted least recently used, leaves before the blocks they continue, within `max_bytes`.

Exactness: a cached position's keys and values are those a whole prefill of the new prompt would
compute only if a position's result does not depend on how many positions share its forward. The
batch-invariant forwards of exact.py give that, and `exact.check` measures it (a prefill split at a
few points against one fed whole, `InvarianceReport.prefix_reuse`); the engine turns the cache on
only where it holds. The last prompt token is never taken from the cache: its forward gives the
logits the first step needs.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass

import torch

BLOCK = 16  # tokens per cached block


@dataclass
class _Block:
    keys: list[torch.Tensor]  # per layer [kv_heads, BLOCK, head_dim]
    values: list[torch.Tensor]
    states: torch.Tensor | None  # [BLOCK, hidden], or None when not kept
    nbytes: int


@dataclass
class Hit:
    """The longest cached prefix of a prompt: `length` tokens, a multiple of BLOCK."""

    length: int
    keys: list[torch.Tensor]  # per layer [kv_heads, length, head_dim]
    values: list[torch.Tensor]
    states: torch.Tensor | None  # [length, hidden] when kept


class PrefixCache:
    """Blocks of prompts' keys and values, least recently used first out, within `max_bytes`.
    Thread-safe: every batch of an engine shares one."""

    def __init__(self, max_bytes: int, keep_states: bool = False):
        self.max_bytes = max_bytes
        self.keep_states = keep_states
        self.nbytes = 0
        self.hits = 0  # lookups that reused at least one block
        self.lookups = 0
        self.tokens_reused = 0
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # key -> block, least recently used first
        self._lock = threading.Lock()
        self._frozen = 0

    def __len__(self) -> int:
        return len(self._blocks)

    @staticmethod
    def _keys(ids: list[int], blocks: int) -> list[bytes]:
        """The chain keys of the first `blocks` blocks of `ids`: each a SHA-256 of its block's tokens and
        its parent's key, so equal keys mean equal prefixes (as vLLM's, collision-safe in practice)."""
        keys, parent = [], b""
        for b in range(blocks):
            parent = hashlib.sha256(parent + array("q", ids[b * BLOCK : (b + 1) * BLOCK]).tobytes()).digest()
            keys.append(parent)
        return keys

    def lookup(self, ids: list[int]) -> Hit | None:
        """The longest cached prefix of `ids` that leaves at least one token to compute, or None."""
        keys = self._keys(ids, (len(ids) - 1) // BLOCK)
        with self._lock:
            self.lookups += 1
            found: list[_Block] = []
            for key in keys:
                block = self._blocks.get(key)
                if block is None or (self.keep_states and block.states is None):
                    break
                found.append(block)
            if not found:
                return None
            for key in reversed(keys[: len(found)]):  # the chain's root ends most recent: leaves go first
                self._blocks.move_to_end(key)
            self.hits += 1
            self.tokens_reused += len(found) * BLOCK
        layers = range(len(found[0].keys))
        return Hit(
            len(found) * BLOCK,
            [torch.cat([block.keys[layer] for block in found], dim=1) for layer in layers],
            [torch.cat([block.values[layer] for block in found], dim=1) for layer in layers],
            torch.cat([block.states for block in found]) if self.keep_states else None,  # type: ignore[misc]
        )

    @torch.inference_mode()
    def insert(self, ids: list[int], cache, row: int, states: torch.Tensor | None) -> None:
        """Keep the whole blocks of `ids`, whose keys and values are positions [0, len(ids)) of row `row`
        of `cache` (a kv.BatchCache) and whose hidden states are `states` [len(ids), hidden]."""
        if self._frozen or self.max_bytes <= 0 or (self.keep_states and states is None) or None in cache.keys:
            return
        blocks = len(ids) // BLOCK
        keys = self._keys(ids, blocks)
        with self._lock:
            missing = [b for b, key in enumerate(keys) if key not in self._blocks]
        added = {}
        for b in missing:
            span = slice(b * BLOCK, (b + 1) * BLOCK)
            block_keys = [layer[row, :, span].clone() for layer in cache.keys]
            block_values = [layer[row, :, span].clone() for layer in cache.values]
            block_states = states[span].clone() if self.keep_states and states is not None else None
            size = sum(t.numel() * t.element_size() for t in (*block_keys, *block_values))
            if block_states is not None:
                size += block_states.numel() * block_states.element_size()
            added[keys[b]] = _Block(block_keys, block_values, block_states, size)
        with self._lock:
            for key in reversed(keys):  # present ones refreshed too, root last: the most recent
                if key in added and key not in self._blocks:
                    self._blocks[key] = added[key]
                    self.nbytes += added[key].nbytes
                if key in self._blocks:
                    self._blocks.move_to_end(key)
            while self.nbytes > self.max_bytes and self._blocks:
                _, block = self._blocks.popitem(last=False)
                self.nbytes -= block.nbytes

    @contextmanager
    def frozen(self):
        """Lookups only, no insertion, inside the block: a benchmark times two runs of one prompt from
        the same cache (the second would otherwise find the whole prompt the first left)."""
        with self._lock:
            self._frozen += 1
        try:
            yield self
        finally:
            with self._lock:
                self._frozen -= 1

    def stats(self) -> dict:
        """The counters at one moment (/health reads them from another thread than the engine's)."""
        with self._lock:
            return {
                "blocks": len(self._blocks),
                "bytes": self.nbytes,
                "max_bytes": self.max_bytes,
                "lookups": self.lookups,
                "hits": self.hits,
                "tokens_reused": self.tokens_reused,
            }
