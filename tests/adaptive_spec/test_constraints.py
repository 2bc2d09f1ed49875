"""Penalties, logit bias, log-probabilities and n choices (`adaptive_spec.outputs.constraints`, `Trace`,
`Engine.requests`), each lossless under speculation, on tiny random Llama models (`tiny.py`).

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_constraints.py -q   (CPU, under a minute)

Structured outputs need a real tokenizer and are tested on the default model in
test_structured.py.
"""

from __future__ import annotations

import pytest
import torch
from tiny import VOCAB, tiny_draft, tiny_target

from adaptive_spec import Engine, InputError
from adaptive_spec.outputs.constraints import Constraints, Penalties

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 33, 8, 5, 17, 33, 8, 5, 17], [44], list(range(20, 43)), [7, 7, 2]]
PENALTIES = [
    dict(frequency_penalty=0.8),
    dict(presence_penalty=1.5, logit_bias={3: 4.0, 40: -100.0}),
    dict(repetition_penalty=1.3, frequency_penalty=-0.5),
    dict(frequency_penalty=2.0, presence_penalty=-2.0, repetition_penalty=0.7, logit_bias={11: 100.0}),
]

_target = tiny_target(0)


# --- the formulas, by hand -----------------------------------------------------------------------


def test_penalties_follow_openais_formulas_position_by_position() -> None:
    # Output so far [7, 9, 7]; the draft is [9, 4]; three verified positions.
    penalties = Penalties(frequency=0.5, presence=0.25, logit_bias=((4, 1.0),))
    constraints = Constraints(penalties, None, prompt_ids=[1], vocab_size=12, device=torch.device("cpu"))
    constraints.commit([7, 9, 7])
    logits = torch.zeros(3, 12)
    out = constraints.target(logits, [9, 4])
    # token 7: twice in the output at every position -> -(0.5 * 2 + 0.25) = -1.25
    assert out[:, 7].tolist() == [-1.25, -1.25, -1.25]
    # token 9: once before the draft, twice after d1 = 9 -> -0.75, then -1.25 twice
    assert out[:, 9].tolist() == [-0.75, -1.25, -1.25]
    # token 4: biased +1; at the last position (after d2 = 4) once in the output: 1 - 0.5 - 0.25
    assert out[:, 4].tolist() == [1.0, 1.0, 0.25]
    assert out[:, 0].tolist() == [0.0, 0.0, 0.0]  # untouched


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    constraints = Constraints(Penalties(repetition=2.0), None, prompt_ids=[1], vocab_size=4, device=torch.device("cpu"))
    constraints.commit([2])
    out = constraints.target(torch.tensor([[3.0, 3.0, -3.0, 3.0]]), [])
    assert out[0].tolist() == [3.0, 1.5, -6.0, 3.0]  # 1 is in the prompt, 2 in the output, 0 and 3 in neither


def test_the_draft_side_maps_a_restricted_vocabulary() -> None:
    constraints = Constraints(Penalties(frequency=1.0, logit_bias=((5, 2.0),)), None, [0], 8, torch.device("cpu"))
    constraints.commit([5])
    out = constraints.draft(torch.zeros(3), drafted=[6], ids=torch.tensor([2, 5, 6]))
    assert out.tolist() == [0.0, 1.0, -1.0]  # 5: -1 + 2; 6: drafted once


# --- lossless under speculation --------------------------------------------------------------------


@pytest.mark.parametrize("options", PENALTIES)
@pytest.mark.parametrize("draft", ["early-exit:2", "head", "ngram", "separate-model"])
def test_greedy_with_penalties_equals_the_target_alone_with_them(draft: str, options: dict) -> None:
    engine = Engine(_target, tiny_draft() if draft == "separate-model" else draft)
    alone = [engine.generate(p, max_new_tokens=24, speculative=False, **options).token_ids for p in PROMPTS]
    plain = [engine.generate(p, max_new_tokens=24, speculative=False).token_ids for p in PROMPTS]
    assert alone != plain, "these penalties change nothing here: the test would not see them"
    for k in (1, 3, None):
        outputs = engine.generate_batch(PROMPTS, max_new_tokens=24, k=k, max_batch=3, **options)
        assert [out.token_ids for out in outputs] == alone, (draft, k)
    assert any(out.stats.drafted for out in outputs)
    if -100.0 in options.get("logit_bias", {}).values():
        assert all(40 not in tokens for tokens in alone)


