"""Acceptance math: which drafted tokens the target keeps, and the token it adds.

Pure functions of tensors, no models. Vocabulary (STYLE.md §4):

- *accepted* tokens: the longest prefix of the draft that the target keeps;
- the *recovered* token: drawn at the first rejection, from what the target wanted there;
- the *bonus* token: drawn from the target after the last draft token, when all were accepted.

Every verification emits `num_accepted + 1` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adaptive_spec.sample.sampling import sample


@dataclass(frozen=True)
class Verdict:
    num_accepted: int  # how many draft tokens were kept, 0..k
    next_token: int  # the recovered token (num_accepted < k) or the bonus token (== k)


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """Keep the draft while it equals the target's argmax.

    draft_tokens:  [k]           tokens the draft proposed
    target_logits: [k + 1, vocab] the target's logits after the pending token and after each draft

    Example: the target's argmaxes are [5, 9, 2, 7] and the draft proposed [5, 9, 4]. The first
    two agree and the third does not, so num_accepted = 2 and the recovered token is 2. Had the
    draft proposed [5, 9, 2], all three are accepted and the bonus token is 7.
    """
    return greedy_accept_choices(draft_tokens.tolist(), target_choices(target_logits))


def target_choices(logits: torch.Tensor) -> list:
    """logits [..., vocab] -> the argmax of each row, as nested lists. In fp32: fp32 holds bf16 exactly and argmax
    keeps the first of equal values either way, so this is bf16's argmax at a fraction of its cost (0.37 against
    1.84 ms for 8 x 3 x 49152 logits; 0.85 ms of a 28 ms tree step for 9 x 49152 on an Intel Xeon)."""
    return logits.float().argmax(dim=-1).tolist()


def greedy_accept_choices(draft: list[int], choices: list[int]) -> Verdict:
    """`greedy_accept` given the target's argmaxes (`choices`, k + 1 ints): a batch takes every row's
    argmax in one operation (a few small operations per row cost about 0.2 ms each step)."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == choices[accepted]:
        accepted += 1
    return Verdict(accepted, choices[accepted])


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2).

    draft_tokens: [k]            drawn from draft_probs, row by row
    draft_probs:  [k, vocab]     the draft's distribution at each drafted position, or None for a
                                 deterministic draft (prompt lookup), which is a one-hot row
    target_probs: [k + 1, vocab] the target's processed distribution at the same positions, plus
                                 one more after the last draft token

    Draft token i is accepted with probability min(1, target_probs[i, t] / draft_probs[i, t]).
    At the first rejection the recovered token is drawn from max(0, target_probs - draft_probs),
    renormalised; if every token is accepted the bonus token is drawn from target_probs[k].
    Either way each emitted token follows target_probs exactly.

    Example: at one position the target gives token A 0.6 and B 0.4, the draft gives A 0.9 and
    B 0.1, and the draft drew A. A is kept with probability 0.6 / 0.9 = 2/3. Otherwise the
    residual max(0, [0.6 - 0.9, 0.4 - 0.1]) = [0, 0.3] recovers B. So A comes out with
    probability 0.9 * 2/3 = 0.6 and B with 0.1 + 0.9 * 1/3 = 0.4, as the target wants.
    """
    k = draft_tokens.shape[0]
    positions = torch.arange(k, device=draft_tokens.device)
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_tokens, target_probs.shape[-1]).to(target_probs.dtype)
    target_p = target_probs[positions, draft_tokens]  # [k]
    draft_p = draft_probs[positions, draft_tokens]  # [k]
    uniform = torch.rand(k, generator=generator, device=target_probs.device)  # [k]
    # u < target_p / draft_p, written without the division so that draft_p = 0 is safe.
    rejected = ~(uniform * draft_p < target_p)  # [k]
    num_accepted = int(rejected.nonzero()[0, 0]) if bool(rejected.any()) else k
    if num_accepted == k:
        return Verdict(k, int(sample(target_probs[k : k + 1], generator)[0]))
    residual = (target_probs[num_accepted] - draft_probs[num_accepted]).clamp_min(0.0)  # [vocab]
    total: torch.Tensor | float = residual.sum()
    if total <= 0:  # only reachable through rounding, when the two rows are equal
        residual, total = target_probs[num_accepted], 1.0
    return Verdict(num_accepted, int(sample((residual / total)[None], generator)[0]))


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # the accepted nodes, root to leaf: indices into the tree's draft tokens
    next_token: int  # the recovered token (at the first node none of whose children was kept) or the bonus


def children_of(parents: list[int]) -> dict[int, list[int]]:
    """Node -> its children in draft order; -1 is the root (the pending token)."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    return children


