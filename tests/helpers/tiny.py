"""Tiny random Llama models built in code for the engine tests (STYLE.md §8). Nothing is downloaded.

    from tiny import tiny_target, tiny_draft

Every builder seeds torch before creating the weights, so the same arguments always give the same
model. The configs have no EOS token (a test that wants one passes `eos_token_id` to the Engine),
so a generation runs for its whole budget unless the test says otherwise.

`initializer_range` is 0.1 rather than Llama's 0.02: with 0.02 a 64-wide model's next-token logits
are almost flat, and the gap between the two best tokens becomes small enough for float32 rounding
(a different matmul shape in a k + 1 token verification) to swap them. At 0.1 the logits have a
standard deviation near 1, so greedy equality is a property of the engine, not of luck.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 112
TARGET_LAYERS = 4
MAX_POSITIONS = 256


def llama(
    seed: int,
    vocab: int = VOCAB,
    layers: int = TARGET_LAYERS,
    hidden: int = 64,
    init: float = 0.1,
    positions: int = MAX_POSITIONS,
) -> LlamaForCausalLM:
    """A random fp32 Llama: `hidden` wide, 4 query heads sharing 2 KV heads, 256 positions (or `positions`)."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.float32).eval()


def tiny_target(seed: int = 0, vocab: int = VOCAB, positions: int = MAX_POSITIONS) -> LlamaForCausalLM:
    """The target: 4 layers, so early-exit:1..3 are valid drafts; `positions` for long prompts (tools)."""
    return llama(seed, vocab, layers=TARGET_LAYERS, positions=positions)


def tiny_draft(seed: int = 100, vocab: int = VOCAB, layers: int = 1) -> LlamaForCausalLM:
    """A separate 1-2 layer draft with the target's vocabulary (its own random weights)."""
    return llama(seed, vocab, layers=layers)


def mismatched_draft(seed: int = 200) -> LlamaForCausalLM:
    """A draft whose vocabulary is not the target's: the engine must refuse it."""
    return llama(seed, VOCAB + 16, layers=1)
