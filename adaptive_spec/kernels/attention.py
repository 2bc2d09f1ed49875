"""Attention for a padded batch cache, without copying keys and values per query head.

Models of the Llama family share each key/value head among several query heads (grouped-query
attention: the default model has 9 query heads and 3 KV heads). With an explicit attention mask,
transformers' SDPA path repeats every key and value head for each query head that uses it
(`repeat_kv`) before calling `scaled_dot_product_attention`: for 8 rows of 300 tokens that
copies ~440 MB per decoding step of the default model, more time than the step's matrix
products. This function folds the query heads of a group into the query length instead:

    query [n, kv_heads * groups, q, d] -> [n, kv_heads, groups * q, d]
    mask  [n, 1, q, kv_len]            -> [n, 1, groups * q, kv_len]

so each key/value head is read once. The arithmetic per (query, key) pair is the same; only
which products SDPA batches together changes. Without a mask (prefill through transformers' own
paths, the trainer, Hugging Face's generate) it hands over to the stock SDPA function.

`use(model)` switches a model to it, under the name `adaptive_spec_sdpa`, registered with
transformers' attention and mask interfaces (the masks are SDPA's).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "adaptive_spec_sdpa"


def grouped_sdpa_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [n, heads, q, d], key/value [n, kv_heads, kv_len, d], mask [n, 1, q, kv_len] (True =
    attend) -> ([n, q, heads, d], None), as transformers' attention functions return."""
    groups = getattr(module, "num_key_value_groups", 1)
    if attention_mask is None or groups == 1 or attention_mask.dtype != torch.bool:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    n, heads, q, d = query.shape
    kv_heads = key.shape[1]
    folded = query.reshape(n, kv_heads, groups * q, d)  # heads are kv-head-major: h = kv_head * groups + g
    mask = attention_mask[:, :, None].expand(n, 1, groups, q, attention_mask.shape[-1])
    mask = mask.reshape(n, 1, groups * q, attention_mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    out = out.reshape(n, heads, q, d).transpose(1, 2).contiguous()  # [n, q, heads, d]
    return out, None


AttentionInterface.register(NAME, grouped_sdpa_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def use(model) -> None:
    """Run `model`'s attention through `grouped_sdpa_forward` (a no-op for other attention kinds)."""
    stock = ("sdpa", NAME, "adaptive_spec_exact")  # an early exit copies the config of an invariant target
    if getattr(model.config, "_attn_implementation", None) in stock and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(NAME)  # a draft head shares its target's config, set there
