"""Distil the target into a head draft (adaptive_spec/drafters/draft_head.py): LoRA on the head's decoder
layer, its fuse trained whole, from the same correction records as an early-exit adapter.

    from trainer.learning.head_distill import HeadSettings, HeadTrainer
    from trainer.learning.head_model import TrainableHead

    trainer = HeadTrainer(TrainableHead(target), HeadSettings(), target_id="smollm2-135m-instruct",
                          draft_id="head", init_adapter=None)      # or the champion's version directory
    loss = trainer.train_step(replay.sample_batch(rng, 2048))       # TrainingExamples, as for DraftTrainer
    trainer.save("adapters/candidate")     # a PEFT directory on DraftHead: LoRA on layer.*, fuse saved whole
    engine.load_adapter("adapters/candidate", "3")                   # an Engine whose draft is "head"

`OnlineTrainer` (trainer/loop/online.py) takes a `TrainableHead` where it takes an early-exit draft and
builds this trainer for it; the gate, the version directories, the registry and the servers' checks
then treat a head version as any adapter version.

Small CPU check (tiny random models, one thread, about 30 s):
`.venv/bin/python -m pytest tests/trainer/test_head_distill.py -q`.

What the head reads. To draft token t + 1 the head takes the target's state at position t - 1 and the
embedding of token t: the outputs of the target's state layers there side by side (`F[t-1]`, EAGLE-3's
fused features: feeding.state_layers, a low, a middle and the last), which the head's `reduce` turns into one
state (adaptive_spec/drafters/draft_head.py says why it starts as the last layer's block alone). `S[t]` is the
last of them, what enters the target's final norm. The records hold tokens and the target's top-m, not
states, so the trainer runs the target once over each sequence it trains or gates on (prompt + output,
`TargetStates`) and keeps the states with the example, in fp16, until the replay buffer or the held-out set
lets the example go. Teacher-forced, the input at position t is (F[t-1], token t) (zeros before position 0),
and the targets at t are the next token's logged top-m and S[t]. `reduce` is trained whole, as the fuse is
(a lineage continued from a version saved without one keeps reading the last layer alone).

The loss of a step, with each output position weighted as in distill.py (`rejected_weight`,
`accepted_weight`) and `w` the step weights of the unrolled draft steps (1, then `unroll_decay`):

    sum over draft steps j of w_j * ( KL_j                                       (distill.position_losses)
                                     + regression_weight * smoothL1(P_j[t] / r[t], S[t] / r[t]) )

- KL_j: the forward KL from the target's logged top-m to the head's next-token distribution
  (its predicted state through the target's final norm and LM head), the loss of distill.py;
- the regression pulls the head's predicted state P_j[t] onto the target's S[t] at every position,
  both divided by the RMS of S[t] (`r[t]`): the default model's states have an RMS near 40 with a
  few dimensions in the thousands, so an unscaled loss would be set by those few dimensions;
- noise: the true states fed in are perturbed by uniform noise of half-width `noise * r[t-1]`
  (each layer's state by its own RMS) during training, so the head learns to read states that are not exact, as its own are when it
  drafts a second token (EAGLE, Li et al. 2024, section 4);
- unroll: with `unroll = 2` a second draft step is trained on the head's own predicted states, as
  it drafts: at position t it reads (P_1[t-1], token t) and attends to the first step's keys at
  positions up to t - 1 and to itself, which is what its cache holds when it drafts (EAGLE-3's
  "training-time test", Li et al. 2025); `unroll = 3` a third on the second's, and so on (4, the
  default, four). Each step costs another pass of the layer and of the LM head.

The softmax. With `softmax = "batch"` (the default) the head's next-token distribution in KL_j is a
softmax over the tokens of the step's batch alone: every position's logged top-m, a few thousand of
the default model's 49152 (`softmax_columns`). The loss is then the whole vocabulary's with every
other token's logit at -inf, which is what a served head does anyway: it proposes only the tokens of
its draft vocabulary (the target's choices in recent traffic, drafters/vocab.py), nearly all of
them in the logged top-m of the records it trains on. The LM head over 49152 rows, forward and
backward, was two thirds of a step. Measured on the default model at 2 threads: a step of 2,048 tokens took
0.47 s instead of 1.5 s, and 150 steps on 96 python records 98 s instead of 234 s (scoring
included) for the same held-out first-token match, 0.70 against 0.71 (0.66 against 0.62 at 100
steps; benchmarks/head_ablation.py, docs/figures/head-ablation-softmax-python.json).
`softmax = "vocab"` is the whole vocabulary.

The fuse starts as [I | c I] rather than the base head's [I | I]: the default model's embeddings
have an RMS of 0.13 against 40 for its states, so a fuse of identities hands the layer the state
alone, and the Adam steps a round can take do not grow the embedding's half 300-fold. `c` is the
ratio of the target's typical state RMS to its embedding RMS, measured once on a fixed probe.

Cost, measured on the default model (fp32, one thread, in bench-drift's trainer thread): the
target forward is about 2.5 ms a token (0.4 s for a 160-token record) and the states take 3.5 KB a
token in fp16 (three layers of 576): 690 MB for a full 200,000-token replay buffer. The target is the serving engine's
own in bench-drift and `adaptive-spec up`; `adaptive-spec train` loads one (540 MB in fp32).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.intake.examples import TrainingExample
from trainer.learning.distill import LoraSettings, TrainedWeights, position_losses
from trainer.learning.head_model import HeadBatch, TargetStates, TrainableHead, head_batch, unrolled

SOFTMAX_OVER = ("batch", "vocab")


@dataclass
class HeadSettings(LoraSettings):
    """LoraSettings (rank, lr, batch, KL, position weights) plus what only a head needs.

    A larger rank than the early exit's 16: on the same 128 python records, after 200 steps, the head's
    first-token match on held-out records was 0.80 at rank 64 against 0.76 at rank 16, ahead at every
    point of the curve (benchmarks/head_ablation.py, docs/figures/head-ablation-python.json).
    Rank 128 since 2026-11-29: on 160 python records, 400 steps, three draft steps trained, it matched the
    first token 0.79 against 0.76 at rank 64 and a greedy verify of k = 4 accepted 2.22 draft tokens a round
    against 1.97, ahead at every point (docs/figures/head-ablation-rank128-lr-python.json), for 11% more
    time a step; online (bench-drift --domain python --budget-minutes 30, AMD EPYC) 2.41x and 2.12x the target
    alone in two runs, 3.21 and 2.71 tokens a forward, against 2.02-2.43x and 2.31-3.09 in three runs at rank 64
    on that machine: online the runs' spread is larger than the rank's effect (docs/benchmarks.md, "Rank 128").
    On the default model rank 128 is 1.3 M LoRA weights over the layer's 7 projections (beside the fuse's
    0.66 M, trained whole), and a served version merges them into the layer, so the rank costs nothing per
    draft step. A lineage that continues from a saved version keeps that version's rank (distill.py
    `_lora_config`).

    Four draft steps trained since 2026-11-30 (`unroll = 4`, each weighted 0.5 of the one before). On an Intel
    Xeon with AMX (a verify of 9 tokens 1.27 plain steps, of 17 1.7), bench-drift --domain python
    --budget-minutes 30 gave 2.53x the target alone (128.9 against 50.9 tok/s), a mean acceptance length of 4.34
    and acceptance by depth 0.76 / 0.65 / 0.58 / 0.47 / 0.38 / 0.31 / 0.23 / 0.19 (7.33 tokens verified a
    step), against 2.22x, 3.11 and 0.77 / 0.62 / 0.51 / 0.29 with three steps the same day, one run each
    (docs/benchmarks.md, "Four draft steps trained"). Standard-library questions: 1.34x, 1.91 against 1.36x,
    1.79. Five steps, in a run whose machine had slowed to half its memory bandwidth, 1.93x and 2.78: not
    comparable, not adopted. On an AMD EPYC at rank 64 before the fused features, four steps had not paid
    (1.88x against 1.95-2.07x), where a wide verify cost more.

    Three draft steps trained (`unroll = 3`, the default until 2026-11-30). Two steps made the
    second token work (on the same records, after 600 steps, first-token match 0.805 against 0.796 for
    one step, the second token given the first 0.825 against 0.116, 1.80 draft tokens accepted per
    round at k = 4 against 0.89; docs/figures/head-ablation-unroll-python.json), but online the third
    draft token was accepted 0.19-0.21 of the time and the fourth almost never: it reads a state the
    second step predicted, which training never showed it. Three steps, on 160 other python records
    after 600 steps: first-token match 0.804 against 0.799 for one step, depths 2 / 3 / 4 0.83 / 0.85
    / 0.60, 2.34 tokens accepted per round at k = 4 (docs/figures/head-ablation-unroll3-600-python.json).
    It trails early (0.762 against 0.790 for two steps at 400 steps) and a step costs 1.5 times one
    of two steps. Online (bench-drift --domain python --budget-minutes 30, the same day): 1.95x the
    target alone against 1.80x for two steps, mean acceptance length 2.61 against 2.37, depths 3 / 4
    accepted 0.59 / 0.35 against 0.19 / 0.04 (docs/benchmarks.md, "Three draft steps trained")."""

    r: int = 128
    alpha: int = 256  # LoRA scale = alpha / r = 2, as the early exit's
    regression_weight: float = 1.0  # the state regression against the KL, per position
    noise: float = 0.1  # half-width of the uniform noise on input states, relative to their RMS
    unroll: int = 4  # draft steps trained per position: from 2 on, steps on its own predicted states
    unroll_decay: float = 0.5  # weight of each further draft step relative to the one before
    # The softmax of the KL: "batch" runs it over the tokens of the step's batch (every position's
    # logged top-m), "vocab" over the whole vocabulary (module docstring, "The softmax").
    softmax: str = "batch"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.softmax not in SOFTMAX_OVER:
            raise ValueError(f"softmax must be one of {SOFTMAX_OVER}, got {self.softmax!r}")
        if self.regression_weight < 0 or self.noise < 0 or self.unroll_decay < 0:
            raise ValueError("regression_weight, noise and unroll_decay must be >= 0")
        if self.unroll < 1:
            raise ValueError(f"unroll must be >= 1, got {self.unroll}")


def _smooth_l1_scaled(predicted: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """[n, hidden] x 2 -> [n]: smooth L1 of the prediction onto the state, both over the state's RMS."""
    scale = states.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)
    loss = torch.nn.functional.smooth_l1_loss(predicted.float() / scale, states / scale, reduction="none")
    return loss.mean(-1)


