"""`adaptive-spec bench` on a tiny model: every contract key, figures that add up, outputs compared."""

import math

import pytest
from tiny import tiny_target

from adaptive_spec import Engine
from adaptive_spec.outputs.prompts import PromptItem
from benchmarks.bench import format_report, run_bench

pytestmark = pytest.mark.usefixtures("one_thread")

CONTRACT = {
    "target_tok_s",
    "spec_tok_s",
    "hf_assisted_tok_s",
    "speedup_vs_target",
    "speedup_vs_hf",
    "acceptance_rate",
    "mean_acceptance_length",
    "target_forwards_per_token",
    "identical",
    "prompts",
    "max_new_tokens",
    "draft",
    "k",
    "dtype",
}


@pytest.mark.parametrize("k", [2, None])
def test_bench_figures(k):
    engine = Engine(tiny_target(0), "early-exit:1", eos_token_id=[])
    items = [PromptItem([5, 6, 7, 8]), PromptItem([9, 3, 9, 3, 9])]
    figures = run_bench(engine, items, max_new_tokens=12, k=k, progress=False)
    assert set(figures) >= CONTRACT
    assert figures["identical"] is True and figures["identical_prompts"] == 2
    assert figures["prompts"] == 2 and figures["k"] == (k if k is not None else "dynamic")
    assert math.isclose(figures["speedup_vs_target"], figures["spec_tok_s"] / figures["target_tok_s"])
    assert math.isclose(figures["speedup_vs_hf"], figures["spec_tok_s"] / figures["hf_assisted_tok_s"])
    assert figures["ttft_target_s"] > 0 and figures["ttft_spec_s"] > 0
    assert math.isclose(figures["ttft_ratio"], figures["ttft_spec_s"] / figures["ttft_target_s"])
    assert 1.0 <= figures["mean_acceptance_length"] <= (k or 8) + 1
    depths = figures["acceptance_by_depth"]
    assert 1 <= len(depths) <= (k or 8) and all(0.0 <= rate <= 1.0 for rate in depths)
    assert 0 < figures["tokens_verified_per_step"] <= (k or 8)  # a chain verifies at most k per step
    report = format_report(figures)
    assert "time to first token" in report and "acceptance by depth 1: " in report


@pytest.mark.parametrize("draft", ["head", "ngram+early-exit:1"])
def test_a_draft_transformers_cannot_assist_with_leaves_the_hf_paths_out(draft):
    """transformers' generate has no EAGLE head or ngram+ draft: timing it without a draft and
    calling that "HF assisted" would measure something else, so the HF keys are null."""
    engine = Engine(tiny_target(0), draft, eos_token_id=[])
    figures = run_bench(engine, [PromptItem([5, 6, 7, 8])], max_new_tokens=8, k=2, progress=False)
    assert set(figures) >= CONTRACT and figures["identical"] is True
    assert figures["hf_assisted_tok_s"] is None and figures["hf_target_tok_s"] is None
    assert (
        figures["hf_peer"]
        == f"none: transformers' generate has no {draft} draft (it assists with a draft model or prompt lookup)"
    )
    assert f"no HF peer: transformers' generate has no {draft} draft" in format_report(figures)


def test_prompts_with_a_response_format_run_constrained_on_both_paths_and_skip_the_hf_peer():
    from tiny_bytes import tiny_byte_tokenizer

    tokenizer = tiny_byte_tokenizer()
    engine = Engine(tiny_target(0), "early-exit:1", tokenizer, eos_token_id=tokenizer.eos_token_id)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    items = [PromptItem("one", response_format=fmt), PromptItem("two", response_format={"type": "json_object"})]
    figures = run_bench(engine, items, max_new_tokens=12, k=2, progress=False)
    assert figures["constrained_prompts"] == 2 and figures["identical"] is True
    assert set(figures) >= CONTRACT and "no HF peer" in format_report(figures)
    assert figures["hf_assisted_tok_s"] is None and figures["speedup_vs_hf"] is None
    assert figures["drafted"] > 0  # the constrained path speculates too
    # Constrained means the grammar steered the output: the tiny random model alone writes no JSON.
    free = engine.generate("one", 12, k=2)
    shaped = engine.generate("one", 12, k=2, response_format=fmt)
    assert shaped.text.startswith("{") and free.text != shaped.text


def test_tool_lines_run_their_forced_calls_on_both_paths():
    """A line with tools runs as the server would run it: the tools in the prompt and, when it forces
    a call, the call's grammar on the target alone and on ours alike (prompts.encode_item)."""
    from tiny_bytes import tiny_byte_tokenizer
    from tiny_tools import TOOLS, TOOLS_TEMPLATE

    from adaptive_spec.outputs.prompts import encode_item

    tokenizer = tiny_byte_tokenizer(chat_template=TOOLS_TEMPLATE)
    engine = Engine(tiny_target(0, positions=1024), "early-exit:1", tokenizer, eos_token_id=tokenizer.eos_token_id)
    ask = [{"role": "user", "content": "Go."}]
    items = [PromptItem(ask, tools=TOOLS, tool_choice="required"), PromptItem(ask, tools=TOOLS, tool_choice="none")]
    figures = run_bench(engine, items, max_new_tokens=24, k=2, progress=False)
    assert figures["constrained_prompts"] == 1 and figures["identical"] is True and figures["drafted"] > 0
    ids, forced = encode_item(items[0], engine)
    assert "get_weather" in tokenizer.decode(ids) and forced["type"] == "grammar"
    assert engine.generate(ids, 24, response_format=forced).text.startswith("<tool_call>\n")
    plain_ids, free = encode_item(items[1], engine)
    assert free is None and "get_weather" not in tokenizer.decode(plain_ids)
