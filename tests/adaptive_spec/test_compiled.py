"""The compiled decoding step (`adaptive_spec.kernels.compiled`) on a tiny random model, in the default suite;
the same on the default model is the `compiled` group (test_compiled_real.py, `./run tests -m compiled`).

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_compiled.py -q   (about a minute: it compiles)

What must hold: one graph serves every shape a batch feeds it (no recompile after the first step),
exactness holds on the compiled path (exact.check), and greedy speculative and batched output
equal the compiled target alone, row by row.
"""

from __future__ import annotations

import io
import itertools
import logging
import sys
import time

import pytest
import torch
import torch._dynamo
from tiny import llama
from transformers import LlamaForCausalLM

from adaptive_spec import Engine
from adaptive_spec.cache import feeding, kv
from adaptive_spec.decoding import batch as batch_module
from adaptive_spec.kernels import compiled, exact

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 33, 8, 5, 17, 33, 8, 5, 17], [44], [3, 9, 27, 81, 3, 9], list(range(20, 43)), [7, 7, 7, 7, 2]]
BUDGETS = [20, 9, 24, 16, 5]


@pytest.fixture(scope="module")
def compiled_engine(tmp_path_factory, kernels):
    torch._dynamo.reset()
    model = llama(0, init=0.02, layers=2).to(torch.bfloat16)
    return Engine(model, "head", compile=True, compile_dir=tmp_path_factory.mktemp("compile"))


def test_the_compiled_step_is_exact_and_one_graph_serves_every_shape(compiled_engine) -> None:
    assert compiled_engine.path == "compiled"
    report = compiled_engine.exactness  # measured on the compiled step: 1x1 up to 8 rows x 17 tokens
    assert report.exact, report.summary()
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    for speculative in (True, False):  # plain batched steps feed every row one token, at width 1
        batch = compiled_engine.new_batch(3)
        for prompt in PROMPTS[:3]:
            batch.add(compiled_engine.request(prompt, max_new_tokens=6, k=2, speculative=speculative))
        while len(batch):
            batch.step()
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames, "a new shape recompiled the step"


def test_the_steps_states_are_the_state_layers_outputs_side_by_side(compiled_engine) -> None:
    """A head reads the target's state layers (feeding.state_layers: EAGLE-3's low, middle and last) side by side. The
    compiled step taps the layers before the last as it runs (compiled._Tap); its states match the eager
    forward's outputs of those layers (feeding.capture_states), the last block is what its logits came from, and the
    prompt's prefill hands the drafter the same."""
    model = compiled_engine.target
    hidden = model.config.hidden_size
    assert feeding.state_layers(model) == (0, 1)  # two layers: the first, and the last
    ids = PROMPTS[3]
    cache = kv.BatchCache.for_model(model)
    cache.add_row()
    with torch.inference_mode():
        logits, states = feeding.feed(model, cache, [0], [ids], all_logits=True, hidden=True)  # compiled
        with feeding.capture_states(model) as captured:
            model.model(input_ids=torch.tensor([ids]), use_cache=False)  # eager, hooked
        eager = captured[0].float()
        normed = model.lm_head(model.model.norm(states[..., -hidden:]))
    assert states.shape == (1, len(ids), 2 * hidden) and eager.shape == states.shape
    assert (states.float() - eager).abs().max() <= 0.05 * eager.abs().max()
    first, last = states[0, :, :hidden].float(), states[0, :, hidden:].float()
    assert (first - last).abs().max() > 0.1 * last.abs().max()  # two layers, not one twice
    assert torch.equal(normed.argmax(-1), logits.argmax(-1))


def test_one_token_steps_are_padded_for_a_lone_row_only_unless_the_check_asked_for_it(compiled_engine) -> None:
    step = feeding.COMPILED[compiled_engine.target]
    assert not step.pad_plain_steps  # the check passed without padding several rows' plain steps
    assert feeding.compiled_width(step, [1]) == 2  # a [1, 1] input would get a graph of its own
    assert feeding.compiled_width(step, [1, 1, 1]) == 1
    assert feeding.compiled_width(step, [1, 3, 2]) == 3
    step.pad_plain_steps = True
    try:
        assert feeding.compiled_width(step, [1, 1, 1]) == 2
        assert feeding.compiled_width(step, [1, 3]) == 3
    finally:
        step.pad_plain_steps = False


