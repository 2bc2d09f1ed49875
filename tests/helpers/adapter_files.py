"""Adapter directories for tests: a random non-zero LoRA on a fresh early-exit draft, saved as the
trainer saves it (`make_adapter`: PEFT files and a checksum), or with the trainer's full metadata and
seal (`write_adapter`).

    from adapter_files import make_adapter, write_adapter
    peft_model = make_adapter(target, 2, tmp_path / "v1", seed=1)
    write_adapter(target, 1, tmp_path / "v2", seed=2, greedy_match=0.6, domain="sql")
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from adaptive_spec.contracts import CHECKSUM_FILE, WEIGHTS_FILE
from adaptive_spec.drafters.early_exit import build_early_exit
from adaptive_spec.formats.adapters import AdapterDir, sha256_file

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(target, layers: int, path: Path, seed: int, rank: int = 4) -> torch.nn.Module:
    """A random (non-zero) LoRA on a fresh early-exit draft, saved as the trainer saves it."""
    torch.manual_seed(seed)
    draft = build_early_exit(target, layers)
    peft_model = get_peft_model(
        draft, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES, init_lora_weights=False)
    )
    peft_model.save_pretrained(path)
    (path / CHECKSUM_FILE).write_text(sha256_file(path / WEIGHTS_FILE) + "\n")
    return peft_model.eval()


def write_adapter(
    target,
    layers: int,
    path: Path,
    seed: int,
    *,
    rank: int = 4,
    target_id: str = "target",
    draft_id: str | None = None,
    greedy_match: float = 0.5,
    version: int = 1,
    vocab: list[int] | None = None,
    domain: str | None = None,
) -> Path:
    """A random non-zero LoRA on a fresh early-exit draft, with the metadata, checksum (and optionally the
    draft vocabulary) the online trainer writes next to it; `domain` makes it that domain's adapter."""
    make_adapter(target, layers, path, seed, rank)
    adapter = AdapterDir(path)
    if vocab is not None:
        adapter.write_vocab(vocab)
    adapter.seal(
        **{
            "format": 1,
            "target_id": target_id,
            "draft_id": draft_id or f"early-exit:{layers}",
            "version": version,
            "settings": {"r": rank, "alpha": 2 * rank, "lr": 1e-3, "target_modules": MODULES, "loss": "kl_topm"},
            "records_used": 40 + seed,
            "tokens_used": 640 + seed,
            "steps": 20,
            "loss": 1.5,
            "first_loss": 2.0,
            "last_loss": 1.4,
            "base_version": None,
            "parent_version": version - 1 or None,
            "domain_mix": {"json": 30, "sql": 10},
            "gate": {
                "candidate": {"greedy_match": greedy_match, "expected_acceptance": greedy_match / 2, "positions": 400},
                "champion": {"greedy_match": greedy_match - 0.1, "expected_acceptance": 0.2, "positions": 400},
                "reason": "better",
            },
            **({"domain": domain} if domain is not None else {}),
        }
    )
    return path
