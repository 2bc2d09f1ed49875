"""The adapters a server holds at once: the general one and one per domain, each ready to decode.

    slots = AdapterSlots(max_domains=4)
    slots.put(build_slot(drafter, "adapters/v0007", None, "sql", vocab_size, one_thread=False))  # version "7"
    slots.for_domain("sql")      # the sql adapter
    slots.for_domain("chat")     # no chat adapter: the general one, or None (the base draft)

A request tagged with a domain drafts with that domain's adapter when the server holds one, and
with the general adapter otherwise; rows of different domains share a batch (the drafter runs
one draft forward per adapter present in the step). A slot is what a drafter decodes with: the
merged weights (an early exit's layers, or a head), the LM-head view restricted to the adapter's
tokens, and the n-gram index of the domain's recent outputs that its version ships, which `ngram+`
drafts copy from (draft_ngrams.json, drafters/free_first.py). At most `max_domains` domain
adapters are held; putting one more evicts the one used least recently (the general adapter is
never evicted). Each slot of the default `early-exit:4` draft costs its 4 merged layers (56 MB in
fp32) plus its restricted head rows (about 3 MB for 1,300 tokens) and its index (4,096 n-grams at
most, a few MB).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from adaptive_spec.formats import adapters


@dataclass(eq=False)
class AdapterSlot:
    version: str
    domain: str | None  # None: the general adapter
    weights: Any  # what the drafter decodes with (drafter.build_weights)
    vocab: Any  # the drafter's DraftVocab for this adapter (restricted to its tokens, or not)
    gated_alpha: float | None  # the acceptance the trainer's gate measured, where dynamic k starts
    nbytes: int = 0
    ngrams: dict | None = None  # n-gram -> continuation, from the domain's recent outputs (draft_ngrams.json)
    last_used: float = field(default_factory=time.monotonic)


class AdapterSlots:
    def __init__(self, max_domains: int = 8):
        if max_domains < 0:
            raise ValueError(f"max_domains must be >= 0, got {max_domains}")
        self.max_domains = max_domains
        self.general: AdapterSlot | None = None
        self.domains: dict[str, AdapterSlot] = {}

    def put(self, slot: AdapterSlot) -> list[AdapterSlot]:
        """Hold `slot` for its domain (replacing the one held); returns the slots this evicted."""
        if slot.domain is None:
            self.general = slot
            return []
        self.domains[slot.domain] = slot
        evicted = []
        while len(self.domains) > self.max_domains:
            oldest = min(self.domains, key=lambda domain: self.domains[domain].last_used)
            evicted.append(self.domains.pop(oldest))
        return evicted

    def remove(self, domain: str | None) -> AdapterSlot | None:
        if domain is None:
            slot, self.general = self.general, None
            return slot
        return self.domains.pop(domain, None)

    def for_domain(self, domain: str | None) -> AdapterSlot | None:
        """The slot a request of this domain drafts with, marked as used now."""
        slot = self.domains.get(domain) if domain is not None else None
        slot = slot or self.general
        if slot is not None:
            slot.last_used = time.monotonic()
        return slot

    def versions(self) -> dict[str | None, str]:
        """domain (None: general) -> served version."""
        held: dict[str | None, str] = {domain: slot.version for domain, slot in self.domains.items()}
        if self.general is not None:
            held[None] = self.general.version
        return held


def build_slot(
    drafter, path, version: str | None, domain: str | None, vocab_size: int, *, one_thread: bool
) -> AdapterSlot:
    """A version directory made ready to decode with `drafter` (which takes adapters): read and checked
    (adapters.py), its weights built, the drafter's vocabulary restricted to its tokens, its n-gram index
    for ngram+ drafts (free_first.py), and the gate's greedy match from its metadata, where dynamic k
    starts. `version` None names it by its metadata ("7"), else by its directory ("v0007"). Raises
    `AdapterError` for a version that does not fit; nothing is served until `Engine` swaps the slot in.

    With `one_thread` (off the thread that built the engine: a watcher, a trainer) the build runs on one
    OpenMP thread: a thread that runs a parallel region keeps a team of workers while it lives, and once
    they outnumber the CPUs every region of every decoding step waits for a wake-up (service/worker.py;
    41 -> 70 ms per token on 2 cores after one build on another thread)."""
    with _one_torch_thread() if one_thread else nullcontext():
        config, tensors, metadata = adapters.read_adapter(path)
        weights = drafter.build_weights(config, tensors)
        vocab = drafter.new_vocab(weights)
        vocab.restrict(adapters.read_vocab(path, vocab_size))
        ngrams = adapters.read_ngrams(path, vocab_size)
    version = version or (str(metadata.version) if metadata.version is not None else Path(path).name)
    nbytes = sum(t.numel() * t.element_size() for t in weights.parameters())
    return AdapterSlot(version, domain, weights, vocab, metadata.gated_greedy_match, nbytes, ngrams)


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    """torch work on this thread with one OpenMP thread; the default is restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