def test_make_exact_pads_plain_steps_when_the_check_fails_without(compiled_engine, monkeypatch) -> None:
    model = compiled_engine.target
    step = feeding.COMPILED[model]
    reports = []

    def check(checked, **kwargs):  # exact only once every one-token step is padded
        reports.append(step.pad_plain_steps)
        return exact.InvarianceReport(
            exact=step.pad_plain_steps, compared=69, differing=0, max_abs_diff=0.0, dtype="bf16"
        )

    monkeypatch.setattr(exact, "check", check)
    monkeypatch.setattr(model, "_adaptive_spec_exactness", None, raising=False)
    try:
        report = exact.make_exact(model)
        assert report.exact and reports == [False, True] and step.pad_plain_steps
    finally:
        step.pad_plain_steps = False


def test_compiled_greedy_speculative_and_batched_rows_equal_the_compiled_target_alone(compiled_engine) -> None:
    engine = compiled_engine
    if compiled._KERNEL[0] is not None:  # the head attends through the C++ kernel too (compiled.use_kernel)
        layer = engine.drafter.models()[0].layer
        assert layer.self_attn.config._attn_implementation == compiled.NAME
    baseline = [
        engine.generate(p, max_new_tokens=b, speculative=False).token_ids for p, b in zip(PROMPTS, BUDGETS, strict=True)
    ]
    for k in (2, None):
        outputs = engine.generate_batch(PROMPTS, max_new_tokens=max(BUDGETS), max_batch=3, k=k)
        for i, (out, budget) in enumerate(zip(outputs, BUDGETS, strict=True)):
            assert out.token_ids[:budget] == baseline[i], f"k={k} prompt {i} batched"
        alone = engine.generate(PROMPTS[0], max_new_tokens=BUDGETS[0], k=k)
        assert alone.token_ids == baseline[0]


def test_a_prefill_runs_compiled_with_the_same_bits_alone_beside_other_rows_or_split(compiled_engine) -> None:
    """A prompt's prefill runs through the compiled step (feeding._compiled_prefill), whose products differ from
    the eager ones in their last bits: its keys, values and states must be those of the same prompt fed
    alone, fed into a row of a cache that holds others (through a one-row cache of its own), and fed in two
    parts (a cached prefix, then the rest), or the prefix cache would mix bits of two kinds."""
    model = compiled_engine.target
    step = feeding.COMPILED[model]
    assert compiled_engine.exactness.prefix_reuse, compiled_engine.exactness.summary()
    prompt = PROMPTS[3]

    def prefill(others: list[list[int]], parts: list[list[int]]):
        cache = kv.BatchCache.for_model(model)
        for context in others:
            feeding.feed(model, cache, [cache.add_row()], [context])
        row, states = cache.add_row(), []
        calls = step.calls
        for part in parts:
            states.append(feeding.feed(model, cache, [row], [part], hidden=True)[1][0])
        assert step.calls == calls + len(parts), "the prefill did not run compiled"
        n = cache.lengths[row]
        return [layer[row, :, :n] for layer in cache.keys + cache.values], torch.cat(states)

    alone = prefill([], [prompt])
    for others, parts in (
        ([PROMPTS[0], PROMPTS[2]], [prompt]),
        ([], [prompt[:16], prompt[16:]]),
        ([PROMPTS[1]], [prompt[:1], prompt[1:-1], prompt[-1:]]),
    ):
        cached, states = prefill(others, parts)
        assert all(torch.equal(a, b) for a, b in zip(alone[0], cached, strict=True))
        assert torch.equal(alone[1], states)


