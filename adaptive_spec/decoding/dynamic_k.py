"""Choosing how many tokens to draft at each step of a batch.

Drafting k tokens that are each accepted with probability `alpha` (independently, the usual
model) yields, per row and target forward,

    tokens(alpha, k) = (1 - alpha ** (k + 1)) / (1 - alpha)       (accepted + recovered/bonus)

A step of a batch of n rows costs k draft forwards over the n rows plus one target forward over
n x (k + 1) tokens:

    time(k) = drafting_s(n, k) + target_s(n * (k + 1))

and the batch emits the sum of its rows' tokens. A step's k draft forwards cost a part paid once and
a part per forward (`DraftingCosts`: the first forward of a step is the dear one), or k times the mean
of one until both are measured. Plain decoding is k = 0: n tokens for
target_s(n). The policy picks the k in 0..k_max with the most tokens per second for the batch,
from each row's acceptance estimate (its key's, below). Costs are measured, not assumed: the engine reports the
wall time of every forward, and `StepCosts` keeps a moving average per number of tokens fed.

A target forward is memory-bound while it feeds few tokens and compute-bound past that, so the
cost of a token depends on how many share the forward. Worked example with the default model
on this CPU (fp32, 2 cores): a target forward over 1 / 2 / 4 / 8 / 16 tokens costs about
31 / 32 / 47 / 76 / 107 ms, and an `early-exit:4` draft forward with the restricted head 0.15
of a target forward over as many rows (4.6 ms for one row, 7.1 ms for four):

- 1 row, alpha = 0.7: k=0 gives 1 token / 31 ms = 32 tok/s; k=1 gives 1.7 / (4.6 + 32) ms =
  46 tok/s; k=2 gives 2.19 / (9.3 + 39.5) ms = 45 tok/s. So k = 1. At alpha = 0.9, k = 3:
  3.44 / (13.9 + 47) ms = 56 tok/s, 1.75x plain decoding.
- 4 rows at alpha = 0.7: k=0 gives 4 / 47 ms = 85 tok/s; k=1 gives 6.8 / (7.1 + 76) ms =
  82 tok/s; k=2 gives 8.76 / (14.1 + 91.5) ms = 83 tok/s. So k = 0: a verify of 4 rows x 2
  tokens is compute-bound, and drafting no longer pays. At alpha = 0.9 it still does: k = 3
  gives 13.8 / (21.2 + 107) ms = 107 tok/s, 1.26x, and k = 4 16.4 / (28.2 + 122.5) ms = 109 tok/s,
  a verify of 20 tokens being estimated on the line through 8 and 16 (StepCosts.estimate). So k = 4.
- alpha = 0.06 (an untrained early exit): k = 0 at every batch size. After `probe_every` plain
  steps the batch drafts one token per row to keep measuring alpha, so a draft that gets better
  is noticed. A probe is not free (a draft forward, the draft catching up on the context it
  skipped, a verify over twice the tokens: about 10% of a plain step's worth at 8 rows when spread
  over 16 steps), so each probe that still leaves drafting unpaid doubles the wait for the next
  one, up to `probe_every * max_probe_backoff` steps; the wait starts over when drafting pays or
  the draft changes (an adapter swap).

Acceptance is rarely the same at every draft position: a head that reads the target's true state
for its first token and its own prediction for the next ones (drafters/head.py) was accepted 0.75
of the time at the first and 0.01 at the second in one measurement. A single alpha would average
the two and draft too deep, so each key also keeps acceptance by position (`Acceptance.profile`),
and `choose` ranks k on the row's profile (`profile_for`): 1 + a0 + a0 a1 + ... tokens.

Free drafts (`ngram+head`, `ngram+early-exit:N`, drafters/free_first.py) are a second source with
its own acceptance and no draft cost: a row whose context (or its adapter's n-gram index) has a
match may propose those tokens for nothing but the verify's wider width. `choose_sources` weighs
both sources at once, row by row: for each k, the batch either runs the model draft (each row then
takes whichever of its two proposals promises more tokens, and the model's k forwards are paid for
the rows that use it) or does not (rows with a match propose it, the others decode plainly). Worked
example, the costs above, one row, a head draft at 0.05 of a target step and alpha 0.3, and a free
match of 4 tokens at alpha 0.8: the model alone would give k = 1, 1.3 / (1.55 + 32) ms = 39 tok/s;
copying 3 of the match's tokens gives 2.95 / 47 ms = 63 tok/s, so the row copies them (k = 3). At a
free alpha of 0.2 it drafts one token with the model instead. A free source whose matches stop being accepted gets
a low estimate of its own and stops being used, without dragging the model's estimate down.

Draft trees (`Engine(tree_budget=N)`, drafters/tree.py) use the same rule with k as the tree's depth:
a tree of depth k holds `tree_nodes(k)` = min(N, 4k) nodes, so a row feeds the target 1 + min(N, 4k)
tokens, and `expected_tokens` runs over the tree's acceptance by depth (the share of steps whose path
reached depth d that kept a token there, higher than a chain's at the same depth because each level
offers 4 candidates). Worked example with the compiled bf16 step of the default model on this CPU
(2026-11-26, `bench --compare-paths`: a target forward over 1 row of 1 / 5 / 9 / 17 tokens costs
22.6 / 24.0 / 26.7 / 31.3 ms, 8 rows of 1 / 5 tokens 31.8 / 45.5 ms), a head forward assumed at 3 ms
per depth, budget 16, and a trained head accepted [0.8, 0.6, 0.4] by depth:

- 1 row: k=0 gives 1 / 22.6 ms = 44 tok/s; k=1 (4 nodes) 1.8 / (3 + 24.0) ms = 67 tok/s; k=2
  (8 nodes) 2.28 / (6 + 26.7) ms = 70 tok/s; k=3 (12 nodes, about 29 ms) 2.47 / (9 + 29) ms = 65
  tok/s. So depth 2, 8 nodes: 1.6x plain decoding.
- 8 rows: k=0 gives 8 / 31.8 ms = 252 tok/s; k=1 gives 14.4 / (3 + 45.5) ms = 297 tok/s; k=2 needs
  8 x 9 tokens, over 60 ms, for 18.2 tokens: under 290 tok/s. So depth 1, and at a lower acceptance
  or a larger batch, no tree at all: the tree shrinks as the batch grows, down to plain decoding.

Acceptance belongs to the text and to the adapter: the policy keeps an estimate per key, a
(domain, adapter version) pair, so a chatty domain whose drafts do not pay does not drag down a
code domain whose drafts do. A row drafts by its key's profile; for a key not measured yet, by
what the trainer's gate measured for the adapter, else the engine-wide estimate. What a row
accepts goes into its key's figures, which its next steps and the key's next rows draft by. A
batch whose rows all come from a domain that does not pay decodes plainly, and is probed now and
then. The costs belong to the hardware and the model pair and persist across requests.
A draft that gets better is a new adapter version, so a new key, which starts from the figure
the trainer's gate measured for it.

Rows used to scale their key's profile by a running estimate of their own, which fell by 30% at a
single rejection. A row that met two or three rejections early then drafted one or two tokens,
or none, and a plain step brings no evidence to climb back with: with the head trained on python
(one user, 24 held-out prompts x 64 tokens, 2026-11-29), 17-19% of the steps that could draft did
not, and the key's profile alone ran 153.6 tok/s against 139.4 (three rounds in turns, ahead in each;
mean acceptance length 2.8-3.0 against 2.5-2.6). The price: a hard request in a key whose drafts pay
drafts as deep as the key's others (its rejections pull the key's window down for all of them), and an
easy one in a key that does not pay waits for the probes. A row estimate anchored on its key (a Beta
posterior with the key's figure worth 16 trials) kept some of that and measured 150.4 tok/s in the
same rounds; a candidate once mixed traffic is measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from adaptive_spec.decoding.estimates import Acceptance, DraftingCosts, StepCosts, ema, expected_tokens
from adaptive_spec.drafters.tree import TOPK


@dataclass
class DynamicK:
    k_max: int = 8
    probe_every: int = 16  # plain steps before the first one-token probe while drafting does not pay
    max_probe_backoff: int = 16  # the wait between probes doubles up to probe_every times this
    prior_draft_cost: float = 0.3  # a draft forward relative to a target forward over as many rows, until measured
    decay: float = 0.1  # weight of the newest observation in the moving averages

    target: StepCosts = field(default_factory=StepCosts)  # by tokens fed
    draft: StepCosts = field(default_factory=StepCosts)  # one draft forward, by rows fed (the mean of a step's)
    drafting: DraftingCosts = field(default_factory=DraftingCosts)  # a step's draft forwards, by rows fed
    prior_trials: float = 2.0  # how many drafted tokens a key's starting figure counts for
    window: int = 200  # drafted tokens a key's estimate remembers (older evidence fades)
    overall: Acceptance = field(default_factory=lambda: Acceptance(0.5))  # across requests and keys
    alphas: dict = field(default_factory=dict)  # (domain, adapter version) -> Acceptance
    free_overall: Acceptance = field(default_factory=lambda: Acceptance(0.5))  # free proposals, all keys
    free_alphas: dict = field(default_factory=dict)  # (domain, adapter version) -> Acceptance of free proposals
    # Draft trees (drafters/tree.py): k is then the tree's depth, and a row verifies up to tree_budget
    # nodes; its acceptance by position is the tree's by depth. None: chains.
    tree_budget: int | None = None
    _plain_steps: int = 0
    _probe_wait: int = 0  # plain steps before the next probe; 0: probe_every

    def alpha_for(self, key, prior: float | None = None) -> float:
        """Where a new row of this key starts: the key's estimate, else `prior` (the adapter's
        gated acceptance), else the engine-wide estimate."""
        if key in self.alphas:
            return self.alphas[key].estimate(self.prior_trials)
        return self.engine_alpha if prior is None else float(prior)

    def free_alpha_for(self, key) -> float:
        """Where a new row of this key starts for free proposals: the key's estimate, else the engine's."""
        known = self.free_alphas.get(key)
        return (known or self.free_overall).estimate(self.prior_trials)

    def profile_for(self, key, alpha: float) -> float | list[float]:
        """A row's acceptance by draft position, for `choose`: the profile its key measured (how
        acceptance falls from the first draft token to the later ones); the row's estimate `alpha`
        (where it started, `alpha_for`) while the key has no positions measured. Example: a key whose
        head is accepted 0.7 at the first token and 0.02 at the second, pooled 0.45, gives [0.7, 0.02],
        so k = 1; a single alpha of 0.45 would have asked for k = 2 or 3. The row's own running
        estimate does not scale the profile (the module's docstring says why)."""
        known = self.alphas.get(key)
        if known is None or not known.reached:
            return alpha
        return [min(0.999, value) for value in known.profile(self.prior_trials)]

    @property
    def engine_alpha(self) -> float:
        """The engine-wide estimate: where a row of an unseen key without a gated figure starts."""
        return self.overall.estimate(self.prior_trials)

    def tree_nodes(self, depth: int) -> int:
        """The node budget of a tree of `depth` levels: TOPK candidates per level, up to tree_budget.
        Example: budget 16, depth 3 -> 12 nodes, so a verify of 13 tokens per row."""
        return min(self.tree_budget, TOPK * depth) if self.tree_budget is not None and depth > 0 else depth

    def verify_width(self, k: int) -> int:
        """Tokens a row feeds the target when it drafts k: the pending token, then k drafts or a tree."""
        return 1 + self.tree_nodes(k)

    def target_s(self, tokens: int) -> float:
        measured = self.target.estimate(tokens)
        return measured if measured is not None else self.target.prior(tokens)

    def draft_s(self, rows: int) -> float:
        measured = self.draft.estimate(rows)
        return measured if measured is not None else self.prior_draft_cost * self.target_s(rows)

    def drafting_s(self, rows: int, k: int) -> float:
        """A step's k draft forwards over `rows` rows: first + per_forward * k once the steps have
        measured both (DraftingCosts), else k forwards at the mean of one (`draft_s`). Example, the
        head on this EPYC: 0.97 + 0.45 k ms, so k = 4 costs 2.77 ms, not the 3.5 of 4 x 0.88."""
        line = self.drafting.line(rows)
        if line is None:
            return k * self.draft_s(rows)
        first, per_forward = line
        return first + per_forward * k

    def choose(self, alphas: list[float | Sequence[float]], limits: list[int]) -> int:
        """The k for the next step of a batch whose rows have these acceptance estimates (each a
        number or a profile by draft position, `profile_for`) and may draft at most `limits[i]`
        tokens (0: the row decodes plainly this step)."""
        k_limit = min(max(limits, default=0), self.k_max)
        if k_limit <= 0:
            return 0
        n, drafting = len(alphas), sum(1 for lim in limits if lim > 0)
        best_k, best = 0, n / self.target_s(n)
        for k in range(1, k_limit + 1):
            tokens = sum(expected_tokens(a, min(k, lim)) for a, lim in zip(alphas, limits, strict=True))
            rate = tokens / (self.drafting_s(drafting, k) + self.target_s(n * self.verify_width(k)))
            if rate > best:
                best_k, best = k, rate
        if best_k > 0:
            self._model_drafted()
            return best_k
        return 1 if self._probe_due() else 0

    def plan(
        self,
        fixed: list[int | None],
        limits: list[int],
        profiles: list,
        free_alphas: list[float],
        free: list[list[int]] | None,
    ) -> tuple[list[int], list[list[int]] | None]:
        """The step's plan for a batch: per row, how many tokens to draft, and (when the draft has free
        proposals, `free` not None) the free proposal each row copies, [] for the model's.

        `fixed[i]` is a request's own k (None: dynamic), `limits[i]` the most it may draft now,
        `profiles[i]` and `free_alphas[i]` its acceptance estimates (profile_for, free_alpha_for).
        Rows of fixed k draft min(k, limit), copying their match whenever they have one; the dynamic
        rows share one k (`choose`), or choose row by row between their match and the model
        (`choose_sources`)."""
        dynamic = [i for i, want in enumerate(fixed) if want is None]
        if free is None:
            k = self.choose([profiles[i] for i in dynamic], [limits[i] for i in dynamic]) if dynamic else 0
            return [min(k if want is None else want, lim) for want, lim in zip(fixed, limits, strict=True)], None
        ks = [0 if want is None else min(want, lim) for want, lim in zip(fixed, limits, strict=True)]
        free = list(free)
        if dynamic:
            chosen, use_free = self.choose_sources(
                [profiles[i] for i in dynamic],
                [limits[i] for i in dynamic],
                [free_alphas[i] for i in dynamic],
                [len(free[i]) for i in dynamic],
            )
            for i, k, copies in zip(dynamic, chosen, use_free, strict=True):
                ks[i] = k
                if not copies:
                    free[i] = []
        return ks, free

    def _model_drafted(self) -> None:
        """The model draft pays this step: the wait for the next probe starts over."""
        self._plain_steps, self._probe_wait = 0, 0

    def _probe_due(self) -> bool:
        """One more step without the model draft: True when it is time to probe it with one token
        (after `probe_every` such steps, doubling each time, up to `probe_every * max_probe_backoff`)."""
        self._plain_steps += 1
        wait = self._probe_wait or self.probe_every
        if self._plain_steps < wait:
            return False
        self._plain_steps = 0
        self._probe_wait = min(2 * wait, self.probe_every * self.max_probe_backoff)
        return True

    def choose_sources(
        self,
        alphas: list[float | Sequence[float]],
        limits: list[int],
        free_alphas: list[float],
        free_lengths: list[int],
    ) -> tuple[list[int], list[bool]]:
        """Per row, how many tokens to draft next step and whether they are its free match (True) or
        the model's (False). `free_lengths[i]`: tokens of row i's free match (0: none), at most its
        limit. Plain decoding is ([0] * n, [False] * n).

        The model's cost is paid only by a plan in which some row drafts with it; a plan without the
        model counts as a plain step for probing, so an untrained model draft is still probed now
        and then (one model token for the rows without a match).
        """
        n = len(alphas)
        k_limit = min(max([*limits, *free_lengths], default=0), self.k_max)
        best, plan = n / self.target_s(n), (0, [False] * n, False)  # plain
        for k in range(1, k_limit + 1):
            verify = self.target_s(n * self.verify_width(k))
            free_gain = [
                expected_tokens(f, min(k, length)) if length else 1.0
                for f, length in zip(free_alphas, free_lengths, strict=True)
            ]
            model_gain = [expected_tokens(a, min(k, lim)) for a, lim in zip(alphas, limits, strict=True)]
            if any(free_lengths):  # without the model: rows with a match copy, the others decode plainly
                rate = sum(free_gain) / verify
                if rate > best:
                    best, plan = rate, (k, [length > 0 for length in free_lengths], False)
            use_free = [length > 0 and f >= m for length, f, m in zip(free_lengths, free_gain, model_gain, strict=True)]
            model_rows = sum(1 for lim, free in zip(limits, use_free, strict=True) if lim > 0 and not free)
            if model_rows:  # with the model, for the rows it serves better
                gain = sum(f if free else m for free, f, m in zip(use_free, free_gain, model_gain, strict=True))
                rate = gain / (self.drafting_s(model_rows, k) + verify)
                if rate > best:
                    best, plan = rate, (k, use_free, True)
        k, use_free, with_model = plan
        if with_model:
            self._model_drafted()
            model_k = k
        else:  # a probe: one model token for the rows without a match
            model_k = 1 if self._probe_due() else 0
        ks = [
            min(k, length) if free else min(model_k, lim)
            for free, length, lim in zip(use_free, free_lengths, limits, strict=True)
        ]
        return ks, use_free

    def observe_free(self, alpha: float, drafted: int, num_accepted: int, key=None) -> float:
        """A row of `key` proposed `drafted` free tokens and num_accepted were kept; as observe_row,
        for the free source's own estimates."""
        return self._observe(self.free_overall, self.free_alphas, alpha, drafted, num_accepted, key)

    def observe_step(
        self,
        rows: int,
        width: int,
        verify_s: float,
        draft_rows: int,
        draft_forwards: int,
        draft_s: float,
        catch_up: bool = False,
    ) -> None:
        """Fold in one step's timings: a target forward over rows x width tokens, and
        `draft_forwards` draft forwards that started over `draft_rows` rows.

        `catch_up` marks a step where a row first fed context the draft had not seen in a
        forward of its own (after plain steps). Its time is not a draft step's cost, so it is
        left out; counting it made a trained draft look 3x dearer than it is.
        """
        self.target.observe(rows * width, verify_s)
        if draft_forwards and not catch_up:
            self.draft.observe(draft_rows, draft_s / draft_forwards)
            self.drafting.observe(draft_rows, draft_forwards, draft_s)

    def observe_row(self, alpha: float, k: int, num_accepted: int, key=None) -> float:
        """A row of `key` drafted k and num_accepted were kept: the key's figures (and the engine's)
        take the step in. Returns a running estimate for the row alone (from alpha 0.05, two
        accepted one-token probes give 0.34, then 0.54), which the engine does not draft by: its rows
        draft by their key's profile (`profile_for`; the module's docstring says why).

        The step is evidence on num_accepted successes and, if one was rejected, a failure.
        The key's estimate, where its rows draft from, is the share accepted over the
        last `window` drafted tokens, with its starting figure counted as `prior_trials` tokens:
        a draft that misses is believed after a dozen tokens, not after a hundred (an untrained
        draft then stops drafting in the first request or two, not the first dozen).
        """
        return self._observe(self.overall, self.alphas, alpha, k, num_accepted, key)

    def _observe(self, overall: Acceptance, per_key: dict, alpha: float, k: int, num_accepted: int, key) -> float:
        if not k:
            return alpha
        trials = num_accepted + (num_accepted < k)
        observed = num_accepted / trials
        keep = (1.0 - 1.0 / self.window) ** trials
        overall.observe(num_accepted, trials, keep)
        per_key.setdefault(key, Acceptance(alpha)).observe(num_accepted, trials, keep, k)
        return ema(alpha, observed, min(0.5, 0.3 * trials))

    def new_draft(self, expected_alpha: float | None) -> None:
        """The general draft changed (an adapter swap): re-measure its cost, and start rows of keys
        not seen yet from what the trainer measured on held-out traffic for it (its greedy
        match), when known. A new adapter version is a new key (`alpha_for` takes its gated
        figure as the prior), so what was learnt of other keys stays."""
        self.draft = StepCosts(decay=self.decay)
        self.drafting = DraftingCosts(decay=self.drafting.decay)
        self._plain_steps, self._probe_wait = 0, 0
        if expected_alpha is not None:
            self.overall = Acceptance(float(expected_alpha))