def tree_greedy_accept(draft_tokens: torch.Tensor, parents: list[int], target_logits: torch.Tensor) -> TreeVerdict:
    """Walk the tree down the target's argmax.

    draft_tokens:  [m]            the tree's tokens, node by node
    parents:       m ints         node j's parent node, -1 for a child of the pending token
    target_logits: [m + 1, vocab] the target's logits after the pending token, then after each node

    Example: nodes [5, 8, 9, 2] with parents [-1, -1, 0, 0] (5 and 8 after the pending token, 9
    and 2 after 5) and argmaxes [5, ., ., 2, .] at [pending, node 0, 1, 2, 3]: the target wants 5,
    node 0 has it; after 5 it wants 2 (row 1), node 3 has it; after node 3 it wants whatever row 4
    says, and no node follows node 3, so that is the bonus token. path = [0, 3]. A chain is the
    tree with parents [-1, 0, 1, ...], and then this is `greedy_accept`.
    """
    choice = target_choices(target_logits)  # [m + 1]
    tokens = draft_tokens.tolist()
    children = children_of(parents)
    path: list[int] = []
    node = -1
    while True:
        wanted = choice[node + 1]
        kept = next((child for child in children.get(node, []) if tokens[child] == wanted), None)
        if kept is None:
            return TreeVerdict(path, wanted)
        path.append(kept)
        node = kept


def tree_rejection_sample(
    draft_tokens: torch.Tensor, parents: list[int], target_probs: torch.Tensor, generator: torch.Generator | None
) -> TreeVerdict:
    """Recursive rejection sampling over a tree of deterministic candidates (SpecInfer; EAGLE).

    draft_tokens: [m]            the tree's tokens: at each node, its children are distinct tokens
                                 the draft chose (its top candidates), not samples
    parents:      m ints         as in `tree_greedy_accept`
    target_probs: [m + 1, vocab] the target's processed distribution after the pending token, then
                                 after each node

    At the current node with distribution p, the children are tried in draft order: child c is
    kept with probability r(c) / sum(r), where r is p with the children tried before it removed
    (the residual of a one-hot draft); if none is kept the next token is drawn from the last r.
    Then the walk continues below the kept child. Each emitted token follows p exactly: child 1
    comes out with p(c1), child 2 with (1 - p(c1)) * p(c2) / (1 - p(c1)) = p(c2), and a token
    outside the candidates with (1 - p(c1) - p(c2)) * p(x) / (1 - p(c1) - p(c2)) = p(x).

    Example: p = {A: 0.5, B: 0.3, C: 0.2}, children A then B. A is kept with probability 0.5;
    otherwise B with 0.3 / 0.5 = 0.6; otherwise C (the residual holds only C).
    """
    tokens = draft_tokens.tolist()
    children = children_of(parents)
    path: list[int] = []
    node = -1
    while True:
        residual = target_probs[node + 1].clone()
        kept = None
        for child in children.get(node, []):
            total = residual.sum()
            mass = residual[tokens[child]]
            if total <= 0:
                break
            if float(torch.rand((), generator=generator, device=residual.device)) * total < mass:
                kept = child
                break
            residual[tokens[child]] = 0.0
        if kept is None:
            if residual.sum() <= 0:  # only through rounding: every token of p was a candidate
                residual = target_probs[node + 1]
            return TreeVerdict(path, int(sample((residual / residual.sum())[None], generator)[0]))
        path.append(kept)
        node = kept
