"""Adapters on the draft: merged weights equal PEFT's, swaps stay lossless, bad ones are refused."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from adapter_files import make_adapter
from tiny import tiny_target

from adaptive_spec import Engine
from adaptive_spec.contracts import NGRAMS_FILE, VOCAB_FILE
from adaptive_spec.formats.adapters import CHECKSUM_FILE, WEIGHTS_FILE, AdapterDir, AdapterError, sha256_file

pytestmark = pytest.mark.usefixtures("one_thread")

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [5, 17, 33, 8, 5, 17, 33, 8, 5, 17]


def draft_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]


def served_logits(engine: Engine, ids):
    """The logits of the draft the engine serves to requests without a domain (its general adapter)."""
    with engine.drafter.using(engine.adapters.general):
        return draft_logits(engine.drafter.model, ids)


def test_merged_adapter_equals_peft_runtime_and_leaves_target_alone(tmp_path):
    target = tiny_target(0)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    peft_model = make_adapter(target, 2, tmp_path / "v1", seed=1)
    engine = Engine(target, "early-exit:2")
    base = served_logits(engine, PROMPT)
    pause = engine.load_adapter(tmp_path / "v1", "1")
    assert engine.adapter_version == "1" and pause < 0.05
    served = served_logits(engine, PROMPT)
    assert torch.allclose(served, draft_logits(peft_model, PROMPT), atol=1e-5)
    assert not torch.allclose(served, base, atol=1e-3), "the adapter must change the draft"
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    engine.unload_adapter()
    assert engine.adapter_version is None
    assert torch.equal(served_logits(engine, PROMPT), base)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_swap_between_steps_keeps_the_output_lossless(tmp_path, temperature):
    target = tiny_target(1)
    make_adapter(target, 2, tmp_path / "v1", seed=2)
    make_adapter(target, 2, tmp_path / "v2", seed=3)
    engine = Engine(target, "early-exit:2", eos_token_id=[])
    baseline = engine.generate(PROMPT, 40, speculative=False).token_ids
    tokens, swaps = [], 0
    for i, chunk in enumerate(engine.stream(PROMPT, max_new_tokens=40, k=3, temperature=temperature, seed=5)):
        tokens += chunk.token_ids
        if i in (2, 5):  # a swap lands between two decoding steps of this request
            engine.load_adapter(tmp_path / f"v{1 + swaps}", str(1 + swaps))
            swaps += 1
    assert swaps == 2 and engine.adapter_version == "2"
    assert chunk.output.stats.adapter_version == "2"
    if temperature == 0.0:
        assert tokens == baseline
    else:  # same seed, same adapters swapped at the same steps: reproducible
        again = Engine(target, "early-exit:2", eos_token_id=[])
        replay = []
        for i, chunk in enumerate(again.stream(PROMPT, max_new_tokens=40, k=3, temperature=temperature, seed=5)):
            replay += chunk.token_ids
            if i in (2, 5):
                again.load_adapter(tmp_path / f"v{1 + (i == 5)}")
        assert replay == tokens


def test_bad_adapters_are_refused_and_the_served_one_stays(tmp_path):
    target = tiny_target(2)
    make_adapter(target, 2, tmp_path / "good", seed=4)
    engine = Engine(target, "early-exit:2")
    engine.load_adapter(tmp_path / "good", "7")
    served = served_logits(engine, PROMPT)

    corrupt = tmp_path / "corrupt"
    make_adapter(target, 2, corrupt, seed=5)
    data = bytearray((corrupt / WEIGHTS_FILE).read_bytes())
    data[-10] ^= 0xFF
    (corrupt / WEIGHTS_FILE).write_bytes(bytes(data))

    too_deep = tmp_path / "too-deep"  # trained on a 3-layer draft: layer 2 does not exist in ours
    make_adapter(target, 3, too_deep, seed=6)

    other_shape = tmp_path / "other-shape"  # another model's hidden size
    from tiny import llama

    make_adapter(llama(7, layers=4, hidden=32), 2, other_shape, seed=7)

    no_checksum_garbage = tmp_path / "garbage"
    no_checksum_garbage.mkdir()
    (no_checksum_garbage / "adapter_config.json").write_text("{not json")
    (no_checksum_garbage / WEIGHTS_FILE).write_bytes(b"junk")

    cases = {
        corrupt: "checksum",
        too_deep: "no such linear",
        other_shape: "module is",
        tmp_path / "missing": "not an adapter directory",
        no_checksum_garbage: "unreadable",
    }
    for path, phrase in cases.items():
        with pytest.raises(AdapterError, match=phrase):
            engine.load_adapter(path)
        assert engine.adapter_version == "7"
        assert torch.equal(served_logits(engine, PROMPT), served)


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_an_adapter_with_non_finite_weights_is_refused_as_corrupt_and_the_served_one_stays(tmp_path, bad_value):
    """A version whose checksum is right (sealed after the NaN went in: a hand promotion, any MLflow
    writer) but one of whose weights is NaN or Inf: refused before any swap, by the check a server and a
    trainer adopting it share (`AdapterDir.verify`)."""
    from safetensors.torch import load_file, save_file

    target = tiny_target(2)
    make_adapter(target, 2, tmp_path / "good", seed=4)
    engine = Engine(target, "early-exit:2")
    engine.load_adapter(tmp_path / "good", "7")
    served = served_logits(engine, PROMPT)

    poisoned = tmp_path / "poisoned"
    make_adapter(target, 2, poisoned, seed=5)
    tensors = load_file(poisoned / WEIGHTS_FILE)
    name = sorted(tensors)[3]
    tensors[name][0, 0] = bad_value
    save_file(tensors, poisoned / WEIGHTS_FILE)
    AdapterDir(poisoned).seal(version=8)  # checksum.sha256 and the metadata's sha256 say these bytes
    with pytest.raises(AdapterError, match="hold NaN or Inf") as refused:
        engine.load_adapter(poisoned, "8")
    assert refused.value.reason == "corrupt" and name in str(refused.value)
    assert engine.adapter_version == "7" and torch.equal(served_logits(engine, PROMPT), served)
    with pytest.raises(AdapterError, match="hold NaN or Inf"):
        AdapterDir(poisoned).verify()  # what the trainer runs before adopting a registry's champion


def test_adapters_need_a_model_draft():
    engine = Engine(tiny_target(0), "ngram")
    with pytest.raises(AdapterError, match="model draft"):
        engine.unload_adapter()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_restricted_draft_vocabulary_stays_lossless_and_only_proposes_its_tokens(tmp_path, temperature):
    target = tiny_target(3)
    path = tmp_path / "v1"
    make_adapter(target, 2, path, seed=8)
    engine = Engine(target, "early-exit:2", eos_token_id=[])
    baseline = engine.generate(PROMPT, 40, speculative=False).token_ids
    vocab = sorted(set(baseline[:20]) | {0, 1})  # what "recent traffic" used: some tokens of this output
    (path / "draft_vocab.json").write_text(json.dumps({"token_ids": vocab}))
    engine.load_adapter(path, "1")
    out = engine.generate(PROMPT, 40, k=3, temperature=temperature, seed=11)
    proposed = [t for t in out.proposed if t >= 0]
    assert proposed and set(proposed) <= set(vocab)
    if temperature == 0.0:
        assert out.token_ids == baseline
        assert out.stats.accepted > 0, "the restricted draft still agrees where its tokens are right"
    engine.unload_adapter()
    assert engine.drafter.vocab.ids is None


def test_a_bad_draft_vocabulary_is_refused(tmp_path):
    target = tiny_target(3)
    path = tmp_path / "v1"
    make_adapter(target, 2, path, seed=8)
    (path / "draft_vocab.json").write_text(json.dumps({"token_ids": [1, 2, 10**6]}))
    engine = Engine(target, "early-exit:2")
    with pytest.raises(AdapterError, match="token_ids"):
        engine.load_adapter(path)
    assert engine.adapter_version is None and engine.drafter.vocab.ids is None


# ---------------------------------------------------------------- the n-gram index a version ships

INDEX = {(17, 33): [8, 5, 17], (5,): [17, 33]}  # n-gram -> continuation (adaptive_spec/drafters/ngram_index.py)


def sealed_with_index(target, path: Path, index=INDEX) -> AdapterDir:
    """A version as the trainer writes it (trainer/promotion/versions.py): the adapter, its n-gram index, then the seal."""
    make_adapter(target, 2, path, seed=8)
    version = AdapterDir(path)
    version.write_ngrams(index)
    version.seal(version=1)
    return version


def test_an_n_gram_index_is_sealed_with_the_weights_and_loads_into_the_slot(tmp_path):
    target = tiny_target(3)
    version = sealed_with_index(target, tmp_path / "v1")
    digests = {WEIGHTS_FILE: sha256_file(version.weights), NGRAMS_FILE: sha256_file(version.ngrams_file)}
    assert version.checksums() == digests and version.metadata().ngrams_sha256 == digests[NGRAMS_FILE]
    assert subprocess.run(["sha256sum", "--quiet", "-c", CHECKSUM_FILE], cwd=version.path).returncode == 0
    assert version.verify() == digests[WEIGHTS_FILE]

    engine = Engine(target, "ngram+early-exit:2")
    engine.load_adapter(version.path)
    assert engine.adapters.general.ngrams == INDEX
    make_adapter(target, 2, tmp_path / "plain", seed=9)  # a version without an index
    engine.load_adapter(tmp_path / "plain", domain="sql")
    assert engine.adapters.domains["sql"].ngrams is None


def test_a_sealed_draft_vocabulary_is_checked_like_the_weights(tmp_path):
    """The trainer writes the vocabulary before the seal, which lists it; a changed or deleted one
    is refused. A version sealed before vocabularies were covered (written after the seal) loads."""
    target = tiny_target(3)
    engine = Engine(target, "early-exit:2")

    def version(name: str, *, after_seal: bool = False) -> AdapterDir:
        adapter = AdapterDir(tmp_path / name)
        make_adapter(target, 2, adapter.path, seed=8)
        if not after_seal:
            adapter.write_vocab([1, 2, 3, 5, 8])
        adapter.seal(version=1)
        if after_seal:
            adapter.write_vocab([1, 2, 3, 5, 8])
        return adapter

    sealed = version("sealed")
    assert sealed.checksums()[VOCAB_FILE] == sealed.metadata().vocab_sha256 == sha256_file(sealed.vocab_file)
    engine.load_adapter(sealed.path, "7")
    older = version("older", after_seal=True)
    engine.load_adapter(older.path, "8")
    assert engine.adapter_version == "8"

    tampered = version("tampered")
    tampered.write_vocab([1, 2, 3, 5, 9])
    gone = version("gone")
    gone.vocab_file.unlink()
    for adapter, (reason, phrase) in {
        tampered: ("checksum", "checksum mismatch: draft_vocab.json"),
        gone: ("missing", "draft_vocab.json is listed but missing"),
    }.items():
        with pytest.raises(AdapterError, match=phrase) as refused:
            engine.load_adapter(adapter.path)
        assert refused.value.reason == reason and engine.adapter_version == "8"


def test_a_tampered_missing_or_unsealed_index_is_refused_like_corrupt_weights(tmp_path):
    target = tiny_target(3)
    engine = Engine(target, "ngram+early-exit:2")
    engine.load_adapter(sealed_with_index(target, tmp_path / "good").path, "7")

    tampered = sealed_with_index(target, tmp_path / "tampered")  # one continuation changed after the seal
    tampered.ngrams_file.write_text(tampered.ngrams_file.read_text().replace("[8,5,17]", "[8,5,18]"))
    gone = sealed_with_index(target, tmp_path / "gone")  # listed in checksum.sha256, then deleted
    gone.ngrams_file.unlink()
    added = AdapterDir(tmp_path / "added")  # put into a version after it was sealed
    make_adapter(target, 2, added.path, seed=8)
    added.seal(version=2)
    added.write_ngrams(INDEX)
    bad_ids = AdapterDir(tmp_path / "bad-ids")  # hand-made, no checksum: its shape is still checked
    make_adapter(target, 2, bad_ids.path, seed=8)
    (bad_ids.path / CHECKSUM_FILE).unlink()
    bad_ids.write_ngrams({(1,): [2, 10**6]})

    cases = {
        tampered: ("checksum", "checksum mismatch: draft_ngrams.json"),
        gone: ("missing", "listed but missing"),
        added: ("checksum", "added after sealing"),
        bad_ids: ("incompatible", "ids in"),
    }
    for version, (reason, phrase) in cases.items():
        with pytest.raises(AdapterError, match=phrase) as refused:
            engine.load_adapter(version.path)
        assert refused.value.reason == reason
        assert engine.adapter_version == "7" and engine.adapters.general.ngrams == INDEX
    for version in (tampered, gone, added):
        with pytest.raises(AdapterError):
            version.verify()
