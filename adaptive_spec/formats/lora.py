"""A LoRA adapter's weights as PEFT saves them: read into (A, B, scaling) pairs, checked against the draft's own
layers, merged into a copy of them. An adapter version's files and their checks are adapters.py's.

    pairs = lora.lora_pairs(config, tensors)      # {"model.layers.3.self_attn.q_proj": (A [r, in], B [out, r], 2.0)}
    lora.check(draft, pairs)                      # AdapterError unless every pair fits a linear of the draft's layers
    slot = lora.merge_into_slot(base_layers, pairs)   # W + scaling * B @ A, the base layers untouched
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

from adaptive_spec.formats.adapters import AdapterError

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$")


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
            layers = sum(1 for path in modules if re.fullmatch(r"model\.layers\.\d+", path))
            raise AdapterError(f"{name}: no such linear module in this draft ({layers} layers)")
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