def test_prompts_that_arrive_together_are_prefilled_in_one_forward_with_their_own_bits(
    compiled_engine, monkeypatch
) -> None:
    """Batch.add_many: rows whose uncached rest is short share one prefill forward (a long one goes alone),
    each row's keys and values bitwise those it gets alone, and the outputs those of the target alone. A
    prefill that fails leaves none of the rows in the batch."""
    engine = compiled_engine
    step = feeding.COMPILED[engine.target]
    long_prompt = [(5 * i + 1) % 97 for i in range(40)]  # not in the prefix cache yet: 39 tokens to prefill
    assert len(long_prompt) - 1 > batch_module.JOINT_PREFILL_TOKENS >= max(len(p) for p in PROMPTS[:5:2])
    prompts = [PROMPTS[0], PROMPTS[2], long_prompt, PROMPTS[4]]

    def contexts(batch, rows):
        return [[layer[row.slot, :, : len(row.ids) - 1] for layer in batch.target_cache.keys] for row in rows]

    batch = engine.new_batch(4)
    calls = step.calls
    rows = batch.add_many([engine.request(p, max_new_tokens=8, speculative=False) for p in prompts])
    assert step.calls == calls + 2, "the three short prompts in one forward, the long one alone"
    singly = engine.new_batch(4)
    single_rows = [singly.add(engine.request(p, max_new_tokens=8, speculative=False)) for p in prompts]
    alone = [engine.generate(p, max_new_tokens=8, speculative=False).token_ids for p in prompts]
    for mine, theirs in zip(contexts(batch, rows), contexts(singly, single_rows), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    outputs = {}
    while len(batch):
        for row, chunk in batch.step():
            if chunk.output is not None:
                outputs[rows.index(row)] = chunk.output.token_ids
    assert [outputs[i] for i in range(len(prompts))] == alone

    def broken(*args, **kwargs):
        raise RuntimeError("the prefill failed")

    batch = engine.new_batch(4)
    monkeypatch.setattr(feeding, "feed", broken)
    with pytest.raises(RuntimeError, match="the prefill failed"):
        batch.add_many([engine.request(p, max_new_tokens=8) for p in prompts[:2]])
    assert len(batch) == 0 and batch.target_cache.num_rows == 0


def test_the_eager_invariant_path_agrees_on_what_is_exact() -> None:
    """The same model eager: exact too (the compiled step is not what makes it exact)."""
    model = llama(0, init=0.02, layers=2).to(torch.bfloat16)
    assert exact.make_exact(model).exact


def test_two_models_of_one_architecture_each_run_their_own_compiled_code(tmp_path, kernels) -> None:
    """A compiled step leaves the guards on the model's modules out (compiled.py, CompiledStep.rebuild), so
    code compiled for one model must never serve another: here two models alike in every input and
    cache shape but their MLP's width, so only those guards could have told them apart."""
    first = llama(0, init=0.02, layers=1).to(torch.bfloat16)
    config = first.config.to_dict() | {"intermediate_size": 3 * first.config.hidden_size}
    torch.manual_seed(1)
    second = LlamaForCausalLM(type(first.config)(**config)).to(torch.bfloat16).eval()
    prompt = [5, 17, 33, 8, 21]
    for model in (first, second):
        compiled.install(model, tmp_path)
    for model in (first, second, first):
        with torch.inference_mode():
            cache = kv.BatchCache.for_model(model)
            cache.add_row()
            feeding.feed(model, cache, [0], [prompt[:-1]])  # the prompt's prefill, compiled too
            step = feeding.feed(model, cache, [0], [prompt[-1:]], all_logits=True)[0, -1]  # a compiled step
            eager = model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(step.float(), eager.float(), atol=0.05, rtol=0.05)


def test_compiled_code_is_cached_in_the_data_directory_unless_the_user_chose_one(tmp_path, monkeypatch) -> None:
    """Inductor writes its default (/tmp/torchinductor_<user>) into TORCHINDUCTOR_CACHE_DIR as soon as the
    engine is imported; that value counts as unset, so the data directory's compile/ keeps the code. A
    directory the user chose stays."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    monkeypatch.setattr(compiled, "_CACHE_SET", [None])
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    compiled.use_cache_dir(tmp_path / "first")
    assert cache_dir() == str(tmp_path / "first")  # where inductor reads and writes its FX graph cache
    compiled.use_cache_dir(tmp_path / "second")  # another engine's data directory: ours to change
    assert cache_dir() == str(tmp_path / "second")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "chosen"))
    compiled.use_cache_dir(tmp_path / "third")
    assert cache_dir() == str(tmp_path / "chosen")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    compiled.use_cache_dir(tmp_path / "fourth")
    assert cache_dir() == str(tmp_path / "fourth")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_compiling_shows_a_bar_on_a_terminal_and_two_lines_elsewhere(terminal, monkeypatch, caplog) -> None:
    """Piped to a log file (a server under bench-serve, a container), the bar redrawn every second wrote a
    fragment a second onto one line for the minutes a first compile takes; there stderr gets whole lines, the
    start and the end, at any log level."""
    stderr = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    with caplog.at_level(logging.INFO, logger=compiled.__name__), compiled._progress():
        time.sleep(1.3)  # a tick of the bar
    assert [record.getMessage()[:29] for record in caplog.records] == ["compiled the decoding step in"]
    if terminal:
        assert "compiling the decoding step: 00:01" in stderr.getvalue()
    else:
        lines = stderr.getvalue().split("\n")
        assert "\r" not in stderr.getvalue() and len(lines) == 3 and lines[2] == ""
        assert lines[0].startswith("compiling the decoding step: minutes the first time")
        assert lines[1].startswith("compiled the decoding step in ") and lines[1].endswith(" s")


def test_cache_buffers_give_the_compiler_constant_heads_also_after_they_grow() -> None:
    """Only a buffer's rows and capacity vary between steps; its heads and head dimension are constants of
    the compiled step (kv._fixed_heads), for a buffer allocated and for one regrown with more rows and positions."""
    cache = kv.BatchCache(num_layers=2)
    like = torch.empty((1, 3, 0, 8))
    for layer in range(2):
        cache._allocate(layer, like)
    cache._reserve(rows=4, positions=300)
    for buffer in (*cache.keys, *cache.values):
        assert buffer is not None and buffer.shape == (4, 3, 512, 8)
        assert buffer._dynamo_static_indices == {1, 3}


def test_a_draft_on_the_kernel_still_trains(compiled_engine) -> None:
    """A draft on the compiled model's attention (compiled.use_kernel) gets its gradients from exact.attention's
    operators: the C++ kernel has no backward, and a forward through it would leave the layers before it untrained."""
    layer = compiled_engine.drafter.models()[0].layer
    query, key, value = (torch.randn(1, heads, 6, 16, requires_grad=True) for heads in (4, 2, 2))
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    out, _ = compiled._attention(layer.self_attn, query, key, value, mask, scaling=0.25)
    out.float().sum().backward()
    assert query.grad is not None and key.grad is not None and value.grad is not None
    assert query.grad.abs().sum() > 0 and value.grad.abs().sum() > 0


def test_the_heads_draft_forward_is_compiled_once_and_each_version_runs_its_own_weights(compiled_engine) -> None:
    """The head's draft forwards run compiled (compiled.draft_forward) with the version an argument of the code
    and no guards on modules: a version's weights must be the graph's inputs, read at each call. Baked in as
    constants, the first version compiled would draft for every later one (still lossless, but its acceptance
    would be the base head's). Each version's compiled states match its eager ones, and no version compiles
    again."""
    drafter = compiled_engine.drafter
    assert drafter._compiled is not None
    base = drafter.head
    hidden = base.config.hidden_size
    generator = torch.Generator().manual_seed(4)
    fuse = (torch.randn(hidden, 2 * hidden, generator=generator) / hidden**0.5).to(torch.bfloat16)
    other = base.with_weights(fuse, {})
    ids = [[5, 17, 33], [44, 9, 2]]
    states = [torch.randn(3, hidden, generator=generator).to(torch.bfloat16) for _ in ids]
    frames = torch._dynamo.utils.counters["frames"]["ok"]

    restricted = drafter.new_vocab()
    restricted.restrict(range(7, 100, 3))  # an adapter's vocabulary: the tokens its traffic used

    def fed(version, vocab, compiled_forward):
        cache = drafter.new_cache()
        slots = [cache.add_row(), cache.add_row()]
        saved, drafter._compiled = drafter._compiled, compiled_forward
        try:
            with torch.inference_mode():
                predicted, logits, picks = drafter._feed(version, vocab, cache, slots, ids, states)
                return predicted.float(), logits.float(), picks
        finally:
            drafter._compiled = saved

    compiled_forward = drafter._compiled
    outputs = {}
    versions = (("base", base), ("other", other), ("base again", base))
    for (name, version), vocab in itertools.product(versions, (drafter.vocab, restricted)):
        (compiled_states, logits, picks), (eager_states, eager_logits, _) = (
            fed(version, vocab, compiled_forward),
            fed(version, vocab, None),
        )
        assert (compiled_states - eager_states).abs().max() <= 0.05 * eager_states.abs().max(), name
        assert (logits - eager_logits).abs().max() <= 0.05 * eager_logits.abs().max(), name
        assert logits.shape[-1] == (len(restricted.ids) if vocab is restricted else vocab.full_size)
        assert torch.equal(picks, logits.argmax(-1)), name  # each pick is its row's argmax of the logits returned
        outputs[name] = compiled_states
    assert (outputs["base"] - outputs["other"]).abs().max() > 0.5 * outputs["base"].abs().max()
    assert torch.equal(outputs["base"], outputs["base again"])
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames, "a head version or vocabulary compiled again"


def test_draft_trees_through_the_compiled_head_equal_the_compiled_target_alone(compiled_engine) -> None:
    """Trees feed the compiled head each depth's nodes with a tree mask (kv.TreeFeed): greedy output, alone and
    in a batch, is still the target's, and the trees were drafted by the compiled code (no new graph)."""
    engine = compiled_engine
    baseline = [
        engine.generate(p, max_new_tokens=b, speculative=False).token_ids for p, b in zip(PROMPTS, BUDGETS, strict=True)
    ]
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    drafter, siblings = engine.drafter, []
    compiled_forward = drafter._compiled

    def counted(head, ids, features, positions, *args):  # a tree's depth feeds siblings at one position
        siblings.append(any(len(set(row)) < len(row) for row in positions.tolist()))
        return compiled_forward(head, ids, features, positions, *args)

    saved, engine.policy.tree_budget, drafter._compiled = engine.policy.tree_budget, 12, counted
    try:
        outputs = engine.generate_batch(PROMPTS, max_new_tokens=max(BUDGETS), max_batch=3, k=3)
        alone = engine.generate(PROMPTS[0], max_new_tokens=BUDGETS[0], k=3)
    finally:
        engine.policy.tree_budget, drafter._compiled = saved, compiled_forward
    for i, (out, budget) in enumerate(zip(outputs, BUDGETS, strict=True)):
        assert out.token_ids[:budget] == baseline[i], f"prompt {i} batched"
    assert alone.token_ids == baseline[0]
    assert sum(out.stats.drafted for out in outputs) > 0
    assert any(siblings), "no depth of a tree went through the compiled head"
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames, "a tree's feed compiled the head again"


def test_an_eagle3_head_drafts_through_the_compiled_step_and_rows_equal_the_compiled_target_alone(
    tmp_path, kernels
) -> None:
    """The EAGLE-3 head (drafters/eagle3.py) goes through the head's compiled draft step: its own final norm and
    LM head are inputs of the same graph as the project's head's (head.py `_head_step`)."""
    torch._dynamo.reset()
    model = llama(0, init=0.02, layers=2).to(torch.bfloat16)
    engine = Engine(model, "eagle3", compile=True, compile_dir=tmp_path / "compile")
    assert engine.path == "compiled" and engine.drafter._compiled is not None
    baseline = [
        engine.generate(p, max_new_tokens=b, speculative=False).token_ids for p, b in zip(PROMPTS, BUDGETS, strict=True)
    ]
    outputs = engine.generate_batch(PROMPTS, max_new_tokens=max(BUDGETS), max_batch=3, k=3)
    for i, (out, budget) in enumerate(zip(outputs, BUDGETS, strict=True)):
        assert out.token_ids[:budget] == baseline[i], f"prompt {i} batched"
    assert sum(out.stats.drafted for out in outputs) > 0
