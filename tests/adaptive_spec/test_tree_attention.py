"""Tree feeds (`feeding.feed(..., trees=...)`, `kv.TreeFeed`, `BatchCache.keep`): one forward scores
every node of a draft tree, each node seeing the context and its own ancestors only.

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_tree_attention.py -q

What must hold: every node's logits equal those of its root-to-node path fed as a plain chain
(bitwise in bf16 with the invariant kernels, eager and compiled; to rounding in fp32); siblings and
padding never leak into each other; keeping one path moves its keys and values to the slots a chain
would have used, so the next step is as if only that path had been fed.
"""

from __future__ import annotations

import pytest
import torch
from tiny import llama

from adaptive_spec.cache import feeding, kv
from adaptive_spec.kernels import compiled, exact

pytestmark = pytest.mark.usefixtures("one_thread")

# The pending token (node 0) and a tree of 7 drafted nodes: two children of node 0 (1, 2), node 3
# under 1, nodes 4 and 5 under 2, node 6 under 5.
TREE = [70, 11, 12, 21, 31, 32, 41]
TREE_PARENTS = [-1, 0, 0, 1, 2, 2, 5]


def path_of(feed: list[int], parents: list[int], node: int) -> list[int]:
    """The tokens from the root to `node`, inclusive."""
    path = []
    while node >= 0:
        path.append(feed[node])
        node = parents[node]
    return path[::-1]


CONTEXTS = [[5, 17, 33, 8, 5, 17, 33], [44, 2, 9], list(range(20, 41))]


def fresh(model, contexts) -> kv.BatchCache:
    cache = kv.BatchCache.for_model(model)
    cache.row_capacity = len(contexts)
    for context in contexts:
        feeding.feed(model, cache, [cache.add_row()], [context])
    return cache


def chain_logits(model, context: list[int], path: list[int]) -> torch.Tensor:
    """The logits after the last token of `path`, fed as a chain after `context`."""
    cache = fresh(model, [context])
    return feeding.feed(model, cache, [0], [path], all_logits=True)[0, -1]


def test_the_tree_mask_and_positions_follow_the_worked_example() -> None:
    cache = kv.BatchCache(1)
    cache.add_row()
    cache.set_length(0, 5)
    positions, mask = cache.inputs([0], [4], 4, trees=[kv.TreeFeed.from_parents(5, [-1, 0, 0, 1])])
    assert positions.tolist() == [[5, 6, 6, 7]]
    sees = mask[0, 0].nonzero().tolist()
    visible = {q: [k for qq, k in sees if qq == q] for q in range(4)}
    assert visible[3] == [0, 1, 2, 3, 4, 5, 6, 8]  # c: the context, p (slot 5), a (6), itself (8); not b (7)
    assert visible[2] == [0, 1, 2, 3, 4, 5, 7]  # b: not its sibling a


def test_a_padding_column_sees_only_its_own_slot_and_real_tokens_their_context() -> None:
    """kv.BatchCache.inputs' example: 5 cached tokens fed 2 in a width of 4 get slots [7, 8, 5, 6]. The
    two padding columns see their own slot alone (a query over the context would cost as much as a real
    one and is thrown away); the real tokens see the context and themselves, the other row its own."""
    cache = kv.BatchCache(1)
    cache.add_row(), cache.add_row()
    cache.set_length(0, 5), cache.set_length(1, 3)
    positions, mask = cache.inputs([0, 1], [2, 4], 4)
    assert positions.tolist() == [[7, 8, 5, 6], [3, 4, 5, 6]]
    visible = [[row.nonzero().flatten().tolist() for row in mask[r, 0]] for r in range(2)]
    assert visible[0] == [[7], [8], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6]]
    assert visible[1] == [list(range(4)), list(range(5)), list(range(6)), list(range(7))]


