"""Draft trees: the draft's top few candidates at each depth, expanded where it is most confident, and
the best of them kept up to a node budget (EAGLE-2's dynamic tree, Li et al. 2024).

    tree = RowTree(budget=12, depth=4)
    tree.offer(-1, [(17, -0.1), (9, -2.3), (4, -3.0)], state)    # the pending token's children
    for node in tree.frontier(1): ...feed node.token, then tree.offer(index, its children, its state)...
    tokens, parents = tree.final()                                 # parents before children

A chain drafts one token per depth, so when the draft's first guess is wrong the whole step yields
one token. A tree offers the draft's second and third guesses too, and the target verifies every
node in one forward (kv.TreeFeed); when verifying 17 tokens costs 1.36 plain steps (bf16, default
model, this CPU) those guesses are nearly free.

Each node's score is the draft's log-probability of the path to it, so a child never scores above
its parent. At each depth the `TOPK` best nodes of that depth are expanded (their `TOPK` best
children offered); at the end the `budget` best nodes overall are kept, which closes the tree under
ancestors. Example: budget 4, depth 2. The pending token's children score A -0.1, B -2.0, C -3.0;
A and B are expanded; A's children AA -0.3, AB -2.5; B's BA -2.2. The best 4: A, AA, B, BA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TOPK = 4  # children offered per expanded node, and nodes expanded per depth


@dataclass
class Node:
    token: int
    parent: int  # index of the parent node in its tree, -1 for a child of the pending token
    score: float  # the draft's log-probability of the path from the pending token to this node
    depth: int  # 1 for a child of the pending token
    state: Any = None  # what the draft feeds beside this node's token to expand it (the head: a state)
    slot: int | None = None  # where the draft's cache holds this node once it was fed

    @property
    def fed_slot(self) -> int:
        """`slot`, for a node the draft has fed (an ancestor of what it expands now)."""
        assert self.slot is not None, "a tree node is attended to before it was fed"
        return self.slot


class RowTree:
    """One row's tree under construction, up to `budget` nodes and `depth` levels."""

    def __init__(self, budget: int, depth: int):
        self.budget = budget
        self.depth = depth
        self.nodes: list[Node] = []

    def offer(self, parent: int, candidates: list[tuple[int, float]], state: Any = None) -> None:
        """Children of node `parent` (-1: the pending token): (token, the draft's log-probability)."""
        base = self.nodes[parent] if parent >= 0 else None
        depth = 1 if base is None else base.depth + 1
        if depth > self.depth:
            return
        for token, logprob in candidates[:TOPK]:
            score = logprob + (0.0 if base is None else base.score)
            self.nodes.append(Node(token, parent, score, depth, state))

    def frontier(self, depth: int) -> list[int]:
        """The nodes of `depth` to expand: the best TOPK, when deeper nodes are allowed."""
        if depth >= self.depth:
            return []
        level = [i for i, node in enumerate(self.nodes) if node.depth == depth]
        return sorted(sorted(level, key=lambda i: -self.nodes[i].score)[: min(TOPK, self.budget)])

    def ancestors(self, index: int) -> list[int]:
        """The nodes above `index`, nearest first."""
        chain, parent = [], self.nodes[index].parent
        while parent >= 0:
            chain.append(parent)
            parent = self.nodes[parent].parent
        return chain

    def path(self, index: int) -> list[int]:
        """The tokens from the pending token's child down to node `index` (-1: none)."""
        if index < 0:
            return []
        return [self.nodes[i].token for i in [*reversed(self.ancestors(index)), index]]

    def final(self) -> tuple[list[int], list[int]]:
        """The kept tree: (tokens, parents), at most `budget` nodes, each parent before its children."""
        best = sorted(range(len(self.nodes)), key=lambda i: (-self.nodes[i].score, self.nodes[i].depth))
        kept: set[int] = set()
        for index in best:
            needed = {index, *self.ancestors(index)} - kept
            if len(kept) + len(needed) > self.budget:
                continue
            kept |= needed
        order = sorted(kept, key=lambda i: (self.nodes[i].depth, i))
        position = {index: k for k, index in enumerate(order)}
        tokens = [self.nodes[i].token for i in order]
        parents = [position[self.nodes[i].parent] if self.nodes[i].parent >= 0 else -1 for i in order]
        return tokens, parents
