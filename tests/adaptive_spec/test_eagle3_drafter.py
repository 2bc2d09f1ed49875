"""The EAGLE-3 draft in the engine (`adaptive_spec.drafters.eagle3`, draft "eagle3"): it reads the target's states at
the right positions, a version (a speculators checkpoint with a draft vocabulary of its own) loads, drafts only its
draft vocabulary's tokens and stays lossless, and versions that do not fit are refused. Tiny random Llama models.

Greedy equality of the base head, alone, batched with staggered rows and as trees, is in test_engine.py,
test_batch.py and test_trees.py (eagle3 is one of their draft kinds).

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_eagle3_drafter.py -q   (CPU, about 20 s)
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny import tiny_target

from adaptive_spec import Engine
from adaptive_spec.drafters.eagle3 import Eagle3Drafter
from adaptive_spec.drafters.eagle3_head import Eagle3Head
from adaptive_spec.formats.adapters import AdapterDir, AdapterError

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 33, 8, 5, 17, 33, 8, 5, 17], [44], list(range(20, 43)), [7, 7, 2]]


def trained_version(target, directory, draft_ids: torch.Tensor, seed: int = 1, aux=None) -> AdapterDir:
    """A version as the trainer writes one: a head with weights of its own over `draft_ids`, sealed."""
    head = Eagle3Head(target, aux_layer_ids=aux, draft_ids=draft_ids)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.02)
    head.checkpoint("tiny").write(directory)
    version = AdapterDir(directory)
    version.seal(version=1, draft_id="eagle3")
    return version


def test_the_head_reads_the_targets_states_at_the_previous_position() -> None:
    """A layer that adds nothing and an fc that picks the last state: the head's output at the pending token is the
    target's state one position before it, whose argmax through the target's norm and LM head is the pending token."""
    engine = Engine(tiny_target(0), "eagle3")
    head = engine.drafter.head
    assert isinstance(engine.drafter, Eagle3Drafter) and isinstance(head, Eagle3Head)
    with torch.no_grad():
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
    batch = engine.new_batch(4)
    for prompt in PROMPTS:
        batch.add(engine.request(prompt, max_new_tokens=20, k=2))
    checked = 0
    while len(batch):
        pending = {row: row.ids[-1] for row in batch.rows if row.out}
        proposals = engine.drafter.propose(batch.draft_cache, batch.rows, [2] * len(batch.rows))
        for row, proposal in zip(batch.rows, proposals, strict=True):
            if row in pending:
                assert proposal.tokens[0].item() == pending[row]
                checked += 1
        batch.draft_cache.lengths = [
            min(n, len(r.ids) - 1) for n, r in zip(batch.draft_cache.lengths, batch.rows, strict=True)
        ]
        batch.step()
    assert checked > 40


@pytest.mark.parametrize("tree_budget", [None, 10])
def test_a_version_drafts_only_its_draft_vocabulary_and_stays_lossless(tmp_path, tree_budget) -> None:
    target = tiny_target(0)
    vocab = target.config.vocab_size
    plain = [Engine(target).generate(p, max_new_tokens=24, speculative=False).token_ids for p in PROMPTS]
    seen = {t for p in PROMPTS for t in p} | {t for out in plain for t in out}
    draft_ids = torch.tensor(sorted(seen | set(range(0, vocab, 3))))
    version = trained_version(target, tmp_path / "v0001", draft_ids)
    engine = Engine(target, "eagle3", tree_budget=tree_budget)
    engine.load_adapter(version.path)
    assert engine.adapter_version == "1"
    slot = engine.adapters.general
    assert slot is not None and slot.vocab.ids.tolist() == draft_ids.tolist()
    outputs = engine.generate_batch(PROMPTS, max_new_tokens=24, k=3, max_batch=4)
    for out, expected in zip(outputs, plain, strict=True):
        assert out.token_ids == expected
    assert sum(out.stats.drafted for out in outputs) > 0
    batch = engine.new_batch(4)
    for prompt in PROMPTS:
        batch.add(engine.request(prompt, max_new_tokens=8, k=3))
    allowed = set(draft_ids.tolist())
    while len(batch):
        for row in batch.rows:
            row.adapter = slot
        for proposal in engine.drafter.propose(batch.draft_cache, batch.rows, [3] * len(batch.rows)):
            assert set(proposal.tokens.tolist()) <= allowed
        batch.draft_cache.lengths = [
            min(n, len(r.ids) - 1) for n, r in zip(batch.draft_cache.lengths, batch.rows, strict=True)
        ]
        batch.step()


def test_versions_that_do_not_fit_are_refused_and_nothing_changes(tmp_path) -> None:
    target = tiny_target(0)
    engine = Engine(target, "eagle3")
    layers = target.config.num_hidden_layers
    other = trained_version(target, tmp_path / "other", torch.arange(40), aux=(1, layers))
    with pytest.raises(AdapterError, match="aux layers"):
        engine.load_adapter(other.path)
    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    from safetensors.torch import save_file

    save_file(
        {"base_model.model.layer.self_attn.q_proj.lora_A.weight": torch.zeros(4, 8)}, lora / "adapter_model.safetensors"
    )
    with pytest.raises(AdapterError, match="LoRA version"):
        engine.load_adapter(lora)
    assert engine.adapter_version is None
