"""The lossless invariant and a short bench on a CUDA device: the `cuda` group.

Run with: ./run tests -m cuda. Where no CUDA device exists, every test here is reported as skipped
("no CUDA device"), never as passed.
"""

import pytest
import torch

from adaptive_spec import Engine
from adaptive_spec.outputs.prompts import PromptItem, load_prompts
from benchmarks.prompts import shipped

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the cuda group did not run"),
]


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(draft="head", device="cuda", dtype="bf16", compile=False)


def test_bf16_on_cuda_says_whether_it_is_exact(engine):
    report = engine.exactness
    assert report.compared > 0 and report.dtype == "bfloat16"


@pytest.mark.parametrize(("draft", "k"), [("head", None), ("early-exit:4", 4), ("ngram+head", None)])
def test_greedy_speculative_and_batched_equal_the_target_alone_on_cuda(engine, draft, k):
    if not engine.exactness.exact:
        pytest.skip(f"bf16 on this GPU is not batch-invariant ({engine.exactness.summary()}): equality is not claimed")
    prompts = [item.prompt for item in load_prompts(shipped("chat"))[:4]]
    baseline = [engine.generate(p, 32, speculative=False).token_ids for p in prompts]
    drafting = engine if draft == "head" else Engine(engine.target, draft, engine.tokenizer)
    outputs = drafting.generate_batch(prompts, 32, max_batch=4, k=k)
    assert [out.token_ids for out in outputs] == baseline


def test_a_short_bench_runs_on_cuda(engine):
    from benchmarks.bench import run_bench

    items = [PromptItem(p) for p in ["Name three rivers.", "Write a haiku about rain."]]
    figures = run_bench(engine, items, max_new_tokens=16, k=None, hf=False, progress=False)
    assert figures["target_tok_s"] > 0 and figures["spec_tok_s"] > 0
