"""Draft trees in the loop (`Engine(tree_budget=...)`, drafters/tree.py, the head's `_grow`, batch.py's
tree verify, accept and commit), on tiny random models.

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_trees.py -q

What must hold, row by row:

- greedy output equals the target alone, alone and batched with staggered rows, for a head and an
  ngram+head draft, fixed and dynamic depth, in fp32 and in bf16 (near-ties everywhere);
- the trees are trees: more nodes verified than a chain of the same depth, and accepted paths that
  are not always a node's first child (the second guesses pay);
- penalties apply per node and sampled rows follow the target's distribution;
- a row's tree grown in a batch is the tree it grows alone, whatever the width of its frontier;
- a tree's budget and depth come from the policy (DynamicK.tree_nodes).
"""

from __future__ import annotations

import copy

import pytest
import torch
from acceptance_support import ALPHA, chi_square_p_value
from tiny import llama, tiny_target

from adaptive_spec import Engine
from adaptive_spec.drafters.tree import RowTree
from adaptive_spec.formats.stats import Totals

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 33, 8, 5, 17, 33, 8, 5, 17], [44], [3, 9, 27, 81, 3, 9], list(range(20, 43)), [7, 7, 7, 7, 2]]
BUDGETS = [24, 9, 31, 16, 5]


def test_the_tree_builder_follows_its_docstring_example() -> None:
    tree = RowTree(budget=4, depth=2)
    tree.offer(-1, [(1, -0.1), (2, -2.0), (3, -3.0)])  # A, B, C
    assert tree.frontier(1) == [0, 1, 2]  # depth 1's best TOPK (all three here)
    tree.offer(0, [(11, -0.2), (12, -2.4)])  # AA -0.3, AB -2.5
    tree.offer(1, [(21, -0.2)])  # BA -2.2
    assert tree.frontier(2) == []  # depth 2 is the last
    tokens, parents = tree.final()
    assert tokens == [1, 2, 11, 21] and parents == [-1, -1, 0, 1]  # A, B, AA (under A), BA (under B)


def run(engine: Engine, k, max_batch: int = 3) -> list:
    batch, rows, outputs, waiting, step = engine.new_batch(max_batch), {}, {}, list(range(len(PROMPTS))), 0
    while waiting or len(batch):
        while waiting and not batch.full and step >= waiting[0]:
            i = waiting.pop(0)
            rows[batch.add(engine.request(PROMPTS[i], max_new_tokens=BUDGETS[i], k=k))] = i
        for row, chunk in batch.step():
            if chunk.output is not None:
                outputs[rows.pop(row)] = chunk.output
        step += 1
    return [outputs[i] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("draft", ["head", "ngram+head", "eagle3"])
def test_tree_drafts_are_lossless_alone_and_batched(dtype, draft: str) -> None:
    model = (tiny_target(0) if dtype == torch.float32 else llama(0, init=0.02)).to(dtype)
    alone = Engine(model, None)
    expected = [
        alone.generate(p, max_new_tokens=b, speculative=False).token_ids for p, b in zip(PROMPTS, BUDGETS, strict=True)
    ]
    engine = Engine(model, draft, tree_budget=12)
    assert engine.policy.tree_budget == 12
    verified = accepted = 0
    for k in (3, None):
        one = [engine.generate(p, max_new_tokens=b, k=k) for p, b in zip(PROMPTS, BUDGETS, strict=True)]
        assert [out.token_ids for out in one] == expected, f"{draft} k={k} alone"
        batched = run(engine, k)
        assert [out.token_ids for out in batched] == expected, f"{draft} k={k} batched"
        for out in one + batched:
            verified += out.stats.drafted
            accepted += out.stats.accepted
    assert verified > 0 and accepted > 0


def test_a_tree_verifies_more_than_a_chain_and_its_second_guesses_are_taken() -> None:
    """A head that is the target's own last layer fed the target's state agrees often but not always;
    with trees it is offered 4 candidates per depth, and some accepted tokens are not the first."""
    target = llama(seed=3, layers=2)
    chain, tree = Engine(target, "head"), Engine(target, "head", tree_budget=12)
    chain_out = [chain.generate(p, max_new_tokens=20, k=3) for p in PROMPTS]
    tree_out = [tree.generate(p, max_new_tokens=20, k=3) for p in PROMPTS]
    assert [o.token_ids for o in chain_out] == [o.token_ids for o in tree_out]
    chain_steps = sum(o.stats.target_forwards for o in chain_out)
    tree_steps = sum(o.stats.target_forwards for o in tree_out)
    chain_verified = sum(o.stats.drafted for o in chain_out) / chain_steps
    tree_verified = sum(o.stats.drafted for o in tree_out) / tree_steps
    assert tree_verified > chain_verified  # up to 12 nodes per step against 3
    assert tree_steps < chain_steps, (tree_steps, chain_steps)  # the second guesses saved target forwards
    # acceptance by depth counts depths, not nodes: at most 3 per step, one accepted token per depth reached
    totals = {name: Totals() for name in ("chain", "tree")}
    for name, outs in (("chain", chain_out), ("tree", tree_out)):
        for out in outs:
            totals[name].include(out.stats)
            assert len(out.stats.drafted_per_pos) <= 3 and sum(out.stats.accepted_per_pos) == out.stats.accepted
    assert sum(totals["tree"].drafted_per_pos) < totals["tree"].drafted  # 12-node trees, 3 depths each
    assert sum(totals["chain"].drafted_per_pos) == totals["chain"].drafted
    assert totals["tree"].acceptance_by_depth[0] > totals["chain"].acceptance_by_depth[0]  # 4 guesses at depth 1
    assert totals["tree"].tokens_verified_per_step == pytest.approx(tree_verified)


def test_penalties_apply_per_node_of_a_tree() -> None:
    model = tiny_target(1)
    options = dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={7: -5.0, 9: 3.0})
    plain = Engine(model, None)
    tree = Engine(model, "head", tree_budget=12)
    for prompt in PROMPTS:
        expected = plain.generate(prompt, max_new_tokens=20, speculative=False, **options).token_ids
        assert tree.generate(prompt, max_new_tokens=20, k=3, **options).token_ids == expected


