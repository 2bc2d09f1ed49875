"""Tiny random models of the architecture matrix, built in code (transformers 5 classes, nothing downloaded).

    from tiny_families import FAMILIES, VOCAB, model_of
    target = model_of("gemma3")                       # 3 layers, cached: deep-copy it before changing it
    draft = model_of("gemma3", seed=5, layers=1)      # a separate draft model of the same family

Seven families: Llama, Qwen2, Qwen3, Mistral and Gemma 3 (both with sliding-window layers, over a window
of 12 positions, shorter than the test prompts), Phi-3, and a mixture of experts (Qwen3-MoE). The
engine's matrix (tests/adaptive_spec/test_architectures.py) and the trainer's
(tests/trainer/test_architecture_training.py) use them. `initializer_range` 0.1, as in tiny.py: logits
far enough apart that greedy equality is a property of the engine, not of float rounding.
"""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 112
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 12}),
    # layers 0-1 slide over 12 positions, layer 2 attends to everything
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            "head_dim": 16,
            "sliding_window": 12,
            "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        },
    ),
    "phi3": (Phi3Config, Phi3ForCausalLM, {}),
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
}

_models: dict[str, torch.nn.Module] = {}


def model_of(family: str, seed: int = 0, layers: int | None = None, **config_fields) -> torch.nn.Module:
    """The family's tiny model (seeded, in eval mode), built once per process and shared;
    `config_fields` override its config (tie_word_embeddings=False, say)."""
    key = f"{family}-{seed}-{layers}-{sorted(config_fields.items())}"
    if key not in _models:
        config_class, model_class, extra = FAMILIES[family]
        config = config_class(**{**COMMON, **extra, **config_fields})
        if layers is not None:
            config.num_hidden_layers = layers
            if getattr(config, "layer_types", None):
                config.layer_types = config.layer_types[:layers]
        torch.manual_seed(seed)
        _models[key] = model_class(config).eval()
    return _models[key]
