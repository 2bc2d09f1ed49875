"""`adaptive-spec adapters export VERSION DIR` and `adaptive-spec adapters import DIR`: an EAGLE-3 head version out of
the registry as a standard checkpoint (the speculators format that vLLM and SGLang load, docs/eagle3.md), and such
a checkpoint, trained here or by speculators or SpecForge, into the registry as a new version.

    adaptive-spec adapters export 7 ./head-v7           # config.json + model.safetensors, and the version's sidecar
    vllm serve HuggingFaceTB/SmolLM2-135M-Instruct \\
        --speculative-config '{"method": "eagle3", "model": "./head-v7", "num_speculative_tokens": 3}'
    adaptive-spec adapters import ./head-v7 --promote   # a new version, champion: the trainer adopts it
    adaptive-spec adapters import ./specforge-head --aux-layers 2,15,30 --domain sql   # its config names no aux layers

Export downloads the version and verifies it as a server does (checksum, finite weights, and the signature when
ADAPTIVE_SPEC_SIGNING_KEY is set). An `eagle3` draft's version is a speculators checkpoint already
(formats/adapters.py), so DIR gets config.json and model.safetensors byte for byte as stored, and beside them the
version's sidecar: adaptive_spec_adapter.json (who trained it, for which target, the gate's figures),
checksum.sha256 (`sha256sum -c` checks the weights), signature.hmac when the version is signed (an HMAC over the
checksums, the config's sha256, the target and the draft), and draft_ngrams.json / draft_vocab.json when it ships
them. vLLM and speculators read config.json and model.safetensors and nothing else in the directory, so the
sidecar changes nothing they load; and since the bytes are the version's own, the trainer's signature still checks
on the exported directory. For the same reason export never rewrites the verifier the config names; it says on
stderr when that is not the name other engines know the target by (adaptive_spec/models.py `verifier_name`: a
Hugging Face id as given; for the built-in default, the model its GGUF file holds). A version of the project's own
layout (`head`, `early-exit:N`) is refused: it is a LoRA on a network that EAGLE-3 has no counterpart for.

Import reads DIR in the speculators format or the original EAGLE-3 layout (`midlayer.*`, formats/eagle3.py) and loads
the configured target (--target, else ADAPTIVE_SPEC_TARGET, else the built-in default). It checks that the head
fits the target (drafters/eagle3_head.py: widths, heads, vocabulary and its d2t/t2d mapping, aux layers) and was
trained for it (the config's verifier against the target's name; --allow-other-verifier imports another target's
head anyway). It checks that this deployment can draft and train with it: the aux layers the engine captures,
(2, L // 2, L), and the deployment's one draft vocabulary size (ADAPTIVE_SPEC_DRAFT_VOCAB_SIZE, as the trainer
reads it). The checkpoint is then re-written in the speculators format (names normalized, this target's verifier
name, the aux layers), sealed, signed with ADAPTIVE_SPEC_SIGNING_KEY when set, and registered as the trainer registers
its versions (registry/client.py `register`: the same run, tags and sha256 tag), for the draft `eagle3`.
`--promote` makes it the champion (as `adapters promote` does); without it, it is registered only.

A directory that `export` wrote has its checksum checked first, and, with a key, its signature: a changed file is
refused. Its metadata is kept (the gate's figures, the settings, the loss), with the source deployment's own
numbers (version, lineage, target) under `imported.source`. An unsigned export, or a head from speculators or
SpecForge with no sidecar, has only the checkpoint's own checks; whoever runs the import vouches for it, and the
version is signed here.

Tests (a real MLflow on sqlite, tiny models built in code):
`.venv/bin/python -m pytest tests/cli/test_adapters_eagle3.py -q -n 0`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from adaptive_spec.contracts import (
    CHECKSUM_FILE,
    EAGLE3_CONFIG_FILE,
    EAGLE3_WEIGHTS_FILE,
    METADATA_FILE,
    NGRAMS_FILE,
    SIGNATURE_FILE,
    VOCAB_FILE,
)
from cli.options import CommandError

ACTIONS = ("export", "import")
EAGLE3_DRAFT = "eagle3"  # the draft id of an EAGLE-3 head's versions (`--draft eagle3`)
SIDECAR = (METADATA_FILE, CHECKSUM_FILE, SIGNATURE_FILE, NGRAMS_FILE, VOCAB_FILE)  # beside the checkpoint's two files
# What a version's metadata says of the deployment that made it: kept under imported.source, not as this one's own.
_SOURCE_KEYS = (
    "target_id",
    "draft_id",
    "domain",
    "version",
    "parent_version",
    "parent_sha256",
    "parent_registry_version",
    "registry_version",
    "adopted_at",
    "adopted_by",
    "adopted_as",
    "init_adapter",
    "adapter_sha256",
    "ngrams_sha256",
    "vocab_sha256",
    "imported",
)


def add_commands(actions, store: argparse.ArgumentParser, where: argparse.ArgumentParser) -> None:
    """The two actions under `adaptive-spec adapters` (cli/adapters.py): `store` names the registry, `where` adds
    --domain."""
    export = actions.add_parser(
        "export",
        parents=[store],
        help="write an eagle3 version as a standard EAGLE-3 checkpoint (speculators format) that vLLM loads",
        description="Write an eagle3 version as a standard EAGLE-3 checkpoint, in the speculators format that vLLM "
        "and SGLang load. Download VERSION, verify it (checksum, finite weights, the signature when "
        "ADAPTIVE_SPEC_SIGNING_KEY is set) and write DIR: config.json and model.safetensors as the version stores "
        'them (what `vllm serve --speculative-config \'{"method": "eagle3", "model": DIR, '
        "\"num_speculative_tokens\": 3}'` loads), plus the version's sidecar, which those engines ignore: "
        f"{', '.join(SIDECAR)} (the last two when it ships them). Only versions of the eagle3 draft export: "
        "the head and early-exit drafts are LoRA adapters on the project's own layout.",
    )
    export.add_argument("version", metavar="VERSION", help="a registry version (`adaptive-spec adapters list`)")
    export.add_argument("directory", type=Path, metavar="DIR", help="made if missing; must be empty unless --force")
    export.add_argument("--force", action="store_true", help="write into a non-empty DIR, replacing files of its names")
    imported = actions.add_parser(
        "import",
        parents=[where],
        help="register an EAGLE-3 checkpoint (speculators or the original layout) as a new version",
        description="Read DIR (config.json + model.safetensors, in the speculators format or the original EAGLE-3 "
        "layout with midlayer.* names), load the target and check that the head fits it (hidden size, heads, "
        "vocabulary and its d2t/t2d mapping, aux layers) and was trained for it (the config's "
        "speculators_config.verifier.name_or_path) and that this deployment drafts with it (the aux layers its engine "
        "captures, its draft vocabulary size: ADAPTIVE_SPEC_DRAFT_VOCAB_SIZE), then register it as a new version of "
        "the eagle3 draft, sealed "
        "and, with ADAPTIVE_SPEC_SIGNING_KEY, signed. A directory written by `adapters export` keeps its metadata, "
        "and its checksum and signature are checked first. With --domain it is that domain's adapter.",
    )
    imported.add_argument("directory", type=Path, metavar="DIR", help="an EAGLE-3 checkpoint's directory")
    imported.add_argument(
        "--promote", action="store_true", help="make it the champion (as `adapters promote`); default: registered only"
    )
    imported.add_argument(
        "--target",
        default=None,
        help="the target the head must fit (default: $ADAPTIVE_SPEC_TARGET, else the built-in smollm2-135m-instruct)",
    )
    imported.add_argument(
        "--aux-layers",
        type=aux_layers,
        default=None,
        metavar="I,J,K",
        help="the target layers whose states the head reads, in vLLM's numbering (the state entering layer i; the "
        "layer count: what enters the final norm), for a checkpoint that names none or names them wrongly "
        "(default: the config's, else vLLM's 2,L/2,L-3)",
    )
    imported.add_argument(
        "--allow-other-verifier",
        action="store_true",
        help="import a head whose config names another target as its verifier (its fit is still checked)",
    )


def aux_layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of layer ids, got {text!r}") from None


def signing_key() -> str | None:
    """ADAPTIVE_SPEC_SIGNING_KEY as the trainer reads it (and refuses a weak one)."""
    from trainer.settings import TrainerSettings

    return TrainerSettings.from_env().signing_key


# ---------------------------------------------------------------------------------------------------- export


def export_version(registry, args) -> str:
    """Write version `args.version` to `args.directory`; the result line."""
    from adaptive_spec.formats.adapters import AdapterDir
    from adaptive_spec.formats.eagle3 import Eagle3Checkpoint

    directory: Path = args.directory
    _check_writable(directory, args.force)
    described = registry.get(args.version)  # RegistryError (exit 2) when there is no such version
    directory.parent.mkdir(parents=True, exist_ok=True)
    print(f"downloading version {described.version} of {registry.model_name} ...", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix=f".{directory.name}.export-", dir=directory.parent) as scratch:
        version = AdapterDir(registry.download(described.version, Path(scratch)))
        metadata = version.metadata()
        if not version.standard:
            raise CommandError(_not_exportable(described.version, metadata.draft_id or described.tags.get("draft_id")))
        version.verify(expected_sha256=described.sha256)
        registry.check_signature(version.path)
        checkpoint = Eagle3Checkpoint.read(version.path)  # what vLLM is given must load: names, shapes, mapping
        _check_verifier_name(checkpoint.config.verifier, metadata.target_id)
        files = sorted(path.name for path in version.path.iterdir() if path.is_file())
        _publish(version.path, files, directory)
    sidecar = [name for name in files if name not in (EAGLE3_CONFIG_FILE, EAGLE3_WEIGHTS_FILE)]
    signed = "signature checked" if registry.signing_key else "signature not checked (no ADAPTIVE_SPEC_SIGNING_KEY)"
    return (
        f"exported version {described.version} ({metadata.draft_id or EAGLE3_DRAFT} for {metadata.target_id}, "
        f"verifier {checkpoint.config.verifier}) to {directory}: {EAGLE3_CONFIG_FILE}, {EAGLE3_WEIGHTS_FILE}; "
        f"sidecar {', '.join(sidecar) or 'none'}; {signed}"
    )


def _not_exportable(version: str, draft_id: str | None) -> str:
    drafted = f"the {draft_id} draft" if draft_id else "a draft of the project's own layout"
    return (
        f"version {version} is a LoRA adapter on {drafted} (adapter_config.json + adapter_model.safetensors), not an "
        f"EAGLE-3 head: the head draft's network (a reduce over three target states, a fuse with the embedding, a "
        f"copy of the target's last layer) and an early exit's layers have no counterpart in the EAGLE-3 layout, so it "
        f"cannot be converted without approximating it. Train an {EAGLE3_DRAFT} draft (`adaptive-spec train --draft "
        f"{EAGLE3_DRAFT}`, or `distill --draft {EAGLE3_DRAFT}`) to get versions that export"
    )


def _check_writable(directory: Path, force: bool) -> None:
    if directory.exists() and not directory.is_dir():
        raise CommandError(f"{directory} exists and is not a directory")
    present = sorted(path.name for path in directory.iterdir()) if directory.is_dir() else []
    if present and not force:
        shown = ", ".join(present[:4]) + (", ..." if len(present) > 4 else "")
        raise CommandError(
            f"{directory} is not empty ({shown}); choose another directory, or pass --force to write into it "
            f"(files of the same names are replaced; a sidecar file the version does not have is removed)"
        )


def _publish(source: Path, files: list[str], directory: Path) -> None:
    """The version's files into `directory`: renamed whole when it does not exist yet, else file by file (a
    sidecar file of a previous export that this version does not have is removed, so no stale signature stays)."""
    if not directory.exists():
        os.rename(source, directory)
        return
    for name in SIDECAR:
        if name not in files:
            (directory / name).unlink(missing_ok=True)
    for name in files:
        os.replace(source / name, directory / name)


def _check_verifier_name(verifier: str, target_id: str | None) -> None:
    """A note when config.json names another model than the one other engines know the version's target by
    (adaptive_spec/models.py `verifier_name`)."""
    from adaptive_spec.models import ModelLoadError, verifier_name

    if not target_id:
        return
    try:
        expected = verifier_name(target_id)
    except ModelLoadError:  # the target is not installed here: nothing to compare with
        return
    if not _same_model(verifier, (expected,)):
        print(
            f"note: config.json names the verifier {verifier!r}; other engines know the version's target "
            f"{target_id!r} as {expected!r}. `vllm serve TARGET --speculative-config ...` does not read the name; "
            f"`vllm serve DIR` would load {verifier!r}",
            file=sys.stderr,
        )


def _same_model(name: str, names: tuple[str, ...]) -> bool:
    """Whether `name` is one of `names`, as a Hugging Face id (case aside) or as the same local directory."""
    folded = name.rstrip("/").lower()
    if any(folded == other.rstrip("/").lower() for other in names):
        return True
    return Path(name).exists() and any(Path(other).exists() and Path(other).samefile(name) for other in names)


# ---------------------------------------------------------------------------------------------------- import


def import_checkpoint(registry, args) -> str:
    """Register `args.directory` as a new version; returns its registry version (and prints the result line)."""
    from adaptive_spec.formats.eagle3 import Eagle3Checkpoint
    from trainer.settings import TrainerSettings

    source: Path = args.directory
    checkpoint = Eagle3Checkpoint.read(source)  # either layout, checked; Eagle3FormatError names the file
    carried, signature = _checked_sidecar(source, registry.signing_key)
    deployment = TrainerSettings.from_env(target=args.target)
    target_name = deployment.target
    expected = _verifier_of(target_name)
    named = checkpoint.config.verifier
    if named and not _same_model(named, (expected, target_name)) and not args.allow_other_verifier:
        raise CommandError(
            f"{source / EAGLE3_CONFIG_FILE}: the head was trained for {named!r} (speculators_config.verifier."
            f"name_or_path), and the target here is {target_name!r} ({expected!r}): a head drafts well only for the "
            f"target whose states it learned. Name that target with --target, or pass --allow-other-verifier to "
            f"import it anyway (its fit to {target_name!r} is still checked)"
        )
    head, target = _fitted_head(target_name, checkpoint, args.aux_layers)
    _check_deployment(source, head, target, deployment.draft_vocab_size)
    architectures = tuple(getattr(target.config, "architectures", None) or checkpoint.config.verifier_architectures)
    config = replace(
        checkpoint.config,
        verifier=expected,
        aux_layer_ids=head.aux_layer_ids,
        verifier_architectures=architectures or ("LlamaForCausalLM",),
    )
    layout = "speculators" if "speculators_config" in _config_json(source) else "original EAGLE-3"
    provenance = {
        "from": str(source.resolve()),
        "at": time.time(),
        "by": _actor(),
        "layout": layout,
        "verifier": named or None,
        "signature": signature,
        "source": {key: value for key, value in carried.items() if key in _SOURCE_KEYS},
    }
    fields = {key: value for key, value in carried.items() if key not in _SOURCE_KEYS}
    fields = {"format": 1, "created_at": time.time(), **fields, "target_id": target_name, "draft_id": EAGLE3_DRAFT}
    if args.domain:
        fields["domain"] = args.domain
    fields["imported"] = provenance
    with tempfile.TemporaryDirectory(prefix=".import-", dir=_scratch_root(registry)) as scratch:
        staged = Path(scratch) / f"import-{source.resolve().name}"
        version, already = _register(registry, replace(checkpoint, config=config), source, staged, fields)
    vocabulary = f"draft vocabulary {config.draft_vocab_size} of {config.vocab_size}"
    if already:
        said = f"the same weights are already version {version}"
    else:
        said = f"registered as version {version} ({'signed' if registry.signing_key else 'unsigned'})"
    print(
        f"imported {source} ({layout} layout, verifier {named or 'not named'}): {said} of {registry.model_name}, "
        f"{EAGLE3_DRAFT} for {target_name}, aux layers {list(config.aux_layer_ids)}, {vocabulary}"
        f"{', domain ' + args.domain if args.domain else ''}"
        + ("" if args.promote else f"; not served until `adaptive-spec adapters promote {version}`")
    )
    return version


def _checked_sidecar(source: Path, key: str | None) -> tuple[dict, str]:
    """(the metadata of a directory `export` wrote, or {}; what became of its signature). Its checksum and, with
    a key, its signature must hold: a file changed after the export is refused."""
    from adaptive_spec.formats.adapters import AdapterDir

    if not any((source / name).is_file() for name in (METADATA_FILE, CHECKSUM_FILE, SIGNATURE_FILE)):
        return {}, "none (no sidecar)"
    version = AdapterDir(source)
    version.verify(require_checksum=False)  # AdapterError (exit 2) names the file that does not hash right
    if not (source / SIGNATURE_FILE).is_file():
        return version.metadata().to_dict(), "none (unsigned)"
    if not key:
        return version.metadata().to_dict(), "not checked (no ADAPTIVE_SPEC_SIGNING_KEY)"
    version.check_signature(key)
    return version.metadata().to_dict(), "checked"


def _verifier_of(target_name: str) -> str:
    from adaptive_spec.models import verifier_name

    return verifier_name(target_name)


def _fitted_head(target_name: str, checkpoint, aux_layer_ids):
    """(the head built from the checkpoint on the target, the target); Eagle3FormatError says what does not fit."""
    import torch

    from adaptive_spec.drafters.eagle3_head import Eagle3Head
    from adaptive_spec.models import load_model

    print(f"loading {target_name} to check that the head fits it ...", file=sys.stderr)
    target = load_model(target_name, torch.device("cpu"), torch.float32)[0]
    return Eagle3Head.from_checkpoint(target, checkpoint, aux_layer_ids), target


def _check_deployment(source: Path, head, target, draft_vocab_size: int) -> None:
    """The head reads the states the engine captures and drafts over the deployment's one draft vocabulary size:
    the engine refuses a version on other aux layers, and the trainer adopts only a champion it can train from
    (and vLLM sizes the draft vocabulary when it loads, so every version of a deployment has the same)."""
    from adaptive_spec.drafters.eagle3_head import aux_layer_ids_for

    taps = aux_layer_ids_for(target)
    if head.aux_layer_ids != taps:
        raise CommandError(
            f"{source}: the head reads the target's states entering layers {head.aux_layer_ids} (vLLM's numbering), "
            f"and the engine and the trainer here read {taps} (docs/eagle3.md, 'Aux layers'): it cannot draft here. "
            f"A checkpoint that names no aux layers, or names them wrongly, takes --aux-layers"
        )
    vocab = int(target.config.vocab_size)
    size, wanted = len(head.draft_ids), min(draft_vocab_size, vocab)
    if size != wanted:
        raise CommandError(
            f"{source}: the head drafts over {size} tokens, and this deployment's draft vocabulary has {wanted} "
            f"(ADAPTIVE_SPEC_DRAFT_VOCAB_SIZE, at most the target's {vocab}): every version of a deployment has one "
            f"size, which the trainer trains and vLLM sizes the draft with when it loads. To make {size} this "
            f"deployment's, set ADAPTIVE_SPEC_DRAFT_VOCAB_SIZE={size} for the trainer, the servers and this command"
        )


def _register(registry, checkpoint, source: Path, staged: Path, fields: dict) -> tuple[str, bool]:
    """The version directory written, sealed and registered (signed by the registry when it has a key); returns
    (its registry version, whether those weights were registered before)."""
    from adaptive_spec.formats.adapters import AdapterDir

    checkpoint.write(staged)
    for name in (NGRAMS_FILE, VOCAB_FILE):  # what the exported version shipped, checked by _checked_sidecar
        if (source / name).is_file() and (source / METADATA_FILE).is_file():
            shutil.copyfile(source / name, staged / name)
    sha256 = AdapterDir(staged).seal(**fields)
    before = registry.version_of(sha256)
    version = registry.register(staged, by=_actor(), promote=False)
    return version, before is not None


def _scratch_root(registry) -> Path:
    registry.data_dir.mkdir(parents=True, exist_ok=True)
    return registry.data_dir


def _config_json(source: Path) -> dict:
    return json.loads((source / EAGLE3_CONFIG_FILE).read_text())  # read (and parsed) by Eagle3Checkpoint.read before


def _actor() -> str:
    from registry.client import actor

    return actor("cli")
