"""LoRA adapters on the draft: checked, merged into a fresh slot, swapped between steps.

An adapter is a standard PEFT directory (`adapter_config.json`, `adapter_model.safetensors`),
as the trainer writes it, plus `adaptive_spec_adapter.json` (metadata), `checksum.sha256`, and
optionally `draft_vocab.json`: the tokens recent traffic used, to which the draft's LM head is
restricted while this adapter is served (see `ModelDrafter.restrict_vocab`).

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
import re
from pathlib import Path

import torch
from torch import nn

from adaptive_spec.contracts import CHECKSUM_FILE, CONFIG_FILE, METADATA_FILE, VOCAB_FILE, WEIGHTS_FILE

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served: missing, corrupt, or not shaped for this draft."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_adapter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(adapter_config, LoRA tensors, metadata) from a directory, with the checksum verified."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise AdapterError(f"{path}: not an adapter directory (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    checksum_file = path / CHECKSUM_FILE
    if checksum_file.is_file():
        expected = checksum_file.read_text().split()[0] if checksum_file.read_text().split() else ""
        actual = sha256_file(weights_file)
        if actual != expected:
            raise AdapterError(
                f"{path}: checksum mismatch for {WEIGHTS_FILE} (expected {expected[:12]}..., "
                f"got {actual[:12]}...): the file is corrupt or was changed"
            )
    try:
        config = json.loads(config_file.read_text())
        metadata = json.loads((path / METADATA_FILE).read_text()) if (path / METADATA_FILE).is_file() else {}
        tensors = load_file(str(weights_file))
    except (json.JSONDecodeError, SafetensorError, OSError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{path}: unreadable adapter: {exc}") from None
    return config, tensors, metadata


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
    file = Path(path) / VOCAB_FILE
    if not file.is_file():
        return None
    try:
        ids = json.loads(file.read_text())["token_ids"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{file}: unreadable draft vocabulary: {exc}") from None
    if not ids or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise AdapterError(f"{file}: token_ids must be a non-empty list of ids in [0, {vocab_size})")
    return ids
