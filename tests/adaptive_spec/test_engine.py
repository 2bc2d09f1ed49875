"""Correctness tests for the speculative-decoding engine (`adaptive_spec.engine.Engine`) on tiny random
Llama models built in code (`tiny.py`, STYLE.md §8).

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_engine.py -q -p no:cacheprovider --import-mode=importlib
(CPU, about 30 s; the greedy matrix and the sampling distribution test are most of it).

What must hold:

- greedy speculative output equals plain decoding token for token, for every draft kind and every k
  (STYLE.md §7), including a draft that is always wrong and the target drafting for itself;
- after any step, both KV caches hold exactly the accepted context, as a fresh prefill would;
- under sampling the first and second emitted tokens follow the target's distribution, even with
  a draft that disagrees strongly, and a seed makes a generation reproducible;
- stop conditions, the statistics, the per-position trace and streaming agree with each other;
- bad requests and bad drafts fail early with an error that says what is wrong.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from tiny import MAX_POSITIONS, TARGET_LAYERS, VOCAB, llama, mismatched_draft, tiny_draft, tiny_target

from adaptive_spec import Engine, InputError
from adaptive_spec.cache import feeding
from adaptive_spec.drafters import Drafter, Proposal
from adaptive_spec.drafters.early_exit import DraftSpecError
from adaptive_spec.drafters.model import ModelDrafter

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 40
PROMPTS = {
    "repeating": [5, 17, 33, 8, 5, 17, 33, 8, 5, 17],  # prompt lookup has something to copy at once
    "one-token": [44],  # nothing to prefill: the first step feeds the whole prompt
}
KS = [1, 2, 3, 5, None]  # None: DynamicK chooses per step
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
_baselines: dict[tuple[int, tuple[int, ...], int], list[int]] = {}


def target(seed: int = 0) -> torch.nn.Module:
    """One random target per seed, shared by the module so that each baseline is decoded once."""
    if seed not in _targets:
        _targets[seed] = tiny_target(seed)
    return _targets[seed]


def baseline(seed: int, prompt: list[int], max_new_tokens: int = NEW_TOKENS) -> list[int]:
    """The target alone, greedy: what every speculative configuration must reproduce."""
    key = (seed, tuple(prompt), max_new_tokens)
    if key not in _baselines:
        out = Engine(target(seed), None).generate(prompt, max_new_tokens=max_new_tokens, speculative=False)
        assert out.stats.drafted == 0 and out.stats.target_forwards == len(out.token_ids)
        _baselines[key] = out.token_ids
    return _baselines[key]


def make_draft(kind: str, model: torch.nn.Module):
    """What `Engine(model, draft)` takes for each of DRAFT_KINDS: a spec string or a model."""
    if kind == "separate-model":
        return tiny_draft()
    if kind == "target-itself":
        return model
    return kind


def first_difference(a: list[int], b: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"first difference at {i}: speculative {a[i : i + 5]} vs plain {b[i : i + 5]}"


class AlwaysWrongDrafter(Drafter):
    """Proposes, first, a token the target is guaranteed not to pick: its greedy token plus one.

    A Drafter with no cache and no other hook: each `propose` runs the target on each row's whole
    context. The tokens after the first are arbitrary, since nothing after a rejection counts.
    """

    name = "always-wrong"

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.vocab = model.config.vocab_size

    @torch.inference_mode()
    def propose(self, cache, rows, ks: list[int], free=None, depths=None) -> list[Proposal]:
        proposals = []
        for row, k in zip(rows, ks, strict=True):
            greedy = int(self.model(input_ids=torch.tensor([row.ids])).logits[0, -1].argmax())
            wrong = (greedy + 1) % self.vocab
            proposals.append(Proposal(torch.full((k,), wrong, dtype=torch.long), None, forwards=1 if k else 0))
        return proposals


# =================================================================================================
# Greedy equivalence (STYLE.md §7)
# =================================================================================================


@pytest.mark.parametrize("kind", DRAFT_KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_speculative_output_equals_plain_decoding(seed: int, kind: str) -> None:
    model = target(seed)
    engine = Engine(model, make_draft(kind, model))  # one engine for every k and prompt: no state may leak
    mismatches = []
    drafted = accepted = 0
    for k in KS:
        for name, prompt in PROMPTS.items():
            out = engine.generate(prompt, max_new_tokens=NEW_TOKENS, k=k)
            expected = baseline(seed, prompt)
            drafted += out.stats.drafted
            accepted += out.stats.accepted
            if out.token_ids != expected:
                mismatches.append(f"k={k} prompt={name}: {first_difference(out.token_ids, expected)}")
            assert out.finish_reason == "length"
    assert not mismatches, "\n".join(mismatches)
    assert drafted > 0, "the draft never drafted, so nothing speculative was tested"
    if kind == "target-itself":
        assert accepted == drafted


@pytest.mark.parametrize("k", [1, 3])
def test_a_draft_that_is_always_wrong_changes_nothing(k: int) -> None:
    model = target(0)
    prompt = PROMPTS["repeating"]
    out = Engine(model, AlwaysWrongDrafter(model)).generate(prompt, max_new_tokens=NEW_TOKENS, k=k)
    assert out.token_ids == baseline(0, prompt), first_difference(out.token_ids, baseline(0, prompt))
    assert out.stats.drafted > 0
    assert out.stats.acceptance_rate == 0.0
    assert out.stats.mean_acceptance_length == 1.0
    assert not any(out.accepted)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_the_target_drafting_for_itself_accepts_everything(k: int) -> None:
    model = target(1)
    new_tokens = 24  # a multiple of k + 1 for every k here, so no step is cut short by the budget
    out = Engine(model, model, eos_token_id=[]).generate(PROMPTS["repeating"], max_new_tokens=new_tokens, k=k)
    assert out.token_ids == baseline(1, PROMPTS["repeating"], new_tokens)
    assert out.stats.acceptance_rate == 1.0
    assert out.stats.mean_acceptance_length == k + 1
    assert out.stats.target_forwards == new_tokens // (k + 1)
    assert out.stats.accepted_per_pos == [new_tokens // (k + 1)] * k


def test_greedy_equivalence_up_to_the_context_limit() -> None:
    # 250 prompt tokens leave 6 positions of the 256: k must shrink so no verification runs past
    # them, and the output must end there with "length", as plain decoding does.
    model = target(2)
    prompt = (PROMPTS["repeating"] * 25)[:250]
    plain = Engine(model, None).generate(prompt, max_new_tokens=NEW_TOKENS, speculative=False)
    for draft in ["ngram", "early-exit:3", model]:
        out = Engine(model, draft).generate(prompt, max_new_tokens=NEW_TOKENS, k=5)
        assert out.token_ids == plain.token_ids
        assert len(out.token_ids) == MAX_POSITIONS - len(prompt)
        assert out.finish_reason == plain.finish_reason == "length"


# =================================================================================================
# KV-cache rollback
# =================================================================================================


@torch.inference_mode()
def assert_cache_matches_fresh_prefill(model, cache, row: int, context: list[int], what: str) -> None:
    """Row `row` of a copy of `cache`, continued with the uncached tail of `context`, must give the
    logits a forward over the whole context gives, at every tail position."""
    cached = cache.lengths[row]
    assert cached <= len(context) - 1, f"{what}: the cache holds {cached} positions for a context of {len(context)}"
    fresh = model(input_ids=torch.tensor([context])).logits[0, cached:]  # [tail, vocab]
    continued = feeding.feed(model, copy.deepcopy(cache), [row], [context[cached:]], all_logits=True)[0]
    torch.testing.assert_close(continued, fresh, atol=1e-5, rtol=0, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize(("temperature", "k"), [(0.0, 4), (1.0, 4), (1.0, None)])
def test_both_caches_equal_a_fresh_prefill_after_every_step(temperature: float, k: int | None) -> None:
    model = target(0)
    engine = Engine(model, "early-exit:3")
    prompt = PROMPTS["repeating"]
    context = list(prompt)
    batch = engine.new_batch(1)
    batch.add(engine.request(prompt, max_new_tokens=NEW_TOKENS, temperature=temperature, seed=3, k=k))
    chunk = None
    while len(batch):
        [(_, chunk)] = batch.step()
        context += chunk.token_ids
        if chunk.output is not None:
            break
        # The target cache holds every context token but the pending last one, exactly.
        assert batch.target_cache.lengths[0] == len(context) - 1
        assert_cache_matches_fresh_prefill(model, batch.target_cache, 0, context, "target cache")
        assert_cache_matches_fresh_prefill(engine.drafter.model, batch.draft_cache, 0, context, "draft cache")
    out = chunk.output
    assert context == prompt + out.token_ids
    # The scenario must have exercised rollbacks: steps that rejected their first draft (the
    # target crops k positions), and steps that rejected one in the middle (it crops fewer).
    assert out.stats.drafted > out.stats.accepted > 0
    rejected_first = [
        i
        for i, (p, a) in enumerate(zip(out.proposed, out.accepted, strict=True))
        if p != -1 and not a and (i == 0 or not out.accepted[i - 1])
    ]
    rejected_later = [
        i
        for i, (p, a) in enumerate(zip(out.proposed, out.accepted, strict=True))
        if p != -1 and not a and i > 0 and out.accepted[i - 1]
    ]
    assert rejected_first and rejected_later, (out.proposed, out.accepted)
    if temperature == 0.0:
        assert out.token_ids == baseline(0, prompt)


def test_separate_draft_cache_equals_a_fresh_prefill_after_every_step() -> None:
    model = target(1)
    engine = Engine(model, tiny_draft(layers=2))
    assert isinstance(engine.drafter, ModelDrafter)
    prompt = PROMPTS["repeating"]
    context = list(prompt)
    batch = engine.new_batch(1)
    batch.add(engine.request(prompt, max_new_tokens=NEW_TOKENS, k=3))
    while len(batch):
        [(_, chunk)] = batch.step()
        context += chunk.token_ids
        if chunk.output is None:
            assert_cache_matches_fresh_prefill(
                engine.drafter.model, batch.draft_cache, 0, context, "separate draft cache"
            )
    assert chunk.output.stats.drafted > chunk.output.stats.accepted  # rejections happened


# =================================================================================================
# Sampling
# =================================================================================================


def test_sampling_is_reproducible_with_a_seed() -> None:
    model = target(0)
    engine = Engine(model, "early-exit:3")
    prompt = PROMPTS["repeating"]
    for options in [dict(temperature=1.0), dict(temperature=0.8, top_k=20, top_p=0.9)]:
        runs = {
            seed: [
                engine.generate(prompt, max_new_tokens=NEW_TOKENS, seed=seed, k=3, **options).token_ids
                for _ in range(2)
            ]
            for seed in (1, 2)
        }
        assert runs[1][0] == runs[1][1] and runs[2][0] == runs[2][1]
        assert runs[1][0] != runs[2][0]
        streamed = [
            t for c in engine.stream(prompt, max_new_tokens=NEW_TOKENS, seed=1, k=3, **options) for t in c.token_ids
        ]
        assert streamed == runs[1][0]
    plain = [
        engine.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=5, speculative=False).token_ids
        for _ in range(2)
    ]
    assert plain[0] == plain[1]


def test_at_dynamic_k_only_a_streamed_request_starts_with_the_targets_step_alone() -> None:
    """Time to first token: a stream's first token is the target's alone, as soon as plain decoding would
    give it. `generate`, read whole, drafts from its first step: a step saved, the same tokens."""
    engine = Engine(target(0), target(0))  # the target drafting for itself: every draft accepted
    engine.policy.new_draft(0.99)
    prompt = PROMPTS["repeating"]
    first = next(engine.stream(prompt, NEW_TOKENS))
    assert len(first.token_ids) == 1
    whole = engine.generate(prompt, NEW_TOKENS)
    assert whole.proposed[0] != -1 and whole.accepted[0]
    streamed = list(engine.stream(prompt, NEW_TOKENS))[-1].output
    assert streamed.proposed[0] == -1 and streamed.token_ids == whole.token_ids
    assert whole.stats.target_forwards < streamed.stats.target_forwards
    assert engine.request(prompt).streamed and not engine.request(prompt, streamed=False).streamed


def test_a_heads_step_after_accepted_drafts_is_billed_as_a_draft_step_and_a_catch_up_is_not() -> None:
    """A head keeps only the target's states, so it feeds the tokens its row's last step emitted again: 4 after 3
    drafts were accepted is its normal step. More than the last step emitted (+1) is context it skipped."""
    engine = Engine(target(0), "early-exit:1")
    batch = engine.new_batch(1)
    batch.add(engine.request(PROMPTS["repeating"], NEW_TOKENS))
    batch.rows[0].emitted_last = 4
    for fed, billed in ((4, True), (5, True), (6, False)):
        engine.policy.new_draft(None)
        batch._observe([Proposal(torch.tensor([1, 2, 3]), None, forwards=3, fed=fed)], 0.003, 0.014)
        assert (engine.policy.draft.estimate(1) is not None) == billed, fed
        assert sum(engine.policy.drafting.sums.get(1, [0.0])) > 0 if billed else not engine.policy.drafting.sums


def test_a_seed_repeats_under_dynamic_k_whatever_the_policy_learned() -> None:
    engine = Engine(target(0), "early-exit:3")
    prompt, options = PROMPTS["repeating"], dict(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=9)
    engine.policy.new_draft(0.0)  # the policy believes the draft is useless: it would draft nothing
    first = engine.generate(prompt, **options)
    engine.policy.new_draft(0.99)  # now it believes the draft is nearly perfect: it would draft k_max
    second = engine.generate(prompt, **options)
    assert first.token_ids == second.token_ids
    assert first.stats.drafted == second.stats.drafted > 0  # the fixed SEEDED_K, not the policy's choice


# Upper 0.1% point of the chi-square distribution with 7 degrees of freedom (alpha = 0.001, 8
# cells), from standard tables; test_acceptance.py checks such values against torch's gammaincc.
CHI2_CRITICAL_DF7 = 24.322
SMALL_VOCAB = 8
TRIALS = 2000


def chi_square(counts: torch.Tensor, probs: torch.Tensor, check_valid: bool = True) -> float:
    """Pearson's statistic for observed `counts` [vocab] against expected `probs` [vocab]."""
    expected = probs.double() * counts.sum()
    if check_valid:
        assert expected.min() >= 5, "a cell is expected fewer than 5 times: the chi-square test would not be valid"
    return float(((counts.double() - expected) ** 2 / expected).sum())


