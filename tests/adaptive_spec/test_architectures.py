"""The architecture matrix: every draft kind, lossless, on tiny random models of the families users bring.

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_architectures.py -q   (CPU, about a minute)

Seven families (transformers 5 classes, built in code, nothing downloaded: tests/helpers/tiny_families.py):
Llama, Qwen2, Qwen3, Mistral and Gemma 3 (both with sliding-window layers, over a window shorter than the
prompts), Phi-3, and a mixture of experts (Qwen3-MoE). For each:

- the engine's target alone is the model's own greedy decoding (transformers' `generate`), which
  a mask that ignored the sliding window would break;
- every draft kind (head, early-exit:1, ngram, ngram+head, a separate draft model) at fixed and
  dynamic k, one request at a time and batched with staggered rows, equals the target alone,
  token for token, row by row;
- on Gemma 3, sampled tokens follow the target's distribution with a draft that disagrees.

GPT-2 (no `model.model.layers`) decodes with `ngram`, and a head or an early exit is refused with
an error that names the draft asked for and what works instead.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_families import FAMILIES, VOCAB, model_of
from transformers import GPT2Config, GPT2LMHeadModel

from adaptive_spec import Engine
from adaptive_spec.drafters.spec import DraftSpecError

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[(7 * i + 3) % 100 for i in range(30)], [44, 2], [3, 9, 27, 81, 3, 9, 27], list(range(20, 41))]
BUDGETS = [16, 9, 20, 12]
DRAFTS = ["head", "early-exit:1", "ngram", "ngram+head", "separate-model"]


def target_alone(family: str) -> list[list[int]]:
    engine = Engine(model_of(family), None)
    return [
        engine.generate(p, max_new_tokens=b, speculative=False).token_ids for p, b in zip(PROMPTS, BUDGETS, strict=True)
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_target_alone_is_the_models_own_greedy_decoding(family: str) -> None:
    model = model_of(family)
    alone = target_alone(family)
    for prompt, budget, ours in zip(PROMPTS, BUDGETS, alone, strict=True):
        with torch.inference_mode():
            theirs = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=budget,
                do_sample=False,
            )[0, len(prompt) :].tolist()
        assert ours == theirs, f"{family}: prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_draft_kind_is_lossless_alone_and_batched(family: str, draft: str) -> None:
    model = model_of(family)
    expected = target_alone(family)
    engine = Engine(model, model_of(family, seed=5, layers=1) if draft == "separate-model" else draft)
    drafted = 0
    for k in (3, None):
        alone = [engine.generate(p, max_new_tokens=b, k=k) for p, b in zip(PROMPTS, BUDGETS, strict=True)]
        assert [out.token_ids for out in alone] == expected, f"{family} {draft} k={k} alone"
        batch, rows, outputs, waiting, step = engine.new_batch(3), {}, {}, list(range(len(PROMPTS))), 0
        while waiting or len(batch):
            while waiting and not batch.full and step >= waiting[0]:  # staggered: prompt i from step i
                i = waiting.pop(0)
                rows[batch.add(engine.request(PROMPTS[i], max_new_tokens=BUDGETS[i], k=k))] = i
            for row, chunk in batch.step():
                if chunk.output is not None:
                    outputs[rows.pop(row)] = chunk.output
            step += 1
        assert [outputs[i].token_ids for i in range(len(PROMPTS))] == expected, f"{family} {draft} k={k} batched"
        drafted += sum(out.stats.drafted for out in alone) + sum(out.stats.drafted for out in outputs.values())
    assert drafted > 0, "nothing was drafted: nothing speculative was tested"


def test_gemma3_samples_follow_the_target_with_a_disagreeing_draft() -> None:
    target = model_of("gemma3", seed=3)
    contrary = copy.deepcopy(target)
    with torch.no_grad():
        contrary.lm_head.weight.mul_(-3.0)  # tied to the embedding: the draft's whole view changes
    prompt, trials = [5, 1, 7], 1500
    with torch.inference_mode():
        expected = target(input_ids=torch.tensor([prompt])).logits[0, -1].softmax(-1).double()
    top = expected.topk(6).indices
    engine = Engine(target, contrary, k=1)
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    for trial in range(trials):
        out = engine.generate(prompt, max_new_tokens=2, temperature=1.0, seed=trial)
        counts[out.token_ids[0]] += 1
    # the 6 likeliest tokens and the rest pooled: chi-square with 6 degrees of freedom, p = 0.001
    observed = torch.cat([counts[top], (counts.sum() - counts[top].sum()).reshape(1)])
    wanted = torch.cat([expected[top], (1 - expected[top].sum()).reshape(1)]) * trials
    assert wanted.min() >= 5
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    assert chi2 < 22.46, (chi2, observed.tolist(), wanted.tolist())


def test_gpt2_decodes_with_ngram_and_refuses_a_head_naming_what_works() -> None:
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=None, eos_token_id=None
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    plain = Engine(model, None).generate(PROMPTS[0], max_new_tokens=10, speculative=False).token_ids
    assert Engine(model, "ngram").generate(PROMPTS[0], max_new_tokens=10, k=2).token_ids == plain
    for draft in ("head", "early-exit:1", "ngram+head"):
        with pytest.raises(DraftSpecError, match=rf"the {draft.removeprefix('ngram+')} draft needs .* use `ngram`"):
            Engine(model, draft)


@pytest.mark.parametrize("family", ["gemma3", "mistral", "qwen3_moe", "phi3"])
def test_bf16_is_batch_invariant_on_other_families(family: str) -> None:
    """The invariant kernels (exact.py) are not Llama's alone: sliding windows, experts, fused qkv."""
    from adaptive_spec.kernels import exact

    model = copy.deepcopy(model_of(family)).to(torch.bfloat16)
    report = exact.make_exact(model)
    assert report.exact, report.summary()
