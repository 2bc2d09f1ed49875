"""Integration tests on the built-in default model (SmolLM2-135M-Instruct, CPU): fp32, then bf16.

Run alone with: ./run tests -m real_model
The first run converts the shipped GGUF file to safetensors (about 20 s); later runs reuse it.
"""

import pytest
import torch

from adaptive_spec import Engine, InputError
from adaptive_spec.outputs.prompts import load_prompts
from benchmarks.prompts import shipped

pytestmark = pytest.mark.real_model

MAX_NEW = 64


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(draft="early-exit:4", device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def prompts():
    # Prompts whose answers run past 64 tokens, so every comparison covers a full 64.
    return [item.prompt for item in load_prompts(shipped("chat"))[:6]]


@pytest.fixture(scope="module")
def baselines(engine, prompts):
    return [engine.generate(p, MAX_NEW, speculative=False) for p in prompts]


def test_baseline_equals_transformers_generate(engine, prompts, baselines):
    """Our target-alone path is the reference every figure divides by; it must be HF's greedy."""
    for prompt, base in list(zip(prompts, baselines, strict=True))[:2]:
        ids = engine.encode_prompt(prompt)
        with torch.inference_mode():
            hf = engine.target.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=MAX_NEW,
                do_sample=False,
            )
        assert hf[0, len(ids) :].tolist() == base.token_ids


def test_at_least_five_prompts_run_the_full_length(baselines):
    assert sum(len(b.token_ids) == MAX_NEW for b in baselines) >= 5


@pytest.mark.parametrize("k", [None, 4])
def test_greedy_early_exit_equals_target(engine, prompts, baselines, k):
    """One request at a time, on 3 prompts; test_batched_rows_equal_the_target_alone runs all 6."""
    for prompt, base in list(zip(prompts, baselines, strict=True))[:3]:
        out = engine.generate(prompt, MAX_NEW, k=k)
        assert out.token_ids == base.token_ids, f"k={k}: {prompt[-1]['content'][:60]!r}"
        assert out.text == base.text


def test_greedy_ngram_equals_target(engine, prompts, baselines):
    ngram = Engine(engine.target, "ngram", engine.tokenizer)
    for prompt, base in list(zip(prompts, baselines, strict=True))[:3]:  # batched: all 6, below
        assert ngram.generate(prompt, MAX_NEW, k=4).token_ids == base.token_ids


def test_fixed_k_drafts_and_counts(engine, prompts):
    out = engine.generate(prompts[0], MAX_NEW, k=4)
    s = out.stats
    assert s.drafted > 0 and s.target_forwards < MAX_NEW + 1
    assert s.emitted == len(out.token_ids)
    assert s.mean_acceptance_length == pytest.approx(s.emitted / s.target_forwards)


def test_stop_string_and_sampling_seed(engine, prompts):
    full = engine.generate(prompts[0], MAX_NEW)
    assert " the" in full.text, "pick a stop string that occurs in this output"
    out = engine.generate(prompts[0], MAX_NEW, stop=[" the"])
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(" the")]
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < len(full.token_ids)
    a = engine.generate(prompts[1], 24, temperature=0.8, top_p=0.95, seed=7)
    b = engine.generate(prompts[1], 24, temperature=0.8, top_p=0.95, seed=7)
    assert a.token_ids == b.token_ids


def test_clear_errors(engine):
    with pytest.raises(InputError, match="empty"):
        engine.generate("", 8)
    with pytest.raises(InputError, match="context"):
        engine.generate([1] * engine.max_context, 8)
    with pytest.raises(InputError, match="role"):
        engine.generate([{"role": "wizard", "content": "hi"}], 8)


def test_a_gguf_path_loads_the_same_model(engine, prompts, baselines):
    from adaptive_spec.models import default_gguf_path

    by_path = Engine.from_pretrained(target=str(default_gguf_path()), draft="ngram", device="cpu", dtype="fp32")
    assert by_path.generate(prompts[0], 16, speculative=False).token_ids == baselines[0].token_ids[:16]


@pytest.mark.parametrize(
    ("draft", "k"),
    [("early-exit:4", None), ("early-exit:4", 4), ("head", None), ("head", 4), ("ngram+head", None), (None, None)],
)
def test_batched_rows_equal_the_target_alone(engine, prompts, baselines, draft, k):
    """Continuous batching at 4 rows, 6 chat prompts joining as rows free up: each row's greedy
    output equals the target alone for its prompt, token for token (None: the target alone,
    batched, against the target alone in a batch of one). `head` is the default draft; at k = 4 it
    drafts on its own states each round. `ngram+head` with dynamic k mixes rows that copy, rows
    that draft with the head and rows that decode plainly in one step."""
    batched_engine = engine if draft == "early-exit:4" else Engine(engine.target, draft, engine.tokenizer)
    options = dict(k=k) if draft else dict(speculative=False)
    outputs = batched_engine.generate_batch(prompts, MAX_NEW, max_batch=4, **options)
    for prompt, out, base in zip(prompts, outputs, baselines, strict=True):
        assert out.token_ids == base.token_ids, f"draft={draft} k={k}: {prompt[-1]['content'][:60]!r}"
        assert out.text == base.text


# =================================================================================================
# bf16: exact through batch-invariant kernels (adaptive_spec/kernels/exact.py)
# =================================================================================================


@pytest.fixture(scope="module")
def bf16_engine():
    return Engine.from_pretrained(draft="head", device="cpu", dtype="bf16")


@pytest.fixture(scope="module")
def bf16_baselines(bf16_engine, prompts):
    return [bf16_engine.generate(p, MAX_NEW, speculative=False) for p in prompts]


def test_bf16_logits_are_bitwise_the_same_whatever_shares_the_forward(bf16_engine):
    """A plain step, verifies of 2 to 17 tokens, batches of 2 to 8 rows with padding (exact.check)."""
    report = bf16_engine.exactness
    assert report.exact, report.summary()
    assert report.compared >= 60


@pytest.mark.parametrize(
    ("draft", "k"),
    [("head", None), ("head", 4), ("head-tree", 3), ("early-exit:4", 4), ("ngram+head", None), (None, None)],
)
def test_bf16_greedy_and_batched_rows_equal_the_bf16_target_alone(bf16_engine, prompts, bf16_baselines, draft, k):
    """In bf16 near-ties are common (2 of 6 prompts stayed identical before the invariant kernels):
    one request at a time on 2 prompts, and all 6 in one batch of 8 rows, token for token. `head-tree`:
    the head drafting trees of up to 12 nodes, 3 deep."""
    if draft == "head-tree":
        engine = Engine(bf16_engine.target, "head", bf16_engine.tokenizer, tree_budget=12)
    else:
        engine = bf16_engine if draft == "head" else Engine(bf16_engine.target, draft, bf16_engine.tokenizer)
    options = dict(k=k) if draft else dict(speculative=False)
    for prompt, base in list(zip(prompts, bf16_baselines, strict=True))[:2]:
        if draft:
            assert engine.generate(prompt, MAX_NEW, **options).token_ids == base.token_ids, f"draft={draft} k={k} alone"
    outputs = engine.generate_batch(prompts, MAX_NEW, max_batch=8, **options)
    for prompt, out, base in zip(prompts, outputs, bf16_baselines, strict=True):
        assert out.token_ids == base.token_ids, f"draft={draft} k={k} batched: {prompt[-1]['content'][:60]!r}"