@torch.inference_mode()
def test_sampled_tokens_follow_the_target_with_a_strongly_disagreeing_draft() -> None:
    # A 2-layer target over 8 tokens, and a draft that is the target with its LM head scaled by -3:
    # its logits are -3 x the target's, so it puts most of its mass where the target puts least.
    # With max_new_tokens=2 and k=1 each request drafts one token: the first emitted token is the
    # accepted draft or the recovered token, the second the bonus token or a plain step after a
    # rejection. Both must follow the target exactly (temperature 1: the plain softmax).
    small = llama(seed=7, vocab=SMALL_VOCAB, layers=2)
    contrary = copy.deepcopy(small)
    contrary.lm_head.weight.mul_(-3.0)
    prompt = [3]
    first_probs = small(input_ids=torch.tensor([prompt])).logits[0, -1].softmax(-1)  # [vocab]
    draft_probs = contrary(input_ids=torch.tensor([prompt])).logits[0, -1].softmax(-1)  # [vocab]
    after = (
        small(input_ids=torch.tensor([[3, x] for x in range(SMALL_VOCAB)])).logits[:, -1].softmax(-1)
    )  # [vocab, vocab]
    second_probs = first_probs @ after  # [vocab]: P(second = y) = sum_x P(x) P(y | x)
    overlap = float(torch.minimum(first_probs, draft_probs).sum())  # P(the first draft is accepted)
    assert 0.5 * float((first_probs - draft_probs).abs().sum()) > 0.6, "the draft does not disagree strongly"

    engine = Engine(small, contrary, k=1)
    firsts, seconds, accepted = torch.zeros(SMALL_VOCAB), torch.zeros(SMALL_VOCAB), 0
    for seed in range(TRIALS):
        out = engine.generate(prompt, max_new_tokens=2, temperature=1.0, seed=seed)
        assert len(out.token_ids) == 2 and out.stats.drafted == 1
        firsts[out.token_ids[0]] += 1
        seconds[out.token_ids[1]] += 1
        accepted += out.accepted[0]

    assert chi_square(firsts, first_probs) < CHI2_CRITICAL_DF7
    assert chi_square(seconds, second_probs) < CHI2_CRITICAL_DF7
    # The test has power: emitting the draft's tokens instead would fail it by far.
    assert chi_square(firsts, draft_probs, check_valid=False) > 10 * CHI2_CRITICAL_DF7
    # The draft is accepted as often as the theory says: binomial, within 4 standard deviations.
    sd = (TRIALS * overlap * (1 - overlap)) ** 0.5
    assert abs(accepted - TRIALS * overlap) < 4 * sd, (accepted, TRIALS * overlap)
    assert 0 < accepted < TRIALS / 2


