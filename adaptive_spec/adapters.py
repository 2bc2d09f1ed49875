"""LoRA adapters on the draft: one version on disk (`AdapterDir`), checked, merged into a fresh
slot, swapped between steps.

    version = AdapterDir(data_dir / "adapters" / "v0003")
    version.seal(version=3, gate=...)   # the trainer: checksum.sha256 and the metadata's adapter_sha256
    version.verify(expected_sha256=sha)  # a server or the trainer, before trusting downloaded files
    version.metadata()["gate"]          # who trained it, from what, and the gate's figures
    engine.load_adapter(version.path)   # read_adapter -> lora_pairs -> check -> merge_into_slot

An adapter version is a standard PEFT directory (`adapter_config.json`, `adapter_model.safetensors`)
plus `adaptive_spec_adapter.json` (metadata), `checksum.sha256` (sha256sum format), and optionally
`draft_vocab.json`: the tokens recent traffic used, to which the draft's LM head is restricted
while this adapter is served (see `ModelDrafter.restrict_vocab`). The file names are contracts
(adaptive_spec/contracts.py): the trainer writes these directories, MLflow stores them as a
run's artifacts, and servers download and load them. Every check of such a directory is here, so
a trainer adopting a version and a server swapping to it refuse the same files for the same reasons.

Loading never touches the layers being served:

1. check the files, the checksum, and that every LoRA weight fits a module of the draft with
   the right shape (`check`); any failure raises `AdapterError` and nothing changes;
2. build a new slot: a copy of the draft's *base* layers with `W += scaling * B @ A` merged in
   (`merge_into_slot`), so an adapted draft step costs exactly what a base step costs;
3. swap: under the engine's step lock, point the draft at the new slot and clear the draft's
   KV cache (it was computed with the old weights; the next step re-feeds the context). The
   lock is held for a pointer exchange, so the pause between two decoding steps is tiny;
4. drop the old slot.

The target is never modified: early-exit drafts own private copies of their layers, and the
shared embedding, norm and LM head carry no LoRA weights (a check refuses adapters that do).
Outputs stay lossless whatever the draft's weights, because the target verifies every token.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from pathlib import Path

import torch
from torch import nn

from adaptive_spec.contracts import (
    CHECKSUM_FILE,
    CONFIG_FILE,
    METADATA_FILE,
    SHA_TAG,
    VOCAB_FILE,
    WEIGHTS_FILE,
)

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")
_VERSION_DIR = re.compile(r"v(\d+)")

REASONS = ("missing", "checksum", "corrupt", "incompatible")  # why an adapter is refused (a metric label)


class AdapterError(ValueError):
    """An adapter that cannot be served: missing, corrupt, or not shaped for this draft.

    `reason` is one of REASONS: "missing" (files not there), "checksum" (the weights are not what
    was recorded), "corrupt" (a file does not parse) or "incompatible" (another model's adapter).
    """

    def __init__(self, message: str, reason: str = "incompatible") -> None:
        super().__init__(message)
        self.reason = reason


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class AdapterDir:
    """One adapter version on disk: the trainer writes it, the registry stores it, servers load it."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"AdapterDir({str(self.path)!r})"

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def weights(self) -> Path:
        return self.path / WEIGHTS_FILE

    # ---------------------------------------------------------------- writing

    def seal(self, **metadata) -> str:
        """After PEFT's save_pretrained: write checksum.sha256 and the metadata (with `metadata`
        merged in and adapter_sha256 set). Returns the weights' sha256."""
        digest = sha256_file(self.weights)
        (self.path / CHECKSUM_FILE).write_text(f"{digest}  {WEIGHTS_FILE}\n")
        self.write_metadata({**self.metadata(), **metadata, SHA_TAG: digest})
        return digest

    def write_metadata(self, metadata: dict) -> None:
        (self.path / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")

    def update_metadata(self, **fields) -> dict:
        metadata = {**self.metadata(), **fields}
        self.write_metadata(metadata)
        return metadata

    def write_vocab(self, token_ids: list[int]) -> None:
        (self.path / VOCAB_FILE).write_text(json.dumps({"token_ids": token_ids}) + "\n")

    # ---------------------------------------------------------------- reading and checking

    def metadata(self) -> dict:
        """adaptive_spec_adapter.json, or {} when there is none (a plain PEFT directory)."""
        file = self.path / METADATA_FILE
        if not file.is_file():
            return {}
        try:
            metadata = json.loads(file.read_text())
        except (json.JSONDecodeError, OSError, UnicodeDecodeError) as exc:
            raise AdapterError(f"{self.path}: unreadable {METADATA_FILE}: {exc}", "corrupt") from None
        if not isinstance(metadata, dict):
            raise AdapterError(f"{self.path}: {METADATA_FILE} is not a JSON object", "corrupt")
        return metadata

    def verify(self, expected_sha256: str | None = None, *, require_checksum: bool = True) -> str:
        """The files are there and the weights hash to what checksum.sha256, the metadata's
        adapter_sha256 and `expected_sha256` (e.g. the registry's tag) say; returns the sha256.

        Example: weights hashing to 9f2c... with a checksum.sha256 of 9f2c... and metadata naming
        41aa... fail with reason "checksum": one of the three was changed after the trainer sealed it.
        Without `require_checksum` a directory with no checksum.sha256 passes (a hand-made adapter).
        """
        missing = AdapterError(
            f"{self.path}: not an adapter directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})", "missing"
        )
        if not self.weights.is_file():
            raise missing
        checksum = self.path / CHECKSUM_FILE
        if require_checksum and not checksum.is_file():
            raise AdapterError(f"{self.path}: no {CHECKSUM_FILE}", "missing")
        claims = {
            CHECKSUM_FILE: (checksum.read_text().split() or [""])[0] if checksum.is_file() else None,
            METADATA_FILE: self.metadata().get(SHA_TAG),
            "the registry": expected_sha256,
        }
        actual = sha256_file(self.weights)
        for source, claimed in claims.items():
            if claimed is not None and claimed != actual:
                raise AdapterError(
                    f"{self.path}: checksum mismatch: {WEIGHTS_FILE} hashes to {actual[:12]}..., {source} "
                    f"says {str(claimed)[:12]}...; the file is corrupt or was changed",
                    "checksum",
                )
        if not (self.path / CONFIG_FILE).is_file():  # after the checksum: corrupt weights say more than a lost config
            raise missing
        return actual

    def check_models(self, target_id: str, draft_id: str) -> None:
        """The metadata, when it names them, names this target and draft."""
        check_models(self.metadata(), target_id, draft_id, str(self.path))

    def read(self) -> tuple[dict, dict[str, torch.Tensor], dict]:
        """(adapter_config, LoRA tensors, metadata), verified (checksum.sha256 optional)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        self.verify(require_checksum=False)
        try:
            config = json.loads((self.path / CONFIG_FILE).read_text())
            tensors = load_file(str(self.weights))
        except (json.JSONDecodeError, SafetensorError, OSError, UnicodeDecodeError) as exc:
            raise AdapterError(f"{self.path}: unreadable adapter: {exc}", "corrupt") from None
        return config, tensors, self.metadata()

    def vocab(self, vocab_size: int) -> list[int] | None:
        """The draft vocabulary this version ships, or None when it ships none."""
        file = self.path / VOCAB_FILE
        if not file.is_file():
            return None
        try:
            ids = json.loads(file.read_text())["token_ids"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise AdapterError(f"{file}: unreadable draft vocabulary: {exc}", "corrupt") from None
        if not ids or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise AdapterError(f"{file}: token_ids must be a non-empty list of ids in [0, {vocab_size})")
        return ids

    def describe(self) -> dict:
        return describe(self.metadata())


def describe(metadata: dict) -> dict:
    """What an operator looks at for a version: the gate's figures, the loss, the lineage, the traffic."""
    return {
        "gate": metadata.get("gate") or {},
        "loss": metadata.get("loss"),
        "parent_version": metadata.get("parent_version"),
        "domain_mix": metadata.get("domain_mix"),
        "records_consumed": metadata.get("records_consumed"),
    }


def trainer_versions(adapters_dir: str | Path) -> dict[int, AdapterDir]:
    """The trainer's version directories (v0001, v0002, ...) by number; {} when there are none."""
    found = {}
    for path in Path(adapters_dir).glob("v*"):
        match = _VERSION_DIR.fullmatch(path.name)
        if match and path.is_dir():
            found[int(match[1])] = AdapterDir(path)
    return dict(sorted(found.items()))


def read_adapter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(adapter_config, LoRA tensors, metadata) from a directory, with the checksum verified."""
    return AdapterDir(path).read()


def lora_pairs(config: dict, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """module name -> (A [r, in], B [out, r], scaling), checked against the config."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"only LoRA adapters are supported, got {config.get('peft_type')!r}")
    if config.get("use_dora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError("DoRA and per-module rank/alpha patterns are not supported")
    rank, alpha = int(config.get("r", 0)), float(config.get("lora_alpha", 0))
    if rank <= 0:
        raise AdapterError(f"adapter rank must be positive, got {rank}")
    scaling = alpha / (rank**0.5 if config.get("use_rslora") else rank)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(f"unexpected tensor {key!r}: this adapter trains more than LoRA matrices")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    pairs = {}
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{module}: needs both lora_A and lora_B")
        if ab["A"].shape[0] != rank or ab["B"].shape[1] != rank:
            raise AdapterError(
                f"{module}: LoRA shapes {tuple(ab['A'].shape)} / {tuple(ab['B'].shape)} do not match r={rank}"
            )
        pairs[module] = (ab["A"], ab["B"], scaling)
    if not pairs:
        raise AdapterError("the adapter holds no LoRA weights")
    return pairs


def check(draft: nn.Module, pairs: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
    """Every LoRA pair must sit on a Linear of the draft's own layers, with matching shapes."""
    modules = dict(draft.named_modules())
    for name, (lora_a, lora_b, _) in pairs.items():
        if not name.startswith("model.layers."):
            raise AdapterError(f"{name}: adapters may only touch the draft's own layers (model.layers.*)")
        module = modules.get(name)
        if not isinstance(module, nn.Linear):
            raise AdapterError(f"{name}: no such linear module in this draft ({len(draft.model.layers)} layers)")
        if lora_a.shape[1] != module.in_features or lora_b.shape[0] != module.out_features:
            raise AdapterError(
                f"{name}: adapter is {lora_b.shape[0]}x{lora_a.shape[1]}, the module is "
                f"{module.out_features}x{module.in_features}"
            )


def merge_into_slot(base_layers: nn.ModuleList, pairs) -> nn.ModuleList:
    """A copy of the base layers with each LoRA delta merged: W + scaling * B @ A."""
    slot = copy.deepcopy(base_layers)
    modules = dict(slot.named_modules())
    with torch.no_grad():
        for name, (lora_a, lora_b, scaling) in pairs.items():
            linear = modules[name.removeprefix("model.layers.")]
            delta = (lora_b.float() @ lora_a.float()) * scaling  # [out, in]
            linear.weight += delta.to(device=linear.weight.device, dtype=linear.weight.dtype)
    return slot.requires_grad_(False)


def read_vocab(path: str | Path, vocab_size: int) -> list[int] | None:
    """The adapter's draft vocabulary, or None when it ships none."""
    return AdapterDir(path).vocab(vocab_size)


def check_models(fields: dict, target_id: str, draft_id: str, what: str) -> None:
    """`fields` (an adapter's metadata, or a registry version's tags), when they name a target and a
    draft, name these; AdapterError says which differs. `what` names the adapter in the message."""
    for key, ours in (("target_id", target_id), ("draft_id", draft_id)):
        if fields.get(key) not in (None, ours):
            raise AdapterError(f"{what} was trained for {key} {fields[key]!r}, not {ours!r}")