def test_bad_penalties_are_input_errors() -> None:
    engine = Engine(_target, "ngram")
    for options, phrase in [
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(presence_penalty=-3), "presence_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(repetition_penalty=5e-324), "repetition_penalty"),  # > 0, yet logits / 5e-324 overflow to inf
        (dict(seed=2**64, temperature=1.0), "seed"),  # torch generators take 64 bits
        (dict(logit_bias={VOCAB: 1.0}), "logit_bias"),
        (dict(logit_bias={3: 101.0}), "logit_bias"),
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
        (dict(response_format={"type": "json_object"}), "tokenizer"),
    ]:
        with pytest.raises(InputError, match=phrase):
            engine.request(PROMPTS[0], **options)
    with pytest.raises(InputError, match="n must be"):
        engine.requests(PROMPTS[0], 9)


# --- log-probabilities -----------------------------------------------------------------------------


@pytest.mark.parametrize("draft", ["early-exit:2", "head", "ngram"])
def test_logprobs_are_the_targets_with_and_without_speculation_and_a_plain_forward(draft: str) -> None:
    engine = Engine(_target, draft)
    for prompt in PROMPTS:
        alone = engine.generate(prompt, max_new_tokens=20, speculative=False, logprobs=5)
        spec = engine.generate(prompt, max_new_tokens=20, k=3, logprobs=5)
        assert spec.token_ids == alone.token_ids
        torch.testing.assert_close(torch.tensor(spec.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
        assert [[t for t, _ in top] for top in spec.top_logprobs] == [[t for t, _ in top] for top in alone.top_logprobs]
        with torch.inference_mode():  # a plain transformers forward over prompt + output
            logits = _target(input_ids=torch.tensor([prompt + alone.token_ids])).logits[0, len(prompt) - 1 : -1]
        reference = torch.log_softmax(logits, -1).gather(1, torch.tensor(alone.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(spec.logprobs), reference, atol=1e-4, rtol=0)
        for position, top in enumerate(spec.top_logprobs):
            assert len(top) == 5 and top[0][1] >= top[-1][1]
            assert spec.token_ids[position] == top[0][0]  # greedy: the chosen token is the most likely
    assert engine.generate(PROMPTS[0], max_new_tokens=5, logprobs=0).top_logprobs is None
    assert engine.generate(PROMPTS[0], max_new_tokens=5).logprobs is None


def test_logprobs_are_cut_with_the_output_at_eos() -> None:
    plain = Engine(_target, None).generate(PROMPTS[0], max_new_tokens=20, speculative=False).token_ids
    eos = plain[6]
    out = Engine(_target, _target, eos_token_id=eos).generate(PROMPTS[0], max_new_tokens=20, k=5, logprobs=2)
    assert out.token_ids[-1] == eos and len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids)


# --- n choices -------------------------------------------------------------------------------------


def test_n_choices_share_one_prefill_and_repeat_with_a_seed() -> None:
    engine = Engine(_target, "early-exit:2")
    options = dict(max_new_tokens=16, temperature=1.0, seed=42)

    def choices():
        batch = engine.new_batch(8)
        rows = batch.add_group(engine.requests(PROMPTS[2], 4, **options))
        outputs = {}
        while len(batch):
            for row, chunk in batch.step():
                if chunk.output is not None:
                    outputs[rows.index(row)] = chunk.output.token_ids
        return [outputs[i] for i in range(4)], rows

    first, rows = choices()
    again, _ = choices()
    assert first == again  # seeded: the n choices repeat
    assert len({tuple(c) for c in first}) > 1  # each choice draws from its own generator
    assert first[0] == engine.generate(PROMPTS[2], **options).token_ids  # choice 0 is the single seeded request
    assert rows[0].stats.prefill_s > 0 and all(row.stats.prefill_s == 0 for row in rows[1:])  # one prefill


def test_greedy_n_choices_are_all_the_target_alone() -> None:
    engine = Engine(_target, "head")
    batch = engine.new_batch(4)
    batch.add_group(engine.requests(PROMPTS[0], 3, max_new_tokens=20, k=2))
    outputs = [chunk.output.token_ids for _ in range(100) for _, chunk in batch.step() if chunk.output]
    alone = engine.generate(PROMPTS[0], max_new_tokens=20, speculative=False).token_ids
    assert outputs == [alone] * 3