# =================================================================================================
# Stop conditions
# =================================================================================================


@pytest.mark.parametrize("draft", ["early-exit:3", "ngram", None])
def test_max_new_tokens_one_returns_exactly_one_token(draft) -> None:
    model = target(0)
    out = Engine(model, draft).generate(PROMPTS["repeating"], max_new_tokens=1, k=5)
    assert out.token_ids == baseline(0, PROMPTS["repeating"])[:1]
    assert out.finish_reason == "length"
    assert out.stats.drafted == 0  # a 1-token budget leaves nothing for a draft to save
    assert out.stats.target_forwards == 1


def test_eos_as_the_first_token_stops_at_once() -> None:
    model = target(0)
    eos = baseline(0, PROMPTS["repeating"])[0]
    for draft in ["early-exit:3", model]:
        out = Engine(model, draft, eos_token_id=eos).generate(PROMPTS["repeating"], max_new_tokens=NEW_TOKENS, k=3)
        assert out.token_ids == [eos]
        assert out.finish_reason == "stop"
        assert out.stats.emitted == 1 and len(out.proposed) == len(out.accepted) == 1


def test_eos_inside_an_accepted_run_truncates_after_it() -> None:
    # The target drafting for itself with k=5 emits 6 tokens per step, at output positions
    # 6s..6s+5. An EOS at a position p with p % 6 < 5 arrives with tokens after it in the same step.
    model = target(0)
    prompt = PROMPTS["repeating"]
    plain = baseline(0, prompt)
    p = next(p for p, t in enumerate(plain) if t not in plain[:p] and p % 6 != 5 and p > 6)
    eos = plain[p]
    out = Engine(model, model, eos_token_id=eos).generate(prompt, max_new_tokens=NEW_TOKENS, k=5)
    plain_out = Engine(model, None, eos_token_id=eos).generate(prompt, max_new_tokens=NEW_TOKENS, speculative=False)
    assert out.token_ids == plain_out.token_ids == plain[: p + 1]
    assert out.finish_reason == plain_out.finish_reason == "stop"
    assert len(out.proposed) == len(out.accepted) == p + 1
    assert out.stats.emitted == p + 1
    assert out.stats.accepted > sum(out.accepted)  # drafts after the EOS were accepted, then cut


