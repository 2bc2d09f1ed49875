"""The evaluation gate: teacher-forced agreement figures and the accept/reject rule.

Run: .venv/bin/python -m pytest tests/trainer/test_gate.py -q   (CPU, one thread, a few seconds)

What must hold:

- draft_agreement equals a slow per-record reference (full forward, plain loops), whatever the
  batching, with records of different widths m;
- the target scored as its own draft matches greedily everywhere, and its expected acceptance is
  exactly its logged top-m mass, which shows the figure is a lower bound on sum min(q, p);
- adapters_disabled gives the base draft for a PeftModel and for adapters loaded by transformers,
  and restores the adapter afterwards;
- the gate refuses too few positions, a copy of the champion, figures from different held-out
  sets and a loss in expected acceptance; it accepts a clear gain.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

# pytest --import-mode=importlib adds no test dir; the tiny models live with the engine tests.
from tiny import llama

from adaptive_spec.drafters.early_exit import build_early_exit
from adaptive_spec.formats.record import CorrectionRecord
from trainer.evaluation.gate import Gate, GateFigures, adapters_disabled, draft_agreement
from trainer.learning.distill import DraftTrainer, LoraSettings

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


@pytest.fixture(scope="module")
def target():
    return llama(0, vocab=VOCAB).requires_grad_(False)


def logged_records(target, count: int, m: int | list[int], seed: int = 0) -> list[CorrectionRecord]:
    """Random prompts and outputs with the target's teacher-forced top-m at each output position."""
    rng = np.random.default_rng(seed)
    widths = m if isinstance(m, list) else [m] * count
    records = []
    for i, width in enumerate(widths):
        prompt = rng.integers(0, VOCAB, rng.integers(2, 9)).tolist()
        output = rng.integers(0, VOCAB, rng.integers(4, 13)).tolist()
        with torch.no_grad():
            logits = target(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :]  # [n_out, vocab]
        top = torch.log_softmax(logits, dim=-1).topk(width, dim=-1)
        records.append(
            CorrectionRecord(
                request_id=f"g{seed}-{i}",
                created_at=0.0,
                domain=None,
                target_id="tiny",
                draft_id="early-exit:1",
                adapter_version=None,
                temperature=0.0,
                prompt_ids=prompt,
                output_ids=output,
                proposed=[-1] * len(output),
                accepted=[False] * len(output),
                target_topk_ids=top.indices,
                target_topk_logprobs=top.values,
            )
        )
    return records


def reference_agreement(draft, records) -> GateFigures:
    """The slow way: one full forward per record, a plain loop over positions."""
    expected, matched, positions = 0.0, 0, 0
    for each in records:
        n_prompt = len(each.prompt_ids)
        with torch.no_grad():
            logits = draft(torch.tensor([each.prompt_ids + each.output_ids[:-1]])).logits[0]  # [seq, vocab]
        for j in range(len(each.output_ids)):
            draft_probs = torch.softmax(logits[n_prompt - 1 + j], dim=-1)  # [vocab]
            for token, logprob in zip(each.target_topk_ids[j], each.target_topk_logprobs[j], strict=True):
                expected += min(float(draft_probs[token]), math.exp(float(logprob)))
            matched += int(logits[n_prompt - 1 + j].argmax()) == int(each.target_topk_ids[j][0])
            positions += 1
    return GateFigures(expected / positions, matched / positions, positions)


def test_agreement_equals_a_slow_reference_whatever_the_batching(target):
    draft = build_early_exit(target, 2)
    records = logged_records(target, 9, m=[4, 8, 16, 4, 8, 16, 4, 8, 16])  # mixed widths: padded in a batch
    reference = reference_agreement(draft, records)
    for batch_tokens in (1, 40, 100_000):
        figures = draft_agreement(draft, records, batch_tokens=batch_tokens)
        assert figures.positions == reference.positions
        assert figures.greedy_match == pytest.approx(reference.greedy_match, abs=1e-12)
        assert figures.expected_acceptance == pytest.approx(reference.expected_acceptance, abs=1e-5)
    empty = draft_agreement(draft, [])
    assert empty.positions == 0 and math.isnan(empty.greedy_match) and math.isnan(empty.expected_acceptance)


def test_per_record_scores_add_up_to_the_totals_whatever_the_batching(target):
    draft = build_early_exit(target, 2)
    records = logged_records(target, 9, m=[4, 8, 16, 4, 8, 16, 4, 8, 16])
    alone = [draft_agreement(draft, [record]) for record in sorted(records, key=lambda r: r.request_id)]
    for batch_tokens in (1, 40, 100_000):
        scores = draft_agreement(draft, records, batch_tokens=batch_tokens).records
        assert scores.records == len(records)  # one entry per record, in request-id order
        assert scores.positions.tolist() == [figures.positions for figures in alone]
        assert scores.matched.tolist() == [round(f.greedy_match * f.positions) for f in alone]
        assert scores.expected == pytest.approx([f.expected_acceptance * f.positions for f in alone], abs=1e-4)


