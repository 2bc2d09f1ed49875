"""What one draft forward costs, as a fraction of one target step, timed by the engine itself.

    cost = measure_draft_cost(engine, prompts, max_new_tokens=64, k=3)
    cost["draft_step_fraction"]    # 0.15: a draft forward costs 0.15 of a one-token target forward

The timings are the engine's own. Every decoding step times its draft forwards and its target
forward (`Batch.step`) and hands both to dynamic k (`DynamicK.observe_step`), whose cost model
keeps a moving average of them. Here those same per-step timings are tapped over a pass that
alternates per prompt:

- the target alone (k = 0): every step is one target forward over one token;
- speculative decoding at a fixed k: every step drafts k tokens, one draft forward each, with the
  adapter the engine serves and its restricted LM head.

    target_step_s       = median over the target alone's steps of verify_s
    draft_step_s        = median over the speculative steps of draft_s / the step's draft forwards
    draft_step_fraction = draft_step_s / target_step_s

Medians, because on a shared machine a stall lands on whichever path runs at the time: with two
cores busy elsewhere, one pass of the default model measured a 71 ms mean `early-exit:4` forward
against a 42 ms target step. The means are kept beside them (`*_mean_ms`).

Example (default model, fp32, 2 cores; dynamic_k.py): an `early-exit:4` forward with the restricted
head takes 4.6 ms and a one-token target forward 31 ms, so draft_step_fraction = 0.15.

Each request's first step with a draft forward is left out: it feeds the draft the whole prompt,
which is a catch-up, not a draft step. Every later step counts as served, a head's accepted
positions fed again with the target's states included. The two kinds of request alternate per
prompt, so both see the same machine state; a slow patch of the machine touches both.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from adaptive_spec.engine import Engine

COST_K = 3  # tokens drafted per step in the timed pass when the run fixes no k


@dataclass
class TimedStep:
    """One decoding step's timings, as the engine measured them."""

    draft_forwards: int
    draft_s: float  # all of the step's draft forwards
    verify_s: float  # its one target forward


def measure_draft_cost(engine: Engine, prompts: list, max_new_tokens: int, k: int = COST_K) -> dict:
    """Time draft and target steps side by side on `prompts` (token ids, strings or messages).

    Returns `draft_step_fraction` (None when nothing was timed), `draft_step_ms` and `target_step_ms`
    (medians; their means as `*_mean_ms`), how many forwards each is over, and the k of the pass.
    Greedy and unconstrained: the cost of a forward, not of a grammar.
    """
    if not prompts:
        raise ValueError("measure_draft_cost needs at least one prompt")
    engine.generate(prompts[0], 4, speculative=False)  # warm up both paths before anything is timed
    engine.generate(prompts[0], 4, k=k)
    target_steps: list[TimedStep] = []
    draft_steps: list[TimedStep] = []
    for prompt in prompts:
        with tapped_steps(engine) as steps:
            engine.generate(prompt, max_new_tokens, speculative=False)
        target_steps += [step for step in steps if not step.draft_forwards]
        with tapped_steps(engine) as steps:
            engine.generate(prompt, max_new_tokens, k=k)
        drafting = [step for step in steps if step.draft_forwards]
        draft_steps += drafting[1:]  # the first one fed the prompt to the draft
    draft_s = [step.draft_s / step.draft_forwards for step in draft_steps]  # one sample per step: its time per forward
    target_s = [step.verify_s for step in target_steps]
    draft_ms, target_ms = _ms(draft_s, statistics.median), _ms(target_s, statistics.median)
    return {
        "draft_step_fraction": draft_ms / target_ms if draft_ms is not None and target_ms else None,
        "draft_step_ms": draft_ms,
        "target_step_ms": target_ms,
        "draft_step_mean_ms": _ms(draft_s, statistics.fmean),
        "target_step_mean_ms": _ms(target_s, statistics.fmean),
        "draft_forwards_timed": sum(step.draft_forwards for step in draft_steps),
        "target_forwards_timed": len(target_steps),
        "cost_k": k,
    }


def _ms(seconds: list[float], centre) -> float | None:
    return centre(seconds) * 1000 if seconds else None


@contextmanager
def tapped_steps(engine: Engine) -> Iterator[list[TimedStep]]:
    """The timings of the steps the engine decodes inside the block, as it hands them to dynamic k
    (which still gets them: its cost model goes on learning)."""
    steps: list[TimedStep] = []
    policy = engine.policy
    observe = policy.observe_step

    def tap(rows, width, verify_s, draft_rows, draft_forwards, draft_s, catch_up=False):
        steps.append(TimedStep(draft_forwards, draft_s, verify_s))
        observe(rows, width, verify_s, draft_rows, draft_forwards, draft_s, catch_up)

    policy.observe_step = tap
    try:
        yield steps
    finally:
        del policy.observe_step  # the class's own method again
