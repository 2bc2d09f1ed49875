"""Continuous batching (`adaptive_spec.decoding.batch.Batch`): every row of a batch decodes exactly as it would
alone, whatever else shares the batch, on tiny random Llama models (`tiny.py`).

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_batch.py -q   (CPU, about a minute)

What must hold, row by row:

- greedy output equals the target alone for that prompt, for every draft kind, several k and batch
  sizes, with rows of different prompt lengths and budgets that join and leave mid-flight, stop on
  EOS or a stop string, or are removed (a client gone);
- after steps where rows accepted different numbers of tokens, each row's target and draft caches
  give the logits a fresh prefill of its context gives;
- under sampling each row follows the target's distribution with other rows in the batch, and a
  seeded row gives the same tokens whatever shares its batch;
- an adapter swap between two steps changes no row's greedy output.
"""

from __future__ import annotations

import copy

import pytest
import torch
from faults import fails_after
from tiny import VOCAB, llama, tiny_draft, tiny_target

from adaptive_spec import Engine
from adaptive_spec.cache import feeding, kv
from adaptive_spec.decoding import batch as batch_module
from adaptive_spec.decoding.row import Row
from adaptive_spec.outputs.constraints import Constraints

pytestmark = pytest.mark.usefixtures("one_thread")

# Prompts of different lengths (1 to 23 tokens), some with repeats for prompt lookup to copy.
PROMPTS = [
    [5, 17, 33, 8, 5, 17, 33, 8, 5, 17],
    [44],
    [3, 9, 27, 81 % VOCAB, 3, 9],
    list(range(20, 43)),
    [7, 7, 7, 7, 2],
    [90, 12, 64, 90, 12],
    [1, 2],
    [60, 61, 62, 63, 64, 65, 60, 61, 62],
]
BUDGETS = [24, 9, 31, 16, 5, 27, 20, 12]  # a different max_new_tokens per prompt
ARRIVALS = [0, 0, 1, 3, 4, 4, 9, 15]  # the step at which each prompt joins (staggered)
DRAFT_KINDS = [
    "early-exit:1",
    "early-exit:3",
    "head",
    "eagle3",
    "ngram",
    "ngram+head",
    "ngram+eagle3",
    "ngram+early-exit:2",
    "separate-model",
    "target-itself",
]

_targets: dict[int, torch.nn.Module] = {}
_alone: dict[tuple, list[int]] = {}


def target(seed: int = 0) -> torch.nn.Module:
    if seed not in _targets:
        _targets[seed] = tiny_target(seed)
    return _targets[seed]


def alone(seed: int, prompt: list[int], max_new_tokens: int, eos=None, tokenizer=None, stop=None) -> list[int]:
    """The target alone, greedy, in a batch of its own: what every batched row must reproduce."""
    key = (seed, tuple(prompt), max_new_tokens, eos, stop)
    if key not in _alone:
        engine = Engine(target(seed), None, tokenizer, eos_token_id=eos)
        _alone[key] = engine.generate(prompt, max_new_tokens=max_new_tokens, stop=stop, speculative=False).token_ids
    return _alone[key]


def make_draft(kind: str, model: torch.nn.Module):
    if kind == "separate-model":
        return tiny_draft()
    if kind == "target-itself":
        return model
    return kind


def run_schedule(engine: Engine, requests: list, arrivals: list[int], max_batch: int, on_step=None) -> list:
    """Decode `requests`, request i joining at step `arrivals[i]` or as soon as a row is free after
    it. Returns each request's output in order. `on_step(batch, step)` runs after every step."""
    batch = engine.new_batch(max_batch)
    outputs, index, waiting, step = [None] * len(requests), {}, list(range(len(requests))), 0
    while waiting or len(batch):
        while waiting and not batch.full and arrivals[waiting[0]] <= step:
            i = waiting.pop(0)
            index[batch.add(requests[i])] = i
        for row, chunk in batch.step():
            if chunk.output is not None:
                outputs[index.pop(row)] = chunk.output
        if on_step is not None:
            on_step(batch, step)
        step += 1
    return outputs