def test_target_as_its_own_draft_shows_the_figure_is_a_top_m_lower_bound(target):
    for m in (4, VOCAB):
        records = logged_records(target, 5, m=m, seed=1)
        figures = draft_agreement(target, records)
        logged_mass = np.concatenate([np.exp(r.target_topk_logprobs.astype(float)).sum(-1) for r in records]).mean()
        assert figures.greedy_match == 1.0
        # min(q, p) = p for every listed id (q = p up to fp16 logging): the sum is the top-m mass,
        # 1 with the whole vocabulary and less with m = 4, although the true sum min(q, p) is 1.
        assert figures.expected_acceptance == pytest.approx(logged_mass, abs=2e-3)
        if m == VOCAB:
            assert figures.expected_acceptance == pytest.approx(1.0, abs=2e-3)
        else:
            assert figures.expected_acceptance < 0.9


def randomise_lora(model, seed: int = 0) -> None:
    """Give LoRA's B matrices (zero at init) random values, so the adapter changes the draft."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)


def test_adapters_disabled_gives_the_base_draft_and_restores_the_adapter(target, tmp_path):
    records = logged_records(target, 6, m=8, seed=2)
    base = draft_agreement(build_early_exit(target, 1), records)
    trainer = DraftTrainer(build_early_exit(target, 1), LoraSettings(r=4))
    assert draft_agreement(trainer.model, records) == base  # B = 0: an untrained adapter changes nothing
    randomise_lora(trainer.model)
    adapted = draft_agreement(trainer.model, records)
    assert adapted != base
    with adapters_disabled(trainer.model):
        assert draft_agreement(trainer.model, records) == base
    assert draft_agreement(trainer.model, records) == adapted

    # The same adapter loaded into a plain draft by transformers, as a server would.
    trainer.save(tmp_path / "a")
    plain = build_early_exit(target, 1)
    with adapters_disabled(plain):  # no adapter yet: nothing to disable
        assert draft_agreement(plain, records) == base
    plain.load_adapter(str(tmp_path / "a"), adapter_name="a")
    plain.set_adapter("a")
    served = draft_agreement(plain, records)
    assert served.greedy_match == pytest.approx(adapted.greedy_match, abs=1e-12)
    assert served.expected_acceptance == pytest.approx(adapted.expected_acceptance, abs=1e-6)
    plain.requires_grad_(False)  # set_adapter marks the adapter trainable; a server wants it frozen
    with adapters_disabled(plain):
        assert draft_agreement(plain, records) == base
    assert draft_agreement(plain, records) == served
    assert not any(p.requires_grad for p in plain.parameters())  # and adapters_disabled left it so


# ---------------------------------------------------------------- the rule

GATE = Gate(min_positions=1000, margin=0.01)
CHAMPION = GateFigures(expected_acceptance=0.40, greedy_match=0.50, positions=1200)


@pytest.mark.parametrize(
    ("candidate", "accepted", "why"),
    [
        # a clear gain on both figures: promote
        (GateFigures(0.45, 0.56, 1200), True, "0.5000 -> 0.5600"),
        # exactly the champion (e.g. an adapter that did not train): refuse
        (CHAMPION, False, "below the margin"),
        # a gain smaller than the margin: noise, refuse
        (GateFigures(0.41, 0.505, 1200), False, "below the margin"),
        # greedy match up but sampling acceptance down: refuse
        (GateFigures(0.39, 0.60, 1200), False, "expected acceptance fell"),
        # scored on another held-out set than the champion: not comparable
        (GateFigures(0.45, 0.60, 1300), False, "different held-out sets"),
        # no held-out data: NaN figures never pass
        (GateFigures(math.nan, math.nan, 1200), False, "below the margin"),
    ],
)
def test_gate_decides(candidate, accepted, why):
    decision, reason = GATE.decide(candidate, CHAMPION)
    assert decision is accepted and why in reason


def test_gate_refuses_too_few_positions_even_for_a_large_gain():
    few = GateFigures(0.40, 0.50, 999)
    decision, reason = GATE.decide(GateFigures(0.90, 0.95, 999), few)
    assert not decision and "only 999 held-out positions, need 1000" in reason
    assert GATE.decide(GateFigures(0.90, 0.95, 1000), GateFigures(0.40, 0.50, 1000))[0]