def test_eos_list_and_the_length_finish() -> None:
    model = target(2)
    plain = baseline(2, PROMPTS["one-token"])
    never = [t for t in range(VOCAB) if t not in plain][:3]
    out = Engine(model, "ngram", eos_token_id=never).generate(PROMPTS["one-token"], max_new_tokens=NEW_TOKENS, k=3)
    assert out.token_ids == plain and out.finish_reason == "length"
    first_eos = plain[5]
    out = Engine(model, "ngram", eos_token_id=[*never, first_eos]).generate(
        PROMPTS["one-token"], max_new_tokens=NEW_TOKENS, k=3
    )
    assert out.token_ids == plain[: plain.index(first_eos) + 1] and out.finish_reason == "stop"


# =================================================================================================
# Errors
# =================================================================================================


@pytest.mark.parametrize(
    ("kwargs", "phrase"),
    [
        (dict(prompt=[]), "the prompt is empty"),
        (dict(prompt=torch.tensor([], dtype=torch.long)), "the prompt is empty"),
        (dict(prompt=[1] * MAX_POSITIONS), "over the model's context"),
        (dict(prompt=[1] * (MAX_POSITIONS + 10)), "over the model's context"),
        (dict(prompt=[1, VOCAB]), "token ids must be in [0, 112)"),
        (dict(prompt=[-1, 2]), "token ids must be in [0, 112)"),
        (dict(prompt="hello"), "need a tokenizer"),
        (dict(prompt=[{"role": "user", "content": "hi"}]), "need a tokenizer"),
        (dict(prompt=[1, 2.0]), "prompt must be a list of token ids"),
        (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
        (dict(max_new_tokens=-3), "max_new_tokens must be a positive integer"),
        (dict(temperature=-0.1), "temperature must be in"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(top_p=1.5), "top_p must be in (0, 1]"),
        (dict(top_k=-1), "top_k must be >= 0"),
        (dict(k=-1), "k must be a non-negative integer"),
        (dict(stop=[""]), "stop must be a non-empty string"),
    ],
)
def test_bad_requests_raise_input_error(kwargs: dict, phrase: str) -> None:
    engine = Engine(target(0), "ngram")
    kwargs = {"prompt": [1, 2, 3], **kwargs}
    with pytest.raises(InputError) as raised:
        engine.generate(**kwargs)
    assert phrase in str(raised.value)
    # The largest valid prompt still works: one position is left for the output.
    if "context" in phrase:
        out = engine.generate([1] * (MAX_POSITIONS - 1), max_new_tokens=5)
        assert len(out.token_ids) == 1 and out.finish_reason == "length"


@pytest.mark.parametrize(
    ("draft", "phrase"),
    [
        ("early-exit:0", f"1 <= N < {TARGET_LAYERS}"),
        (f"early-exit:{TARGET_LAYERS}", f"1 <= N < {TARGET_LAYERS}"),
        (f"early-exit:{TARGET_LAYERS + 3}", f"1 <= N < {TARGET_LAYERS}"),
        ("early-exit:", "needs a layer count"),
        ("early-exit:two", "needs a layer count"),
        ("medusa:4", "unknown draft spec"),
        ("eagle", "unknown draft spec"),
        (3, "draft must be a spec string, a model or a Drafter"),
    ],
)
def test_bad_draft_specs_raise_draft_spec_error(draft, phrase: str) -> None:
    with pytest.raises(DraftSpecError) as raised:
        Engine(target(0), draft)
    assert phrase in str(raised.value)


def test_a_draft_with_another_vocabulary_is_refused() -> None:
    with pytest.raises(DraftSpecError) as raised:
        Engine(target(0), mismatched_draft())
    assert "vocabulary" in str(raised.value) and f"{VOCAB + 16}" in str(raised.value)


@pytest.mark.parametrize("spec", ["ngram:0", "ngram:x"])
def test_a_bad_ngram_size_raises_draft_spec_error(spec: str) -> None:
    # `ngram:N` is parsed with a bare int() and NgramDrafter raises a plain ValueError, so these
    # escape the CLI's handler (it catches DraftSpecError and InputError) as a traceback, while
    # the equivalent `early-exit:x` gets a DraftSpecError that names the spec.
    with pytest.raises(DraftSpecError) as raised:
        Engine(target(0), spec)
    assert spec in str(raised.value) or "ngram" in str(raised.value)


# =================================================================================================
# The early-exit draft never changes the target
# =================================================================================================


def test_early_exit_draft_shares_embedding_and_head_but_owns_its_layers() -> None:
    model = tiny_target(5)  # a private target: this test writes into the draft's weights
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine = Engine(model, "early-exit:2")
    draft = engine.drafter.model
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), f"building the draft changed {name}"

    assert draft.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert draft.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    assert draft.model.norm.weight.data_ptr() == model.model.norm.weight.data_ptr()
    assert len(draft.model.layers) == 2
    target_ptrs = {p.data_ptr() for layer in model.model.layers for p in layer.parameters()}
    for layer, original in zip(draft.model.layers, model.model.layers, strict=False):
        for (name, p), q in zip(layer.named_parameters(), original.parameters(), strict=False):
            assert p.data_ptr() not in target_ptrs, f"draft layer parameter {name} is the target's tensor"
            assert torch.equal(p, q)  # a copy: equal values, distinct storage

    plain_before = engine.generate(PROMPTS["repeating"], max_new_tokens=12, speculative=False).token_ids
    with torch.no_grad():
        for p in draft.model.layers.parameters():
            p.add_(torch.randn_like(p))  # what an adapter or training step might do, only much more
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), f"changing the draft's layers changed the target's {name}"
    # The target's own output, and the speculative output, are unaffected by the damaged draft.
    assert engine.generate(PROMPTS["repeating"], max_new_tokens=12, speculative=False).token_ids == plain_before
    assert engine.generate(PROMPTS["repeating"], max_new_tokens=12, k=3).token_ids == plain_before


