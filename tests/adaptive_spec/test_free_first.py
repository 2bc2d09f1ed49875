"""Free drafts first (`adaptive_spec.drafters.free_first`): a row whose context (or its domain's n-gram
index) has a match drafts by copying, with no forward; the others draft with the model, in one batch.

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_free_first.py -q   (CPU, seconds)

Greedy equality for `ngram+head` and `ngram+early-exit:2` is in test_engine.py and test_batch.py; the
index built by the trainer (drafters/ngram_index.py) in test_ngram_index.py and test_online.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from adapter_files import make_adapter
from tiny import tiny_target

from adaptive_spec import Engine
from adaptive_spec.decoding.estimates import Acceptance, StepCosts
from adaptive_spec.drafters.free_first import FreeFirstDrafter
from adaptive_spec.drafters.ngram_index import build_ngram_index
from adaptive_spec.drafters.slots import AdapterSlot
from adaptive_spec.drafters.spec import DraftSpecError, parse_draft_spec
from adaptive_spec.formats.adapters import AdapterDir

pytestmark = pytest.mark.usefixtures("one_thread")


def test_specs() -> None:
    assert str(parse_draft_spec("ngram+head")) == "ngram+head"
    assert str(parse_draft_spec("ngram+early-exit:4")) == "ngram+early-exit:4"
    spec = parse_draft_spec("ngram+./my-draft")
    assert spec.kind == "model" and spec.source == "./my-draft" and spec.free_first
    for bad in ["ngram+ngram", "ngram+", "ngram+ngram+head"]:
        with pytest.raises(DraftSpecError):
            parse_draft_spec(bad)


def test_a_row_with_a_match_copies_and_the_others_use_the_model() -> None:
    engine = Engine(tiny_target(0), "ngram+head")
    assert isinstance(engine.drafter, FreeFirstDrafter)
    batch = engine.new_batch(3)
    repeating = batch.add(engine.request([5, 17, 33, 8, 5, 17, 33, 8, 5, 17], max_new_tokens=8))  # ... 5 17 -> 33 8
    fresh = batch.add(engine.request([1, 2, 3, 4], max_new_tokens=8))  # no repeat: nothing to copy
    indexed = batch.add(engine.request([9, 10, 11], max_new_tokens=8))
    indexed.adapter = AdapterSlot(
        "1", "sql", engine.drafter.model.head, engine.drafter.model.vocab, None, ngrams={(10, 11): [60, 61, 62]}
    )
    copied, modelled, from_index = engine.drafter.propose(batch.draft_cache, batch.rows, [2, 2, 3])
    assert copied.tokens.tolist() == [33, 8] and copied.forwards == 0
    assert modelled.forwards == 2 and len(modelled.tokens) == 2
    assert from_index.tokens.tolist() == [60, 61, 62] and from_index.forwards == 0
    assert fresh.slot == 1 and repeating.slot == 0


def indexed_engine(tmp_path: Path, draft: str) -> tuple[Engine, list[int], list[int]]:
    """An engine whose adapter ships an n-gram index holding this prompt's greedy continuation, as the
    trainer writes it from earlier outputs: (engine, prompt, the target's own 24 tokens)."""
    target = tiny_target(0)
    engine = Engine(target, draft, eos_token_id=[])
    prompt = [3, 41, 77, 12, 90, 25]  # no repeat: prompt lookup alone has nothing to copy at first
    expected = engine.generate(prompt, 24, speculative=False).token_ids
    version = AdapterDir(tmp_path / "v1")
    make_adapter(target, 1, version.path, seed=3)
    version.write_ngrams(build_ngram_index([(prompt, expected)] * 2))  # this output, seen twice before
    version.seal(version=1)
    engine.load_adapter(version.path)
    assert engine.adapters.general.ngrams
    return engine, prompt, expected


def test_the_index_a_version_ships_gives_free_proposals_and_the_output_stays_the_targets(tmp_path) -> None:
    """`ngram+early-exit:1` with an adapter whose n-gram index holds this prompt's continuation copies
    it with no draft forward; greedy output is unchanged."""
    engine, prompt, expected = indexed_engine(tmp_path, "ngram+early-exit:1")
    indexed = engine.generate(prompt, 24, k=4)
    engine.adapters.general.ngrams = None  # the same adapter without its index
    modelled = engine.generate(prompt, 24, k=4)
    print(f"\nwith the index: {indexed.stats.as_dict()}\nwithout: {modelled.stats.as_dict()}")
    assert indexed.token_ids == modelled.token_ids == expected
    assert indexed.stats.accepted > modelled.stats.accepted
    assert indexed.stats.target_forwards < modelled.stats.target_forwards
    assert indexed.stats.draft_forwards < modelled.stats.draft_forwards  # free proposals cost no forward
    assert indexed.stats.mean_acceptance_length >= 3.0  # k = 4: nearly every proposal is the target's
    assert indexed.stats.free_drafted == indexed.stats.drafted  # every proposal was copied


def test_dynamic_k_copies_free_matches_even_where_the_model_draft_does_not_pay(tmp_path) -> None:
    """Each source has its own acceptance (dynamic_k.py `choose_sources`): an untrained model draft is not
    worth a draft forward (its acceptance set to 0 here), so dynamic k would decode plainly; the index's matches cost none and are
    accepted, so they are still proposed, several tokens at a time. Greedy output is the target's."""
    engine, prompt, expected = indexed_engine(tmp_path, "ngram+early-exit:1")
    engine.policy.alphas[(None, "1")] = Acceptance(0.0, accepted=0.0, drafted=1000.0)  # the model does not pay
    # Fixed costs, shaped like the default model's on this CPU (31 ms a token, 47 ms for four): the
    # choice must follow acceptance here, not the timing jitter of a tiny model on a busy machine.
    engine.policy.target = StepCosts(seconds={1: 0.031, 2: 0.032, 4: 0.047, 8: 0.076, 16: 0.107})
    engine.policy.observe_step = lambda *args, **kwargs: None
    out = engine.generate(prompt, 24)  # k=None: dynamic
    stats = out.stats
    print(f"\n{stats.as_dict()}")
    assert out.token_ids == expected
    assert stats.free_drafted == stats.drafted and stats.free_accepted > 0  # before: k = 0, nothing drafted
    assert stats.draft_forwards <= 2  # at most a probe of the model draft

    engine.adapters.general.ngrams = None  # without the index, the same policy decodes (nearly) plainly
    plain = engine.generate(prompt, 24)
    assert plain.token_ids == expected
    assert plain.stats.target_forwards > stats.target_forwards
