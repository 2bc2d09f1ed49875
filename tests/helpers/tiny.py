"""Tiny random Llama models built in code for the engine tests (STYLE.md §8). Nothing is downloaded.

    from tiny import tiny_target, tiny_draft

Every builder seeds torch before creating the weights, so the same arguments always give the same
model; `llama` and why its initializer range is 0.1 are in benchmarks/tiny_model.py (which
`adaptive-spec bench-chaos` runs on too).
"""

from __future__ import annotations

from transformers import LlamaForCausalLM

from benchmarks.tiny_model import MAX_POSITIONS, TARGET_LAYERS, VOCAB, llama

__all__ = ["MAX_POSITIONS", "TARGET_LAYERS", "VOCAB", "llama", "mismatched_draft", "tiny_draft", "tiny_target"]


def tiny_target(seed: int = 0, vocab: int = VOCAB, positions: int = MAX_POSITIONS) -> LlamaForCausalLM:
    """The target: 4 layers, so early-exit:1..3 are valid drafts; `positions` for long prompts (tools)."""
    return llama(seed, vocab, layers=TARGET_LAYERS, positions=positions)


def tiny_draft(seed: int = 100, vocab: int = VOCAB, layers: int = 1) -> LlamaForCausalLM:
    """A separate 1-2 layer draft with the target's vocabulary (its own random weights)."""
    return llama(seed, vocab, layers=layers)


def mismatched_draft(seed: int = 200) -> LlamaForCausalLM:
    """A draft whose vocabulary is not the target's: the engine must refuse it."""
    return llama(seed, VOCAB + 16, layers=1)