def softmax_columns(head, topk_ids: torch.Tensor, softmax: str = "batch"):
    """(predicted states [n, hidden] -> logits [n, columns], the top-m ids [positions, m] as indices
    into those columns) for the KL's softmax: over the whole vocabulary ("vocab"), or over only the
    tokens in these top-m ids ("batch"), whose logits come from just their rows of the LM head."""
    if softmax == "vocab":
        return head.logits, topk_ids
    columns = torch.unique(topk_ids)  # sorted
    lm_head = head.shared.lm_head
    rows = lm_head.weight[columns]  # [columns, hidden]; the target's head, frozen
    bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias[columns]

    def logits(states: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(head.shared.norm(states), rows, bias)

    return logits, torch.searchsorted(columns, topk_ids)


def unrolled_loss(
    head,
    batch: HeadBatch,
    settings: HeadSettings,
    weights: torch.Tensor,
    softmax: tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, torch.Tensor],
    total_weight: float,
    total_tokens: int,
) -> torch.Tensor:
    """The module docstring's loss of a batch, `settings.unroll` draft steps deep: noise on the input states, then
    per step the weighted KL (its `weights` [positions], over `total_weight`) and the state regression (over
    `total_tokens`), each step weighted `unroll_decay` times the one before. `softmax` is (predicted states
    [n, hidden] -> logits [n, columns], the top-m ids as indices into those columns [positions, m], the top-m
    log-probabilities [positions, m]); a position whose log-probabilities are all -inf (none of its top-m can be
    drafted) has no KL term."""
    logits, topk_ids, topk_logprobs = softmax
    features = batch.features
    hidden = batch.states.shape[-1]  # each state layer's width
    if settings.noise > 0:  # relative to each layer's state's RMS
        b, seq, wide = features.shape
        blocks = features.view(b, seq, wide // hidden, hidden)
        scale = blocks.pow(2).mean(-1, keepdim=True).sqrt()  # [b, seq, layers, 1]: 0 before position 0
        features = (blocks + (torch.rand_like(blocks) * 2 - 1) * settings.noise * scale).view(b, seq, wide)
    weights = weights.to(features.device)  # [positions]
    scored = torch.isfinite(topk_logprobs).any(-1)  # [positions]
    loss = features.new_zeros(())
    for j, predicted in enumerate(unrolled(head, batch.input_ids, features, settings.unroll)):
        step_weight = settings.unroll_decay**j
        usable = (batch.cols >= j) & scored  # step j + 1 needs a chain start at col - j >= 0
        picked = predicted[batch.rows[usable], batch.cols[usable]]  # [positions, hidden]
        kl = position_losses(logits(picked).float(), topk_ids[usable], topk_logprobs[usable], settings.loss)
        loss = loss + step_weight * (weights[usable] * kl).sum() / total_weight
        if settings.regression_weight > 0:
            real = batch.real.clone()
            real[:, :j] = False
            regression = _smooth_l1_scaled(predicted[real], batch.states[real]).sum() / total_tokens
            loss = loss + step_weight * settings.regression_weight * regression
    return loss


class HeadTrainer(TrainedWeights):
    """LoRA on a `TrainableHead`'s layer, its fuse trained whole, and the optimiser; the interface of
    `DraftTrainer` (train_step, save, load, lora_state, restore, reset, records_used, tokens_used)."""

    def __init__(
        self,
        head: TrainableHead,
        settings: LoraSettings | None = None,
        *,
        init_adapter: str | Path | None = None,
        target_id: str = "target",
        draft_id: str = "head",
    ) -> None:
        settings = settings or HeadSettings()
        if not isinstance(settings, HeadSettings):  # an OnlineSettings' default: the head's own defaults on top
            given = dataclasses.asdict(settings)
            if (settings.r, settings.alpha) == (LoraSettings.r, LoraSettings.alpha):  # the early exit's shape
                del given["r"], given["alpha"]
            settings = HeadSettings(**given)
        whole = ["fuse"] if head.reduce is None else ["fuse", "reduce"]
        self.settings, lora_config = self._lora_config(settings, init_adapter, modules_to_save=whole)
        whole = list(lora_config.modules_to_save or [])  # a lineage from before the reduction trains none
        self.target_id = target_id
        self.draft_id = draft_id
        self.head = head
        may_train = ("lora_", *(f".{name}.modules_to_save." for name in whole))
        self._wrap(head, lora_config, may_train, "LoRA weights, the fuse and the reduction")
        self._fuse = head.fuse.modules_to_save["default"]  # the trained copy; head.fuse.original_module is the base
        self._fuse_start = self._initial_fuse()
        self._reduce = head.reduce.modules_to_save["default"] if "reduce" in whole else None
        self._reduce_start = head.reduce.original_module.weight.detach().clone() if "reduce" in whole else None
        with torch.no_grad():
            self._fuse.weight.copy_(self._fuse_start)
        self._start(init_adapter)

    @property
    def states(self) -> TargetStates:
        return self.head.states

    def _group_loss(self, group: list[TrainingExample], total_weight: float, total_tokens: int) -> torch.Tensor:
        """The step's loss of the module docstring over the group; the examples' target states are
        computed on first use and kept with them."""
        return self._loss(head_batch(self.head, [(example, example) for example in group]), total_weight, total_tokens)

    def _train_mode(self, mode: bool) -> None:
        self.head.layer.train(mode)  # LoRA dropout on the head's own layer only

    def _hidden_size(self) -> int:
        return int(self.head.config.hidden_size)

    def _loss(self, batch: HeadBatch, total_weight: float, total_tokens: int) -> torch.Tensor:
        logits, topk_ids = softmax_columns(self.head, batch.target_topk_ids, self.settings.softmax)
        weights = self._weights(batch.accepted)
        return unrolled_loss(
            self.head,
            batch,
            self.settings,
            weights,
            (logits, topk_ids, batch.target_topk_logprobs),
            total_weight,
            total_tokens,
        )

    def save(self, adapter_dir: str | Path) -> Path:
        """Write PEFT's adapter_config.json + adapter_model.safetensors and adaptive_spec_adapter.json."""
        config = self.head.config
        draft_config = {
            "kind": "head",
            **{key: getattr(config, key, None) for key in ("model_type", "hidden_size", "vocab_size")},
            "num_hidden_layers": 1,
            # the target's layers it reads, side by side (without a trained reduction, the last alone)
            "feature_layers": list(
                self.head.feature_layers if self._reduce is not None else self.head.feature_layers[-1:]
            ),
        }
        return self._save(Path(adapter_dir), draft_config, target_state_forwards=self.states.forwards)

    def load(self, adapter_dir: str | Path) -> None:
        """Replace the LoRA and fuse weights by those saved in adapter_dir; the optimiser starts afresh.

        ValueError if the version's shape differs from this trainer's (rank, alpha, modules) or it
        does not cover every LoRA layer and the fuse.
        """
        shape = ("r", "lora_alpha", "target_modules", "modules_to_save")
        self._load_version(Path(adapter_dir), shape, ("lora_", "modules_to_save"), "head version")

    def reset(self) -> None:
        """As it started: LoRA reset (B = 0), the fuse at its starting value; the optimiser's moments cleared."""
        with torch.no_grad():
            self._reset_lora()
            self._fuse.weight.copy_(self._fuse_start)
            if self._reduce is not None:
                self._reduce.weight.copy_(self._reduce_start)
        self.optimizer.state.clear()

    def _initial_fuse(self) -> torch.Tensor:
        """[hidden, 2 * hidden]: [I | c I], c = the head's embedding scale (module docstring)."""
        weight = self.head.fuse.original_module.weight.detach().clone()
        hidden = weight.shape[0]
        eye = torch.eye(hidden, dtype=weight.dtype, device=weight.device)
        return torch.cat([eye, self.head.embedding_scale * eye], dim=1)
