"""Early-exit self-speculation: the target's first N layers as the draft.

The draft is a model of the target's own class with `num_hidden_layers = N`. It shares the
embedding, the final norm, the rotary embedding and the LM head with the target (none of which a
LoRA adapter trains), and owns private copies of its N decoder layers, which is where adapters
go. So training or swapping an adapter never changes the target.

For the default SmolLM2-135M (30 layers, hidden 576), `early-exit:4` copies 4 layers, about
14 M parameters (56 MB in fp32); the shared 49152 x 576 embedding/head is not copied.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from adaptive_spec.drafters.spec import DraftSpecError


def decoder_layers(model, draft: str = "early-exit:N") -> nn.ModuleList:
    """The list of decoder layers of a transformers causal LM of the Llama family (Llama, Qwen, Mistral,
    Gemma 3, Phi-3, Mixtral...); DraftSpecError, naming `draft` and what works instead, for others."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise DraftSpecError(
            f"the {draft} draft needs a decoder whose layers are at `model.model.layers` (Llama, Qwen, "
            f"Mistral, Gemma 3, Phi-3, Mixtral, SmolLM...); {type(model).__name__} has none. For this "
            f"model use `ngram` (prompt lookup) or a separate draft model with its vocabulary."
        )
    return layers


def build_early_exit(target, num_layers: int):
    """Return a draft model made of the target's first `num_layers` layers, final norm and head."""
    layers = decoder_layers(target, f"early-exit:{num_layers}")
    if not 1 <= num_layers < len(layers):
        raise DraftSpecError(f"early-exit:N needs 1 <= N < {len(layers)} (the target's layer count), got {num_layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:num_layers]
    with torch.device("meta"):  # allocate nothing: every module is replaced below
        draft = type(target)(config)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.norm = target.model.norm
    draft.model.rotary_emb = target.model.rotary_emb
    draft.lm_head = target.lm_head
    draft.model.layers = nn.ModuleList(copy.deepcopy(layer) for layer in layers[:num_layers])
    draft.generation_config = copy.deepcopy(target.generation_config)
    leftover = [name for name, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if leftover:
        raise DraftSpecError(f"early exit of {type(target).__name__} left unset weights: {leftover[:5]}")
    return draft.eval().requires_grad_(False)