# =================================================================================================
# Statistics, trace, top-k record and streaming
# =================================================================================================


@pytest.mark.parametrize(
    ("draft", "k", "temperature"),
    [
        ("early-exit:3", 3, 0.0),
        ("early-exit:1", None, 0.0),
        ("ngram", 4, 0.0),
        ("ngram", None, 1.0),
        ("separate-model", 2, 1.0),
        ("target-itself", 5, 0.7),
    ],
)
def test_statistics_and_trace_are_consistent(draft: str, k, temperature: float) -> None:
    model = target(0)
    engine = Engine(model, make_draft(draft, model))
    for _name, prompt in PROMPTS.items():
        out = engine.generate(prompt, max_new_tokens=NEW_TOKENS, k=k, temperature=temperature, seed=11)
        s = out.stats
        n = len(out.token_ids)
        assert s.emitted == n == NEW_TOKENS
        assert s.mean_acceptance_length == pytest.approx(n / s.target_forwards)
        assert s.emitted == s.accepted + s.target_forwards  # one recovered or bonus token per forward
        if s.drafted:
            assert s.acceptance_rate == pytest.approx(s.accepted / s.drafted)
        else:
            assert s.acceptance_rate is None
        assert sum(s.accepted_per_pos) == s.accepted and sum(s.drafted_per_pos) == s.drafted
        assert all(a <= d for a, d in zip(s.accepted_per_pos, s.drafted_per_pos, strict=True))
        assert s.drafted_per_pos == sorted(s.drafted_per_pos, reverse=True)  # position i+1 needs position i
        if isinstance(engine.drafter, ModelDrafter):
            assert s.draft_forwards == s.drafted  # one draft forward per drafted token
        if draft == "ngram":
            assert s.draft_forwards == 0

        assert len(out.proposed) == len(out.accepted) == n
        assert sum(out.accepted) == s.accepted
        for i, (token, proposed, accepted) in enumerate(zip(out.token_ids, out.proposed, out.accepted, strict=True)):
            if accepted:
                assert proposed == token, f"position {i}"
            elif proposed != -1:  # a rejected draft: the recovered token cannot be the rejected one
                assert proposed != token, f"position {i}"
        assert out.prompt_ids == prompt and out.text is None