@pytest.mark.parametrize("whole", [False, True])
def test_positions_and_masks_follow_their_definition_for_any_lengths_and_feeds(whole: bool) -> None:
    """kv.BatchCache.inputs, element by element from its docstring, over random batches: row r with
    `start` cached tokens fed `f` of `width` columns writes its real column c (c >= width - f) at slot
    start + c - (width - f), which sees slots 0..itself; a padding column c at start + f + c, which sees
    only itself. The mask spans the slots written (the whole capacity for a compiled step)."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        cache = kv.BatchCache(1)
        n = int(torch.randint(1, 6, (), generator=generator))
        for _ in range(n):
            cache.set_length(cache.add_row(), int(torch.randint(0, 300, (), generator=generator)))
        rows = list(range(n)) if whole else sorted(torch.randperm(n, generator=generator)[: max(1, n - 1)].tolist())
        fed = [int(torch.randint(1, 6, (), generator=generator)) for _ in rows]
        width = max(fed) + int(torch.randint(0, 2, (), generator=generator))
        positions, mask = cache.inputs(rows, fed, width, whole=whole)
        kv_len = max(cache.lengths[r] for r in rows) + width
        assert mask.shape == (len(rows), 1, width, cache._capacity if whole else kv_len)
        for i, (row, f) in enumerate(zip(rows, fed, strict=True)):
            start, pad = cache.lengths[row], width - f
            for c in range(width):
                slot = start + c - pad if c >= pad else start + f + c
                sees = list(range(slot + 1)) if c >= pad else [slot]
                assert int(positions[i, c]) == slot, (rows, fed, width, i, c)
                assert mask[i, 0, c].nonzero().flatten().tolist() == sees, (rows, fed, width, i, c)
        if whole:
            assert cache._token_rows.tolist() == [i for i in range(n) for _ in range(width)]
            assert torch.equal(cache._token_positions, positions.reshape(-1))


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_every_node_of_a_tree_scores_as_its_path_fed_as_a_chain(path: str, tmp_path, request) -> None:
    model = llama(0, init=0.02, layers=2).to(torch.bfloat16)
    if path == "compiled":
        request.getfixturevalue("kernels")
        compiled.install(model, tmp_path)
    assert exact.make_exact(model).exact
    # three rows verify the same tree after different contexts; the middle one is padded (a chain of 2)
    feeds = [TREE, TREE[:2], TREE]
    parents = [TREE_PARENTS, [-1, 0], TREE_PARENTS]
    cache = fresh(model, CONTEXTS)
    trees = [kv.TreeFeed.from_parents(cache.lengths[row], p) for row, p in enumerate(parents)]
    logits = feeding.feed(model, cache, [0, 1, 2], feeds, all_logits=True, trees=trees)  # [3, width, vocab]
    width = logits.shape[1]
    for row, (context, feed, row_parents) in enumerate(zip(CONTEXTS, feeds, parents, strict=True)):
        for node in range(len(feed)):
            expected = chain_logits(model, context, path_of(feed, row_parents, node))
            got = logits[row, width - len(feed) + node]
            assert torch.equal(got, expected), (path, row, node)


def test_keeping_a_path_leaves_the_cache_a_chain_would_have_left() -> None:
    model = llama(1, init=0.02, layers=2).to(torch.bfloat16)
    exact.install(model)
    context = CONTEXTS[0]
    cache = fresh(model, [context])
    start = cache.lengths[0]
    feeding.feed(model, cache, [0], [TREE], all_logits=True, trees=[kv.TreeFeed.from_parents(start, TREE_PARENTS)])
    kept = [0, 2, 5]  # a path: node 2's parent is 0, node 5's parent is 2
    assert path_of(TREE, TREE_PARENTS, 5) == [TREE[i] for i in kept]
    cache.keep(0, start, kept)
    cache.set_length(0, start + len(kept))
    after_tree = feeding.feed(model, cache, [0], [[60]], all_logits=True)[0, -1]
    chain = fresh(model, [context + [TREE[i] for i in kept]])
    assert torch.equal(after_tree, feeding.feed(model, chain, [0], [[60]], all_logits=True)[0, -1])


def test_a_bad_tree_is_refused() -> None:
    with pytest.raises(ValueError, match="parent"):
        kv.TreeFeed.from_parents(0, [-1, 2, 0])  # a parent after its child
    cache = kv.BatchCache(1)
    cache.add_row()
    with pytest.raises(ValueError, match="for 3 fed"):
        cache.inputs([0], [3], 3, trees=[kv.TreeFeed.from_parents(0, [-1, 0])])


def test_a_tree_grown_over_several_forwards_sees_its_earlier_ancestors() -> None:
    """A draft grows its tree a depth per forward: depth 2's nodes see the depth-1 node they follow,
    written by the forward before, and not its sibling."""
    model = llama(2, init=0.02, layers=2).to(torch.bfloat16)
    exact.install(model)
    context = CONTEXTS[1]
    cache = fresh(model, [context])
    start = cache.lengths[0]
    feeding.feed(model, cache, [0], [[11, 12]], all_logits=True, trees=[kv.TreeFeed(start, [start, start], [[], []])])
    # slots start (11) and start + 1 (12) are siblings at the same position; now 21 under 11, 22 under 12
    grown = kv.TreeFeed(start, [start + 1, start + 1], [[start], [start + 1]])
    logits = feeding.feed(model, cache, [0], [[21, 22]], all_logits=True, trees=[grown])[0]
    assert torch.equal(logits[0], chain_logits(model, context, [11, 21]))
    assert torch.equal(logits[1], chain_logits(model, context, [12, 22]))
