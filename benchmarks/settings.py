"""The benchmarks' settings that their commands take defaults from (cli/studies.py), in a module that
loads no benchmark code, so that building the command line's parser stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from adaptive_spec.contracts import DEFAULT_MODEL
from adaptive_spec.options import ModelOptions


@dataclass(frozen=True)
class IntakeBenchSettings(ModelOptions):
    """The model options of the trainer measured (its k is not used), then the benchmark's own."""

    records: int = 2000
    prompt_tokens: tuple[int, int] = (100, 200)  # uniform, both ends included
    output_tokens: int = 64
    topk: int = 16  # the server's record_topk (service/settings.py)
    loop_minutes: float = 3.0  # the trainer loop's budget (a round under way finishes first)
    seed: int = 0

    def __post_init__(self) -> None:
        low, high = self.prompt_tokens
        if self.records < 1 or self.output_tokens < 1 or self.topk < 1 or not 1 <= low <= high:
            raise ValueError("records, output_tokens, topk and the prompt lengths must be >= 1, with min <= max")
        if self.loop_minutes <= 0:
            raise ValueError("loop_minutes must be positive")


# The head's recipes (benchmarks/head_ablation.py). Each names every setting it is about, so that a recipe
# keeps its meaning when HeadSettings' defaults move (rank-64 ran two draft steps once the default did).
# BASE is the head's default before rank 64; the recipes in its family differ from it in one thing.
BASE = {"r": 16, "alpha": 32, "unroll": 1}
RANK_64 = {"r": 64, "alpha": 128}
TWO_STEPS = RANK_64 | {"unroll": 2, "unroll_decay": 0.5}  # HeadSettings() before unroll 3
RECIPES = {
    "rank-16": BASE,
    "no-regression": BASE | {"regression_weight": 0.0},
    "no-noise": BASE | {"noise": 0.0},
    "noise-0.3": BASE | {"noise": 0.3},
    "rank-4": BASE | {"r": 4, "alpha": 8},
    "rank-64": BASE | RANK_64,  # HeadSettings() before two trained draft steps
    "unroll-2": BASE | {"unroll": 2, "unroll_decay": 0.8},
    "lr-3e-3": BASE | {"lr": 3e-3},
    "unroll-2-rank-64": RANK_64 | {"unroll": 2, "unroll_decay": 0.8},
    "unroll-3-rank-64": RANK_64 | {"unroll": 3, "unroll_decay": 0.8},
    "unroll-2-decay-0.5-rank-64": TWO_STEPS,
    "unroll-2-decay-0.3-rank-64": RANK_64 | {"unroll": 2, "unroll_decay": 0.3},
    "unroll-3-decay-0.5-rank-64": RANK_64 | {"unroll": 3, "unroll_decay": 0.5},  # HeadSettings() before rank 128
    # HeadSettings() before rank 128 with a LoRA of rank 128 (same scale: HeadSettings() now), or the optimiser's
    # learning rate doubled
    "unroll-3-decay-0.5-rank-128": {"r": 128, "alpha": 256, "unroll": 3, "unroll_decay": 0.5},
    "unroll-3-decay-0.5-rank-64-lr-2e-3": RANK_64 | {"unroll": 3, "unroll_decay": 0.5, "lr": 2e-3},
    # HeadSettings() until 2026-11-30, with EAGLE-3's fused features: the target's low, middle and last layers (feeding.state_layers)
    "fused-features-rank-128": {"r": 128, "alpha": 256, "unroll": 3, "unroll_decay": 0.5, "features": "fused"},
    # HeadSettings() now: four draft steps trained
    "fused-features-rank-128-unroll-4": {"r": 128, "alpha": 256, "unroll": 4, "unroll_decay": 0.5, "features": "fused"},
    # the standard EAGLE-3 layout, trained whole (trainer/learning/eagle3_distill.py Eagle3Settings())
    "eagle3": {"layout": "eagle3"},
    "eagle3-train-lm-head": {"layout": "eagle3", "train_lm_head": True},
    "eagle3-lr-1e-4": {"layout": "eagle3", "lr": 1e-4},
    "eagle3-lr-1e-3": {"layout": "eagle3", "lr": 1e-3},
    "softmax-vocab": TWO_STEPS | {"softmax": "vocab"},  # HeadSettings() before the batch softmax
    # HeadSettings() of the time (two draft steps) with its forwards in fp32 or under bf16 autocast (LoraSettings.autocast)
    "default-fp32": TWO_STEPS | {"autocast": "off"},
    "default-bf16-autocast": TWO_STEPS | {"autocast": "bf16"},
}


@dataclass(frozen=True)
class AblationSettings:
    target: str = DEFAULT_MODEL
    domain: str = "python"  # a shipped prompt set
    prompts: Path | None = None  # a JSONL prompt file instead of the domain's set (bench-drift --prompts)
    recipes: tuple[str, ...] = tuple(RECIPES)
    train_records: int = 160  # about 30 min of bench-drift traffic; of a records file read back, at most this many
    heldout_records: int = 32
    max_new_tokens: int = 64
    steps: int = 200  # optimiser steps per recipe
    eval_every: int = 50
    batch_tokens: int = 2048
    depth: int = 4  # draft steps scored on the head's own states
    eval_prompts: int = 24  # bench-drift's held-out prompts, left out
    seed: int = 0
    records_file: Path | None = None  # keep the generated records here, or read them
    json: Path | None = None  # the figures, written after each recipe so a long run leaves what it has

    def __post_init__(self) -> None:
        unknown = [name for name in self.recipes if name not in RECIPES]
        if unknown:
            raise ValueError(f"unknown recipes {unknown}; known: {', '.join(RECIPES)}")