@torch.inference_mode()
def test_record_topk_matches_the_target_distribution() -> None:
    model = target(1)
    engine = Engine(model, "early-exit:3", record_topk=4)
    prompt = PROMPTS["repeating"]
    out = engine.generate(prompt, max_new_tokens=NEW_TOKENS, k=3)
    n = len(out.token_ids)
    assert out.target_topk_ids.shape == out.target_topk_logprobs.shape == (n, 4)
    assert out.target_topk_ids[:, 0].tolist() == out.token_ids  # greedy: the top-1 token is emitted
    # The recorded log-probabilities are the target's own, position by position.
    context = prompt + out.token_ids[:-1]
    logprobs = model(input_ids=torch.tensor([context])).logits[0, len(prompt) - 1 :].log_softmax(-1)  # [n, vocab]
    top = logprobs.topk(4, dim=-1)
    assert torch.equal(out.target_topk_ids, top.indices)
    torch.testing.assert_close(out.target_topk_logprobs, top.values, atol=1e-4, rtol=0)
    # Without record_topk nothing is recorded.
    assert Engine(model, "ngram").generate(prompt, max_new_tokens=5).target_topk_ids is None


def test_a_request_that_no_record_is_written_for_keeps_no_top_m() -> None:
    engine = Engine(target(1), "early-exit:3", record_topk=4)
    batch = engine.new_batch(2)
    kept = batch.add(engine.request(PROMPTS["repeating"], max_new_tokens=6, k=3))
    skipped = batch.add(dataclasses.replace(engine.request(PROMPTS["repeating"], max_new_tokens=6, k=3), record=False))
    outputs = {}
    while len(batch):
        outputs.update((row, chunk.output) for row, chunk in batch.step() if chunk.output is not None)
    assert outputs[kept].target_topk_ids.shape == (6, 4)
    assert outputs[skipped].target_topk_ids is None and outputs[skipped].target_topk_logprobs is None
    assert outputs[skipped].token_ids == outputs[kept].token_ids  # the same decoding otherwise


