"""The n-gram index of a domain's recent outputs: what free drafts copy when a row's own context has
no match (drafters/free_first.py).

    index = build_ngram_index([(prompt, output), ...])     # the trainer, at each promotion
    AdapterDir(path).write_ngrams(index)                     # shipped in the version: draft_ngrams.json
    NgramDrafter(3).lookup_index(context, k, index)         # a server, for each row that drafts

`index` maps an n-gram (a tuple of 1 to `max_ngram` token ids) to the continuation that most often
followed it in the outputs, `NgramDrafter.lookup_index`'s format. The continuation is agreed token by
token: its first token is the one that followed the n-gram most often, its second the one that most
often came next after those two, and so on while at least `min_count` outputs agree, up to `span`
tokens. Example (words stand for token ids), min_count=2 and the outputs

    SELECT name FROM users WHERE ...
    SELECT name FROM orders ...
    SELECT name FROM users LIMIT ...

give ("SELECT",) -> [name, FROM, users]: three outputs agree on `name FROM`, two go on with `users`,
and no two agree after that. A continuation followed once is a guess and is not kept, nor is one
shorter than `min_length` (free_first.py copies 2 tokens at least, so a 1-token entry would only hide
a shorter n-gram's longer one).

The bound: at most `max_entries` n-grams (4,096 by default: 11 ids an entry at most, about 300 KB of
JSON), those whose first token was right most often; ties go to the n-gram seen in the most recent
output. The caller bounds the outputs, and with them the build: the trainer takes its lineage's
latest 32,768 output tokens (trainer/loop/online.py), at most 98,304 n-gram occurrences of 8 tokens.

The n-grams may begin in the prompt (its last tokens, then the output's first) but the continuations
are output tokens only: a prompt's own tokens are proposed by prompt lookup.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from adaptive_spec.drafters.spec import DEFAULT_NGRAM

SPAN = 8  # continuation tokens kept: dynamic k drafts at most 8 (dynamic_k.py k_max)
MIN_COUNT = 2  # outputs that must agree on each token of a continuation
MIN_LENGTH = 2  # free_first.py MIN_MATCH: a shorter continuation is never copied
MAX_ENTRIES = 4096


def build_ngram_index(
    outputs: Iterable[tuple[list[int], list[int]]],
    max_ngram: int = DEFAULT_NGRAM,
    span: int = SPAN,
    min_count: int = MIN_COUNT,
    min_length: int = MIN_LENGTH,
    max_entries: int = MAX_ENTRIES,
) -> dict[tuple[int, ...], list[int]]:
    """The index of `outputs`, (prompt, output) token-id pairs given newest first."""
    agreed = {}
    for ngram, continuations in followers(outputs, max_ngram, span).items():
        continuation, support = agreed_continuation(continuations, min_count, span)
        if len(continuation) >= min_length:
            agreed[ngram] = (support, continuation)
    ranked = sorted(agreed, key=lambda ngram: -agreed[ngram][0])  # stable: ties keep the newest first
    return {ngram: agreed[ngram][1] for ngram in ranked[:max_entries]}


def followers(
    outputs: Iterable[tuple[list[int], list[int]]], max_ngram: int, span: int
) -> dict[tuple[int, ...], list[tuple[int, ...]]]:
    """n-gram -> the up to `span` output tokens after each of its occurrences, in the order given.

    Example: prompt [7, 9], output [1, 2, 3], max_ngram=2, span=2 gives (9,) -> [(1, 2)],
    (7, 9) -> [(1, 2)], (1,) -> [(2, 3)], (9, 1) -> [(2, 3)], (2,) -> [(3,)], (1, 2) -> [(3,)].
    """
    found: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for prompt, output in outputs:
        tokens = list(prompt[max(0, len(prompt) - max_ngram) :]) + list(output)
        first = len(tokens) - len(output)
        for start in range(first, len(tokens)):  # start: where the continuation begins
            continuation = tuple(tokens[start : start + span])
            for n in range(1, min(max_ngram, start) + 1):
                found.setdefault(tuple(tokens[start - n : start]), []).append(continuation)
    return found


def agreed_continuation(continuations: list[tuple[int, ...]], min_count: int, span: int) -> tuple[list[int], int]:
    """(the continuation at least `min_count` of `continuations` agree on, token by token; how many
    agreed on its first token). Ties go to the earliest given (the newest output).

    Example: [(4, 5, 6), (4, 5, 9), (4, 8)] with min_count=2 gives ([4, 5], 3).
    """
    chosen: list[int] = []
    support = 0
    for depth in range(span):
        counts = Counter(c[depth] for c in continuations if len(c) > depth)
        if not counts:
            break
        token, count = counts.most_common(1)[0]
        if count < min_count:
            break
        chosen.append(token)
        support = support or count
        continuations = [c for c in continuations if len(c) > depth and c[depth] == token]
    return chosen, support