def test_sampled_rows_with_trees_follow_the_target() -> None:
    """A draft that disagrees (the target's LM head x -3): the first emitted token follows the target."""
    small = llama(seed=7, vocab=8, layers=2)
    contrary = copy.deepcopy(small)
    with torch.no_grad():
        contrary.lm_head.weight.mul_(-3.0)
    engine = Engine(small, "head", tree_budget=8)
    engine.drafter.head.shared.lm_head = contrary.lm_head  # the head proposes from the contrary view
    engine.drafter.vocab.lm_head = contrary.lm_head
    prompt = [3, 1]
    with torch.inference_mode():
        expected = small(input_ids=torch.tensor([prompt])).logits[0, -1].softmax(-1)
    counts = torch.zeros(8)
    drafted = 0
    for trial in range(3000):
        out = engine.generate(prompt, max_new_tokens=3, temperature=1.0, seed=trial, k=2)
        counts[out.token_ids[0]] += 1
        drafted += out.stats.drafted
    assert drafted > 0
    assert chi_square_p_value(counts, expected) > ALPHA


def test_a_trees_catch_up_on_the_context_stays_out_of_the_drafts_step_cost() -> None:
    """A request's first draft forward feeds its whole prompt (and, after plain steps, what the draft
    skipped); the engine keeps such steps out of the draft's measured cost (`catch_up`), for trees as
    for chains. Counted in, one catch-up on a 500-token tool-call prompt made a head forward look
    dearer than a target step (24 ms against 21), and the policy stopped drafting trees for good."""
    target = llama(seed=3, layers=2)
    prompt = list(range(3, 60))
    flags: dict[str, list[bool]] = {}
    for name, budget in (("chain", None), ("tree", 12)):
        engine = Engine(target, "head", tree_budget=budget)
        seen: list[bool] = []
        observe = engine.policy.observe_step

        def spy(*args, seen=seen, observe=observe):
            seen.append(args[6])  # rows, width, verify_s, draft_rows, forwards, draft_s, catch_up
            return observe(*args)

        engine.policy.observe_step = spy
        engine.generate(prompt, max_new_tokens=12, k=2)
        flags[name] = seen
        assert engine.policy.draft.seconds, name  # the later steps measure the draft's cost
    assert flags["chain"][0] and flags["tree"][0]  # the prompt's catch-up
    assert not all(flags["tree"]) and not all(flags["chain"])


def test_rows_whose_frontiers_differ_in_width_grow_the_trees_they_grow_alone() -> None:
    """The head grows every row's tree in one forward per depth (`_grow`), right-aligning each row's frontier
    in a width that is the widest row's. Rows of budgets 1, 2, 12 and 5 and depths 4, 3, 2 and 5 expand 1, 2,
    up to 4 and up to 4 nodes a depth and stop at different depths: each row's tree (tokens and parents) is the
    one it grows alone, at every step of a greedy batch. The draft's LM head x 8 makes it confident, so that
    small budgets keep deep nodes (a row that read another column would keep other ones). A draft need not be
    batch-invariant (exact.py, `draft_products`): this asks the same choices, not the same bits, of a tiny fp32 head whose
    candidates' scores are far apart; a near-tie that flipped would show here as a failure to look at."""
    target = llama(seed=3, layers=2)
    engine = Engine(target, "head", tree_budget=12)
    engine.drafter.vocab.weight = engine.drafter.vocab.weight.detach() * 8.0
    budgets, depths = [1, 2, 12, 5], [4, 3, 2, 5]
    batch = engine.new_batch(4)
    for prompt in PROMPTS[:4]:
        batch.add(engine.request(prompt, max_new_tokens=16, k=3))
    cache, compared, widths, deep = batch.draft_cache, 0, set(), 0
    while len(batch) == 4:
        before = list(cache.lengths)
        together = engine.drafter.propose(cache, batch.rows, budgets, None, depths)
        for i in range(4):
            cache.lengths = list(before)
            ks = [budgets[i] if j == i else 0 for j in range(4)]
            alone = engine.drafter.propose(cache, batch.rows, ks, None, depths)[i]
            assert together[i].tokens.tolist() == alone.tokens.tolist(), (i, compared)
            assert together[i].parents == alone.parents, (i, compared)
            widths.add(len(alone.tokens))
            deep += budgets[i] == 2 and alone.parents == [-1, 0]
            compared += 1
        cache.lengths = list(before)
        batch.step()
    assert compared >= 16 and {1, 2} <= widths and max(widths) > 5, (compared, widths)
    assert deep > 0  # a budget of 2 kept a node and its child