def first_difference(a: list[int], b: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"first difference at {i}: batched {a[i : i + 5]} vs alone {b[i : i + 5]}"


# =================================================================================================
# Greedy equality, row by row
# =================================================================================================


@pytest.mark.parametrize("max_batch", [2, 4, 8])
@pytest.mark.parametrize("k", [1, 3, None])
@pytest.mark.parametrize("kind", DRAFT_KINDS)
def test_batched_greedy_rows_equal_the_target_alone(kind: str, k, max_batch: int) -> None:
    model = target(0)
    engine = Engine(model, make_draft(kind, model))
    requests = [engine.request(p, max_new_tokens=b, k=k) for p, b in zip(PROMPTS, BUDGETS, strict=True)]
    sizes = []
    outputs = run_schedule(engine, requests, ARRIVALS, max_batch, on_step=lambda batch, _: sizes.append(len(batch)))
    mismatches = [
        f"prompt {i}: {first_difference(out.token_ids, alone(0, p, b))}"
        for i, (out, p, b) in enumerate(zip(outputs, PROMPTS, BUDGETS, strict=True))
        if out.token_ids != alone(0, p, b)
    ]
    assert not mismatches, "\n".join(mismatches)
    assert all(
        out.finish_reason == "length" and len(out.token_ids) == b for out, b in zip(outputs, BUDGETS, strict=True)
    )
    assert max(sizes) == min(max_batch, len(PROMPTS)) or max_batch > 4  # rows really shared steps
    assert sum(out.stats.drafted for out in outputs) > 0, "nothing was drafted: nothing speculative was tested"
    if kind == "target-itself":
        assert all(out.stats.accepted == out.stats.drafted for out in outputs)


@pytest.mark.parametrize("seed", [1, 2])
def test_every_row_of_a_full_batch_equals_the_target_alone_on_other_models(seed: int) -> None:
    model = target(seed)
    for draft in ["early-exit:2", tiny_draft(seed + 50, layers=2)]:
        engine = Engine(model, draft)
        outputs = engine.generate_batch(PROMPTS, max_new_tokens=20, max_batch=8, k=2)
        for out, prompt in zip(outputs, PROMPTS, strict=True):
            assert out.token_ids == alone(seed, prompt, 20), first_difference(out.token_ids, alone(seed, prompt, 20))


def test_eos_per_row_leaves_the_batch_and_the_others_go_on() -> None:
    model = target(0)
    # Each row's EOS is a token its own plain output reaches early: rows stop at different steps.
    eos = {alone(0, p, 24)[3] for p in PROMPTS[:4]}
    engine = Engine(model, model, eos_token_id=list(eos))
    outputs = engine.generate_batch(PROMPTS[:4], max_new_tokens=24, max_batch=4, k=3)
    for out, prompt in zip(outputs, PROMPTS[:4], strict=True):
        expected = alone(0, prompt, 24, eos=tuple(eos))
        assert out.token_ids == expected
        assert out.finish_reason == ("stop" if expected[-1] in eos else "length")
    assert sum(out.finish_reason == "stop" for out in outputs) >= 2


class CharTokenizer:
    """Token t decodes to `<t>`: stop strings become easy to place on token boundaries or inside."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(f"<{t}>" for t in ids)


def test_stop_strings_per_row() -> None:
    model = target(0)
    tokenizer = CharTokenizer()
    engine = Engine(model, "early-exit:3", tokenizer)
    stops, requests = [], []
    for i, prompt in enumerate(PROMPTS[:6]):
        plain = alone(0, prompt, 24)
        # Even rows stop inside their output (a stop string spanning two tokens' text); odd rows'
        # stop string never appears, so they run their whole budget.
        stop = f"{plain[4]}><{plain[5]}" if i % 2 == 0 else "<999>"
        stops.append(stop)
        requests.append(engine.request(prompt, max_new_tokens=24, k=3, stop=stop))
    outputs = run_schedule(engine, requests, [0, 0, 1, 2, 2, 5], max_batch=3)
    for i, (out, prompt, stop) in enumerate(zip(outputs, PROMPTS, stops, strict=False)):
        expected = alone(0, prompt, 24, tokenizer=tokenizer, stop=stop)
        assert out.token_ids == expected
        assert stop not in out.text
        assert out.finish_reason == ("stop" if i % 2 == 0 else "length")


def test_a_row_removed_mid_flight_leaves_the_others_untouched() -> None:
    model = target(0)
    engine = Engine(model, "early-exit:3")
    batch = engine.new_batch(4)
    rows = [batch.add(engine.request(p, max_new_tokens=24, k=2)) for p in PROMPTS[:4]]
    outputs: dict[int, list[int]] = {}
    step = 0
    while len(batch):
        if step == 3:  # a client goes away: its row leaves between two steps, from the middle
            batch.remove(rows[1])
            assert rows[1] not in batch.rows and len(batch) == 3
        for row, chunk in batch.step():
            if chunk.output is not None:
                outputs[rows.index(row)] = chunk.output.token_ids
        step += 1
    assert sorted(outputs) == [0, 2, 3]
    for i in outputs:
        assert outputs[i] == alone(0, PROMPTS[i], 24)


# =================================================================================================
# Per-row cache rollback
# =================================================================================================


@torch.inference_mode()
def assert_row_matches_fresh_prefill(model, cache: kv.BatchCache, row: Row, what: str) -> None:
    cached = cache.lengths[row.slot]
    assert cached <= len(row.ids) - 1, f"{what}: {cached} cached positions for a context of {len(row.ids)}"
    fresh = model(input_ids=torch.tensor([row.ids])).logits[0, cached:]  # [tail, vocab]
    continued = feeding.feed(model, copy.deepcopy(cache), [row.slot], [row.ids[cached:]], all_logits=True)[0]
    # Float rounding moves logits by ~1e-5 (other matmul shapes; CI once saw 1.4e-5 on a logit of 0.009);
    # a wrong or stale cache entry moves them by more than 0.1.
    torch.testing.assert_close(continued, fresh, atol=1e-4, rtol=1e-4, msg=lambda m: f"{what} of row {row.slot}: {m}")


def noisy_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A separate draft that agrees with the target often but not always: its LM head plus noise."""
    draft = copy.deepcopy(model)
    torch.manual_seed(5)
    with torch.no_grad():
        draft.lm_head.weight.add_(0.6 * torch.randn_like(draft.lm_head.weight))
    return draft


@pytest.mark.parametrize("draft", ["early-exit:3", "noisy-copy"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_each_rows_caches_equal_a_fresh_prefill_after_every_step(draft: str, temperature: float) -> None:
    model = target(0)
    engine = Engine(model, noisy_copy(model) if draft == "noisy-copy" else draft)
    draft_model = engine.drafter.model
    batch = engine.new_batch(4)
    for i, prompt in enumerate(PROMPTS[:4]):
        batch.add(engine.request(prompt, max_new_tokens=30, temperature=temperature, seed=i, k=3))
    differing_steps = 0
    while len(batch):
        before = {row: row.stats.accepted for row in batch.rows}
        results = batch.step()
        differing_steps += len({row.stats.accepted - before[row] for row, _ in results}) > 1
        for row in batch.rows:
            assert batch.target_cache.lengths[row.slot] == len(row.ids) - 1
            assert_row_matches_fresh_prefill(model, batch.target_cache, row, "target cache")
            assert_row_matches_fresh_prefill(draft_model, batch.draft_cache, row, "draft cache")
    assert differing_steps > 0, "the rows never accepted different numbers of tokens in one step"


# =================================================================================================
# Sampling
# =================================================================================================

CHI2_CRITICAL_DF7 = 24.322  # upper 0.1% point, 7 degrees of freedom (8 cells)
SMALL_VOCAB = 8
TRIALS = 1500


@torch.inference_mode()
def test_each_row_samples_from_the_target_with_others_in_the_batch() -> None:
    # 4 rows per batch, each its own prompt, seed and temperature, with a draft that disagrees
    # strongly (the target's logits x -3). Each row's first emitted token (accepted draft or
    # recovered token) must follow its own target distribution.
    small = llama(seed=7, vocab=SMALL_VOCAB, layers=2)
    contrary = copy.deepcopy(small)
    contrary.lm_head.weight.mul_(-3.0)
    prompts, temperatures = [[3], [5, 1], [0, 6, 2], [4]], [1.0, 0.7, 1.3, 1.0]
    expected = [
        (small(input_ids=torch.tensor([p])).logits[0, -1] / t).softmax(-1)
        for p, t in zip(prompts, temperatures, strict=True)
    ]
    engine = Engine(small, contrary, k=1)
    counts = torch.zeros(len(prompts), SMALL_VOCAB)
    for trial in range(TRIALS):
        requests = [
            engine.request(p, max_new_tokens=1 + 1, temperature=t, seed=trial * 4 + i)
            for i, (p, t) in enumerate(zip(prompts, temperatures, strict=True))
        ]
        for i, out in enumerate(engine_batch_outputs(engine, requests)):
            assert out.stats.drafted == 1
            counts[i, out.token_ids[0]] += 1
    for i in range(len(prompts)):
        e = expected[i].double() * TRIALS
        assert e.min() >= 5
        chi2 = float(((counts[i].double() - e) ** 2 / e).sum())
        assert chi2 < CHI2_CRITICAL_DF7, (i, chi2, counts[i], expected[i])


def engine_batch_outputs(engine: Engine, requests: list) -> list:
    return run_schedule(engine, requests, [0] * len(requests), max_batch=len(requests))


def test_a_seeded_row_gives_the_same_tokens_whatever_shares_its_batch() -> None:
    model = target(0)
    engine = Engine(model, "early-exit:3")
    options = dict(max_new_tokens=24, temperature=1.0, top_p=0.9, seed=11)
    alone_out = engine.generate(PROMPTS[0], **options).token_ids
    for companions in ([], PROMPTS[1:3], PROMPTS[3:8]):
        requests = [engine.request(PROMPTS[0], **options)]
        requests += [engine.request(p, max_new_tokens=20, temperature=1.0, seed=j) for j, p in enumerate(companions)]
        outputs = run_schedule(engine, requests, [0] + [j % 3 for j in range(len(companions))], max_batch=4)
        assert outputs[0].token_ids == alone_out, len(companions)


def test_greedy_and_sampled_rows_share_a_batch() -> None:
    model = target(1)
    engine = Engine(model, "ngram")
    requests = [
        engine.request(PROMPTS[0], max_new_tokens=20, k=3),
        engine.request(PROMPTS[1], max_new_tokens=20, temperature=1.0, seed=3, k=3),
        engine.request(PROMPTS[2], max_new_tokens=20, speculative=False),
    ]
    outputs = run_schedule(engine, requests, [0, 0, 0], max_batch=3)
    assert outputs[0].token_ids == alone(1, PROMPTS[0], 20)
    assert outputs[2].token_ids == alone(1, PROMPTS[2], 20) and outputs[2].stats.drafted == 0
    sampled_alone = engine.generate(PROMPTS[1], max_new_tokens=20, temperature=1.0, seed=3, k=3)
    assert outputs[1].token_ids == sampled_alone.token_ids


@pytest.mark.parametrize("kind", ["early-exit:1", "head"])
def test_a_draft_whose_weights_give_nan_probabilities_leaves_each_row_the_targets_exact_output(kind: str) -> None:
    """A draft with a NaN weight (say an adapter that slipped past the checks): its probabilities are
    NaN, and torch.multinomial raised on them, failing every row of the step. Each row instead drafts
    nothing (`DraftVocab.choose`) and decodes with the target alone, greedy and sampled, in one batch."""
    engine = Engine(copy.deepcopy(target(0)), kind)  # the head shares the target's modules: a copy to poison
    draft = engine.drafter.head if kind == "head" else engine.drafter.model.model.layers[0]
    with torch.no_grad():
        next(draft.parameters()).fill_(float("nan"))
    plain = Engine(target(0), None)
    options = [
        dict(max_new_tokens=20),
        dict(max_new_tokens=16, temperature=1.0, seed=3),
        dict(max_new_tokens=12, temperature=0.7, top_p=0.9, seed=5),
        dict(max_new_tokens=20, k=3),
    ]
    requests = [engine.request(prompt, **kwargs) for prompt, kwargs in zip(PROMPTS, options, strict=False)]
    outputs = run_schedule(engine, requests, [0, 0, 1, 2], max_batch=4)
    for prompt, kwargs, out in zip(PROMPTS, options, outputs, strict=False):
        kwargs = {key: value for key, value in kwargs.items() if key != "k"}
        expected = plain.generate(prompt, speculative=False, **kwargs).token_ids
        assert out.token_ids == expected, first_difference(out.token_ids, expected)
        assert out.stats.drafted == 0 and out.stats.accepted == 0


# =================================================================================================
# Bounds
# =================================================================================================


def test_requests_that_fail_to_join_leave_no_row_behind(monkeypatch) -> None:
    """Batch.add_many: when one of the requests arriving together fails before the prompts are prefilled
    (here its constraints cannot be built), none of them stays in the batch (a row that joined but was
    never prefilled would decode from an empty cache), and the row already decoding goes on as alone."""
    engine = Engine(target(0), "head")
    batch = engine.new_batch(4)
    running = batch.add(engine.request(PROMPTS[0], max_new_tokens=BUDGETS[0]))
    batch.step()

    monkeypatch.setattr(batch_module, "Constraints", fails_after(0, Constraints, "constraints could not be built")[0])
    arriving = [engine.request(p, max_new_tokens=4) for p in PROMPTS[1:3]]
    arriving.append(engine.request(PROMPTS[3], max_new_tokens=4, presence_penalty=0.5))
    with pytest.raises(RuntimeError, match="constraints could not be built"):
        batch.add_many(arriving)
    monkeypatch.undo()
    _only_the_running_row_goes_on_as_alone(batch, running)


def test_a_group_whose_copy_fails_to_join_leaves_no_row_behind(monkeypatch) -> None:
    """Batch.add_group (OpenAI's n): when a copy of the first row fails to join, the whole group leaves,
    the first row too; the row already decoding goes on as alone."""
    engine = Engine(target(0), "head")
    batch = engine.new_batch(4)
    running = batch.add(engine.request(PROMPTS[0], max_new_tokens=BUDGETS[0]))
    batch.step()
    second_fails, built = fails_after(1, Constraints, "constraints could not be built")
    monkeypatch.setattr(batch_module, "Constraints", second_fails)
    with pytest.raises(RuntimeError, match="constraints could not be built"):
        batch.add_group(engine.requests(PROMPTS[3], 3, max_new_tokens=4, presence_penalty=0.5))
    assert built
    monkeypatch.undo()
    _only_the_running_row_goes_on_as_alone(batch, running)


def _only_the_running_row_goes_on_as_alone(batch, running: Row) -> None:
    """The batch holds `running` alone (PROMPTS[0]), in its caches too, and decodes it to the target alone's output."""
    assert batch.rows == [running] and len(batch) == 1
    assert batch.target_cache.num_rows == 1 and batch.draft_cache.num_rows == 1
    out = None
    while out is None:
        out = next((chunk.output for row, chunk in batch.step() if chunk.output is not None), None)
    assert out.token_ids == alone(0, PROMPTS[0], max_new_tokens=BUDGETS[0])


def test_a_full_batch_refuses_another_row_and_memory_follows_the_rows(monkeypatch) -> None:
    monkeypatch.setattr(kv, "GROW", 64)
    engine = Engine(target(0), "early-exit:1")
    batch = engine.new_batch(2)
    for prompt in PROMPTS[:2]:
        batch.add(engine.request(prompt, max_new_tokens=4))
    with pytest.raises(RuntimeError, match="full"):
        batch.add(engine.request(PROMPTS[2], max_new_tokens=4))
    with pytest.raises(ValueError, match="at least one row"):
        engine.new_batch(0)
    batch.step()
    # Per row and position: 2 (keys, values) x 4 layers x 2 KV heads x 16 dims x 4 bytes, for 2
    # rows of kv.GROW positions: capacity grows with the longest row, in steps of GROW.
    per_position = 2 * 4 * 2 * 16 * 4
    assert batch.target_cache.nbytes() == 2 * kv.GROW * per_position
    batch.remove(batch.rows[0])
    batch.add(engine.request(list(range(1, 101)), max_new_tokens=4))  # 100 tokens: past the first 64 positions
    assert batch.target_cache.nbytes() == 2 * 2 * kv.GROW * per_position


# =================================================================================================
# Adapter swaps
# =================================================================================================


def test_an_adapter_swap_mid_batch_changes_no_rows_greedy_output(tmp_path) -> None:
    from adapter_files import make_adapter  # the adapter files the trainer writes, on an early exit

    model = target(1)
    make_adapter(model, 2, tmp_path / "v1", seed=2)
    make_adapter(model, 2, tmp_path / "v2", seed=3)
    engine = Engine(model, "early-exit:2")
    requests = [engine.request(p, max_new_tokens=b, k=3) for p, b in zip(PROMPTS, BUDGETS, strict=True)]
    swaps = []

    def swap_now_and_then(batch, step: int) -> None:
        if step in (2, 6, 11):  # between two steps of every row then in the batch
            version = 1 + len(swaps) % 2
            engine.load_adapter(tmp_path / f"v{version}", str(version))
            swaps.append(len(batch))

    outputs = run_schedule(engine, requests, ARRIVALS, max_batch=4, on_step=swap_now_and_then)
    assert len(swaps) == 3 and min(swaps) >= 2, swaps  # each swap hit a batch of several rows
    for out, prompt, budget in zip(outputs, PROMPTS, BUDGETS, strict=True):
        assert out.token_ids == alone(1, prompt, budget), first_difference(out.token_ids, alone(1, prompt, budget))
    assert {out.stats.adapter_version for out in outputs} <= {"1", "2"}
    assert sum(out.stats.drafted for out in outputs) > 0
