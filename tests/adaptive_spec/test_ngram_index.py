"""The n-gram index of recent outputs (`adaptive_spec.drafters.ngram_index`): what it keeps, in the
format `NgramDrafter.lookup_index` reads, and its bound.

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_ngram_index.py -q   (under a second)

Loading it with an adapter and the free proposals it gives are in test_adapters.py and
test_free_first.py; the trainer writing it in test_online.py.
"""

from __future__ import annotations

from adaptive_spec.drafters.ngram import NgramDrafter
from adaptive_spec.drafters.ngram_index import agreed_continuation, build_ngram_index, followers

SELECT, NAME, FROM, USERS, ORDERS, WHERE, LIMIT, ASK = 10, 11, 12, 13, 14, 15, 16, 99


def test_the_docstring_example_keeps_what_two_outputs_agree_on() -> None:
    outputs = [  # newest first; each prompt ends with the same "question" token
        ([ASK], [SELECT, NAME, FROM, USERS, WHERE]),
        ([ASK], [SELECT, NAME, FROM, ORDERS]),
        ([ASK], [SELECT, NAME, FROM, USERS, LIMIT]),
    ]
    index = build_ngram_index(outputs)
    assert index[(SELECT,)] == [NAME, FROM, USERS]  # 3 agree on NAME FROM, 2 go on with USERS, then none
    assert index[(ASK,)] == [SELECT, NAME, FROM, USERS]  # n-grams may start in the prompt
    assert (SELECT, NAME, FROM) not in index  # 2 agree on USERS only: one token is shorter than a copy
    assert (ORDERS,) not in index and (USERS,) not in index  # followed by nothing, or by disagreeing tokens
    lookup = NgramDrafter(3)
    assert lookup.lookup_index([1, 2, ASK, SELECT], 2, index) == [NAME, FROM]  # the format lookup_index reads
    assert lookup.lookup_index([1, 2, 3], 4, index) == []


def test_followers_and_agreement_worked_examples() -> None:
    found = followers([([7, 9], [1, 2, 3])], max_ngram=2, span=2)
    assert found == {
        (9,): [(1, 2)],
        (7, 9): [(1, 2)],
        (1,): [(2, 3)],
        (9, 1): [(2, 3)],
        (2,): [(3,)],
        (1, 2): [(3,)],
    }  # continuations are output tokens only: nothing continues into the prompt
    assert agreed_continuation([(4, 5, 6), (4, 5, 9), (4, 8)], min_count=2, span=8) == ([4, 5], 3)
    assert agreed_continuation([(4, 5), (6, 5)], min_count=2, span=8) == ([], 0)
    assert agreed_continuation([(4, 5), (6, 5)], min_count=1, span=8) == ([4, 5], 1)  # a tie: the newest
    assert agreed_continuation([(1, 2, 3, 4)] * 2, min_count=2, span=3) == ([1, 2, 3], 2)


def test_entries_shorter_than_a_copy_are_dropped_and_the_bound_keeps_the_most_supported() -> None:
    often = [([0], [1, 2, 3])] * 5  # (1,) -> [2, 3] five times
    rarer = [([0], [4, 5, 6])] * 2  # (4,) -> [5, 6] twice
    newer = [([0], [7, 8, 9])] * 2  # (7,) -> [8, 9] twice, given first: newer
    index = build_ngram_index(newer + rarer + often, max_ngram=1, max_entries=3)
    assert list(index) == [(0,), (1,), (7,)]  # (0,) and (1,) were right 5 times; (7,) beats (4,) on recency
    assert index[(1,)] == [2, 3] and index[(7,)] == [8, 9]
    assert (2,) not in index  # -> [3] only: one token, shorter than a copy (MIN_LENGTH = 2)
    assert index[(0,)] == [1, 2, 3]  # 5 of 9 agree on 1, then all 5 go on
    assert build_ngram_index([]) == {}
    assert build_ngram_index([([0], [1, 2, 3])]) == {}  # seen once: a guess


def test_a_prompt_shorter_than_the_n_gram_gives_what_it_has() -> None:
    index = build_ngram_index([([5], [1, 2, 3]), ([], [1, 2, 3])])
    assert index == {(1,): [2, 3]}  # (5,) and (5, 1) were seen once; (2,) and (1, 2) give one token only
