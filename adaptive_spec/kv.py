"""KV-cache handling shared by the target and model drafts."""

from __future__ import annotations

import inspect

from transformers import DynamicCache

# transformers 5 crops by a negative count of tokens to drop; 4.x took the new absolute length.
_CROP_TAKES_COUNT = "tokens_to_remove" in inspect.signature(DynamicCache.crop).parameters


def new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def cache_len(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def rollback(cache: DynamicCache, keep: int) -> None:
    """Keep the first `keep` positions of the cache and drop the rest (no-op if it is shorter).

    Example: 10 tokens are cached and the pending token is the 11th. The target verifies
    [pending, d1, d2, d3], so its cache holds 14. d1 and d2 are accepted and d3 is not, so the
    context is now 11 + 2 tokens plus the recovered token, which is the next step's input and
    not yet cached: rollback(cache, 13) drops d3's entry only.
    """
    drop = cache_len(cache) - keep
    if drop > 0:
        cache.crop(-drop if _CROP_TAKES_COUNT else keep)
