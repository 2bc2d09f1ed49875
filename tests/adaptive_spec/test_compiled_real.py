"""The compiled decoding step on the built-in default model, bf16: the `compiled` group.

Run alone with: ./run tests -m compiled   (compiling takes a few minutes on 2 cores the first time;
the default suite leaves this group out and tests the compiled step on a tiny model instead)
"""

import pytest

from adaptive_spec import Engine
from adaptive_spec.outputs.prompts import load_prompts
from benchmarks.prompts import shipped

pytestmark = pytest.mark.compiled

MAX_NEW = 48


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine.from_pretrained(
        draft="head", device="cpu", dtype="bf16", compile=True, compile_dir=tmp_path_factory.mktemp("compile")
    )


@pytest.fixture(scope="module")
def prompts():
    return [item.prompt for item in load_prompts(shipped("chat"))[:6]]


@pytest.fixture(scope="module")
def baselines(engine, prompts):
    return [engine.generate(p, MAX_NEW, speculative=False).token_ids for p in prompts]


def test_the_compiled_bf16_step_is_batch_invariant(engine):
    assert engine.path == "compiled"
    assert engine.exactness.exact, engine.exactness.summary()
    assert engine.exactness.prefix_reuse, engine.exactness.summary()  # prefills, compiled, split anywhere


@pytest.mark.parametrize(("draft", "k"), [("head", None), ("head", 4), ("early-exit:4", 3)])
def test_compiled_greedy_and_batched_rows_equal_the_compiled_target_alone(engine, prompts, baselines, draft, k):
    drafting = engine if draft == "head" else Engine(engine.target, draft, engine.tokenizer, compile=False)
    # a second Engine over the same target keeps its compiled step (compile=False installs nothing new)
    assert drafting.path == engine.path or draft != "head"
    assert drafting.generate(prompts[0], MAX_NEW, k=k).token_ids == baselines[0]
    outputs = drafting.generate_batch(prompts, MAX_NEW, max_batch=8, k=k)
    for i, (out, base) in enumerate(zip(outputs, baselines, strict=True)):
        assert out.token_ids == base, f"draft={draft} k={k} prompt {i} batched"