def test_record_topk_is_truncated_with_the_output_at_eos() -> None:
    model = target(1)
    plain = baseline(1, PROMPTS["repeating"])
    eos = plain[8]
    out = Engine(model, model, record_topk=3, eos_token_id=eos).generate(
        PROMPTS["repeating"], max_new_tokens=NEW_TOKENS, k=5
    )
    n = plain.index(eos) + 1
    assert len(out.token_ids) == n
    assert out.target_topk_ids.shape == (n, 3)
    assert out.target_topk_ids[:, 0].tolist() == out.token_ids


@pytest.mark.parametrize(
    ("draft", "k", "temperature"), [("early-exit:3", 3, 0.0), ("ngram", None, 0.0), ("early-exit:1", 2, 1.0)]
)
def test_stream_chunks_add_up_to_the_generated_output(draft: str, k, temperature: float) -> None:
    model = target(2)
    engine = Engine(model, draft)
    prompt = PROMPTS["repeating"]
    chunks = list(engine.stream(prompt, max_new_tokens=NEW_TOKENS, k=k, temperature=temperature, seed=4))
    out = engine.generate(prompt, max_new_tokens=NEW_TOKENS, k=k, temperature=temperature, seed=4)
    assert [t for c in chunks for t in c.token_ids] == out.token_ids
    assert all(c.finish_reason is None and c.output is None and c.token_ids for c in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason == "length" and last.output is not None
    assert last.output.token_ids == out.token_ids
    assert len(chunks) == last.output.stats.target_forwards  # one chunk per decoding step


def test_stream_rejects_bad_input_when_called_not_when_first_read() -> None:
    # A streaming server answers 4xx before it has sent anything: stream() itself must raise.
    engine = Engine(tiny_target(0), "early-exit:1")
    with pytest.raises(InputError, match="empty"):
        engine.stream([], max_new_tokens=4)
    with pytest.raises(InputError, match="max_new_tokens"):
        engine.stream([1, 2], max_new_tokens=0)
