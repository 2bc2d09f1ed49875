"""Distil the target's corrections into a LoRA adapter on the draft.

    from adaptive_spec.drafters.early_exit import build_early_exit
    from trainer.learning.distill import DraftTrainer, LoraSettings
    from trainer.intake.examples import examples_from_record

    settings = LoraSettings()
    trainer = DraftTrainer(build_early_exit(target, 4), settings, target_id="smollm2-135m-instruct",
                           draft_id="early-exit:4", init_adapter=None)   # or the champion's adapter directory
    replay.add(examples_from_record(record, settings.max_seq_len))       # trainer.buffer.ReplayBuffer
    loss = trainer.train_step(replay.sample_batch(rng, settings.batch_tokens))
    trainer.save("adapters/candidate")      # a standard PEFT adapter directory + adaptive_spec_adapter.json

    draft.load_adapter("adapters/candidate", adapter_name="v3")          # serving: a plain early-exit draft
    draft.set_adapter("v3")

Small CPU check of the whole module (tiny random models, about 15 s):
`.venv/bin/python -m pytest tests/trainer/test_distill.py -q`.

What is learned. A correction record holds, for every output position j, the target's top-m tokens
and their log-probabilities, computed while verifying. The draft is trained, teacher-forced on the
context the target saw, so that its next-token distribution at j comes close to the target's:

    loss_j = sum over the top-m ids i of  p_t(i) * (log p_t(i) - log q(i))          ("kl_topm")

where p_t is the target's top-m renormalised (exp(logprob) / sum over the m) and q is the draft's
softmax over the whole vocabulary. Because q is normalised over the vocabulary, probability the
draft spends outside the top-m lowers every log q(i) and is penalised without being listed.
Worked example, m = 2: the target logged log-probabilities (-1.61, -3.00), i.e. probabilities
(0.20, 0.05), renormalised over the two to p_t = (0.8, 0.2); a draft with q = (0.5, 0.1) there and
0.4 elsewhere pays 0.8 * ln(0.8 / 0.5) + 0.2 * ln(0.2 / 0.1) = 0.376 + 0.139 = 0.515 nats.
"ce_top1" is the cross-entropy on the target's top-1 token alone (-log q(top-1)), the recipe of the
CPU experiment in DESIGN.md.

Positions are weighted as in Online Speculative Decoding: where the draft's proposal was rejected,
or where it proposed nothing (the bonus token, or steps that drafted no tokens), the draft has
something to learn and gets `rejected_weight`; where its proposal was accepted it already agreed
and gets `accepted_weight` (lower by default, not zero, so it does not forget what it knows).
The loss of a step is the weighted mean over all its positions.

Only LoRA weights train. The early-exit draft shares its embedding, final norm and LM head with
the target (adaptive_spec/drafters/early_exit.py); those stay frozen, so the target never
changes. Wrapping with PEFT injects LoRA layers into the draft model object in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from peft.utils import load_peft_weights, set_peft_model_state_dict

from adaptive_spec.drafters.early_exit import decoder_layers
from adaptive_spec.formats.adapter_metadata import AdapterMetadata
from adaptive_spec.formats.adapters import AdapterDir
from adaptive_spec.models import native_bf16
from trainer.evaluation.gate import adapters_disabled, causal_lm, draft_logits
from trainer.intake.examples import TrainingExample, collate, micro_batches
from trainer.settings import AUTOCAST, AUTOCAST_MIN_HIDDEN

LOSSES = ("kl_topm", "ce_top1")
METADATA_FORMAT = 1


@dataclass
class LoraSettings:
    """Everything the distillation needs, flat (STYLE.md §9)."""

    # The adapter's shape (taken from the adapter itself when training continues from one).
    r: int = 16
    alpha: int = 32  # LoRA scale = alpha / r = 2
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    # The optimiser: AdamW over the LoRA weights only. 1e-3 suits LoRA at r = 16 (B starts at 0).
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    # Padded tokens per forward pass; train_step accumulates gradients over as many passes as the
    # examples need, and it is also the natural per-step sample, ReplayBuffer.sample_batch(rng, batch_tokens).
    batch_tokens: int = 2048
    # The loss.
    loss: str = "kl_topm"  # or "ce_top1"
    rejected_weight: float = 1.0  # positions where the draft was rejected or proposed nothing
    accepted_weight: float = 0.5  # positions where its proposal was accepted
    max_seq_len: int = 1024  # longer records lose prompt tokens from the left (examples_from_record)
    seed: int = 0  # initialises LoRA's A matrices
    # bf16 autocast of a training step's forwards (the target's states it needs, the draft's layers); the
    # weights, their gradients and the optimiser stay in the weights' dtype. "auto": on where the weights are
    # fp32, the model at least AUTOCAST_MIN_HIDDEN wide and the device computes bf16 natively (`training_autocast`).
    autocast: str = "auto"  # or "bf16", "off"

    def __post_init__(self) -> None:
        self.target_modules = tuple(self.target_modules)
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.autocast not in AUTOCAST:
            raise ValueError(f"autocast must be one of {AUTOCAST}, got {self.autocast!r}")
        if self.r < 1 or self.batch_tokens < 1 or self.max_seq_len < 2:
            raise ValueError("r and batch_tokens must be >= 1 and max_seq_len >= 2")
        if self.rejected_weight < 0 or self.accepted_weight < 0 or self.rejected_weight + self.accepted_weight == 0:
            raise ValueError("position weights must be >= 0 and not both 0")
        if self.lr < 0 or self.weight_decay < 0 or not 0 <= self.dropout < 1:
            raise ValueError("lr and weight_decay must be >= 0 and dropout in [0, 1)")


def position_losses(
    draft_logits: torch.Tensor, target_topk_ids: torch.Tensor, target_topk_logprobs: torch.Tensor, loss: str = "kl_topm"
) -> torch.Tensor:
    """Per-position loss [positions] of draft logits [positions, vocab] against the target's top-m [positions, m]."""
    draft_logprobs = torch.log_softmax(draft_logits.float(), dim=-1)  # [positions, vocab], fp32 under autocast too
    draft_at_topk = draft_logprobs.gather(-1, target_topk_ids)  # [positions, m]
    if loss == "ce_top1":
        top1 = target_topk_logprobs.argmax(-1, keepdim=True)  # [positions, 1]
        return -draft_at_topk.gather(-1, top1)[:, 0]
    target_probs = torch.softmax(target_topk_logprobs, dim=-1)  # [positions, m], renormalised over the top-m
    return (torch.xlogy(target_probs, target_probs) - target_probs * draft_at_topk).sum(-1)


def training_autocast(autocast: str, device: torch.device, weights: torch.dtype, hidden_size: int) -> bool:
    """Whether a training step runs its forwards under bf16 autocast: `autocast` "bf16" or "off" as said;
    "auto" where the weights are fp32, the model is at least AUTOCAST_MIN_HIDDEN wide, and `device`
    computes bf16 natively (`native_bf16`: a CPU with AVX512-BF16 or AMX; a GPU trains in bf16 weights
    already, the trainer's `auto` dtype there).

    Example: the default head on 160 python records (32 more held out), AMD EPYC with AVX512-BF16, 2 cores
    (`adaptive-spec bench-head-ablation --recipes default-fp32,default-bf16-autocast --steps 100`): 100 steps
    in 51.5 s under autocast against 93.6 s in fp32 (1.82x; the target's forwards for the states 16.7 s
    against 29.5 s), held-out first-token match 0.539 against 0.521. On the test suite's 64-wide random
    models the casts cost more than bf16 saves (three trainer test files: 40.5 s against 34.7 s in fp32),
    hence the width floor, set between the two widths measured (64 and the default model's 576)."""
    if autocast == "auto":
        return weights == torch.float32 and hidden_size >= AUTOCAST_MIN_HIDDEN and native_bf16(device)
    return autocast == "bf16"


class TrainedWeights:
    """What DraftTrainer, HeadTrainer and Eagle3Trainer share: the optimiser and counters (`_start`), the
    optimiser step (`train_step`), copies of the trained weights (`lora_state`, `restore`), the base draft
    (`base_draft`) and the metadata (`_write_metadata`). Needs `settings` and `model`, then `_start`; each
    trainer brings its own loss (`_group_loss`) and its own layers (`_train_mode`).

    The LoRA trainers wrap the draft in PEFT (`_lora_config`, `_wrap`), load a saved version into the PEFT
    model (`_load_version`), reset LoRA (`_reset_lora`) and save PEFT's files (`_save`); a full-parameter
    trainer (trainer/learning/eagle3_distill.py) trains the model's own weights and overrides what says
    LoRA: `base_draft`, `lora_state` and `restore`, beside its own save, load and reset."""

    model: Any
    settings: LoraSettings
    target_id: str
    draft_id: str
    _params: list

    @staticmethod
    def _lora_config(settings: LoraSettings, init_adapter: str | Path | None, **fresh) -> tuple[LoraSettings, Any]:
        """(settings, LoraConfig): a saved version's own shape (r, alpha, dropout, target modules) when
        training continues from `init_adapter`, overriding `settings`; else the settings' shape, with
        `fresh` (what else a new adapter's LoraConfig says, e.g. task_type or modules_to_save)."""
        if init_adapter is not None:
            lora_config = LoraConfig.from_pretrained(str(init_adapter))
            lora_config.inference_mode = False  # saved adapters say True: they would load frozen
            settings = dataclasses.replace(
                settings,
                r=lora_config.r,
                alpha=lora_config.lora_alpha,
                dropout=lora_config.lora_dropout,
                target_modules=tuple(sorted(lora_config.target_modules)),
            )
            return settings, lora_config
        lora_config = LoraConfig(
            r=settings.r,
            lora_alpha=settings.alpha,
            lora_dropout=settings.dropout,
            target_modules=list(settings.target_modules),
            bias="none",
            **fresh,
        )
        return settings, lora_config

    def _wrap(self, model, lora_config, may_train: tuple[str, ...], what: str) -> None:
        """`self.model`: `model` with LoRA injected in place (drawn under `settings.seed`), in eval mode.
        AssertionError unless every trainable weight's name holds one of `may_train` (`what` says which)."""
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # PEFT 0.21 asks transformers 5 for the deprecated `is_gradient_checkpointing`.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            torch.manual_seed(self.settings.seed)
            self.model = get_peft_model(model, lora_config)
        self.model.eval()
        trainable = [name for name, p in self.model.named_parameters() if p.requires_grad]
        strays = [name for name in trainable if not any(part in name for part in may_train)]
        if not trainable or strays:
            raise AssertionError(f"only {what} may train, found {strays[:3]}")

    def _start(self, init_adapter: str | Path | None) -> None:
        """Once `model` is built: the optimiser over its trainable weights, the counters, and the
        version to start from (`load`), if any."""
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = self._new_optimizer()
        self.steps = 0
        self.positions_trained = 0  # with repeats: a replayed example counts each time
        self._records: dict[str, int] = {}  # request_id -> output positions, for records_used / tokens_used
        self.init_adapter = str(init_adapter) if init_adapter is not None else None
        self.parent_metadata: AdapterMetadata | None = None
        if init_adapter is not None:
            self.load(init_adapter)

    @property
    def records_used(self) -> int:
        """Distinct records (request ids) trained on so far."""
        return len(self._records)

    @property
    def tokens_used(self) -> int:
        """Output positions of those distinct records."""
        return sum(self._records.values())

    def _load_version(self, adapter_dir: Path, shape: tuple[str, ...], trained: tuple[str, ...], what: str) -> None:
        """Load the weights saved in adapter_dir; ValueError if its `shape` fields differ from ours or
        it does not cover every parameter whose name holds one of `trained`. The optimiser starts afresh."""
        saved = LoraConfig.from_pretrained(str(adapter_dir))
        ours = self.model.peft_config["default"]
        mismatched = [
            (f, getattr(saved, f), getattr(ours, f))
            for f in shape
            if _comparable(getattr(saved, f)) != _comparable(getattr(ours, f))
        ]
        if mismatched:
            raise ValueError(f"{what} {adapter_dir} does not fit this trainer: (field, saved, ours) {mismatched}")
        result = set_peft_model_state_dict(self.model, load_peft_weights(str(adapter_dir), device="cpu"))
        missing = [key for key in result.missing_keys if any(part in key for part in trained)]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"{what} {adapter_dir} does not match: missing {missing[:3]}, "
                f"unexpected {list(result.unexpected_keys)[:3]}"
            )
        parent = AdapterDir(adapter_dir).metadata()
        self.parent_metadata = None if parent.empty else parent
        self.optimizer = self._new_optimizer()

    def train_step(self, examples: Iterable[TrainingExample]) -> float:
        """One optimiser step on these examples; returns the step's loss, the sum of `_group_loss` over
        its micro-batches of at most `batch_tokens` padded tokens (gradients accumulate across them).

        With every weight 0 (say accepted_weight=0 and only accepted positions) it returns 0.0 and
        does not step.
        """
        examples = [example for example in examples if example.num_positions]
        if not examples:
            raise ValueError("train_step needs at least one example with an output position")
        settings = self.settings
        total_weight = sum(float(self._weights(example.accepted).sum()) for example in examples)
        total_tokens = sum(example.num_tokens for example in examples)
        if total_weight == 0:
            return 0.0
        self.optimizer.zero_grad(set_to_none=True)
        self._train_mode(True)
        total = 0.0
        device = self._params[0].device
        autocast = training_autocast(settings.autocast, device, self._params[0].dtype, self._hidden_size())
        try:
            for group in micro_batches(examples, settings.batch_tokens):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    loss = self._group_loss(group, total_weight, total_tokens)
                loss.backward()
                total += float(loss.detach())
        finally:
            self._train_mode(False)
        torch.nn.utils.clip_grad_norm_(self._params, settings.max_grad_norm)
        self.optimizer.step()
        self.steps += 1
        for example in examples:
            self.positions_trained += example.num_positions
            self._records.setdefault(example.request_id, example.num_positions)
        return total

    def _group_loss(self, group: list[TrainingExample], total_weight: float, total_tokens: int) -> torch.Tensor:
        """The loss of one micro-batch, its position terms divided by the step's `total_weight` (the sum
        of its position weights) and any per-token term by `total_tokens`: each trainer's own."""
        raise NotImplementedError

    def _train_mode(self, mode: bool) -> None:
        """Train mode (LoRA dropout) on the draft's own layers only, never on modules it shares with the target."""
        raise NotImplementedError

    def _hidden_size(self) -> int:
        """The draft's width (its config's hidden_size), for `training_autocast`."""
        raise NotImplementedError

    def _weights(self, accepted: torch.Tensor) -> torch.Tensor:
        """[positions] float32 from [positions] bool."""
        return torch.where(accepted, self.settings.accepted_weight, self.settings.rejected_weight).float()

    def _save(self, adapter_dir: Path, draft_config: dict, **extra) -> Path:
        """PEFT's adapter_config.json + adapter_model.safetensors, then the metadata (`_write_metadata`)."""
        self.model.save_pretrained(str(adapter_dir))
        return self._write_metadata(adapter_dir, draft_config, **extra)

    def _write_metadata(self, adapter_dir: Path, draft_config: dict, settings: dict | None = None, **extra) -> Path:
        """adaptive_spec_adapter.json: who trained it (target, draft and its shape), how (`settings`, by default
        all of the trainer's), from what and on how much; the online trainer adds the version's lineage and gate
        figures when it seals it (promotion/versions.py)."""
        AdapterMetadata().updated(
            format=METADATA_FORMAT,
            created_at=time.time(),
            target_id=self.target_id,
            draft_id=self.draft_id,
            draft_config=draft_config,
            settings=dataclasses.asdict(self.settings) if settings is None else settings,
            init_adapter=self.init_adapter,
            steps=self.steps,
            records_used=self.records_used,
            tokens_used=self.tokens_used,
            positions_trained=self.positions_trained,
            **extra,
        ).write(adapter_dir)
        return adapter_dir

    @contextlib.contextmanager
    def base_draft(self) -> Iterator[None]:
        """The draft as served without a version, for the gate's figures of the base draft, leaving the trained
        weights and the optimiser as they were afterwards: LoRA switched off (`adapters_disabled`)."""
        with adapters_disabled(self.model):
            yield

    def lora_state(self) -> dict[str, torch.Tensor]:
        """A copy of the trained weights, to come back to with `restore`."""
        return {name: p.detach().clone() for name, p in self.model.named_parameters() if p.requires_grad}

    def restore(self, lora_state: dict[str, torch.Tensor]) -> None:
        """The weights of a `lora_state()` copy, with the optimiser's moments cleared."""
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                if parameter.requires_grad:
                    parameter.copy_(lora_state[name])
        self.optimizer.state.clear()

    def _reset_lora(self) -> None:
        """LoRA's A as PEFT draws it (seeded), B = 0; call inside torch.no_grad()."""
        from peft.tuners.lora import LoraLayer

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.settings.seed)
            for module in self.model.modules():
                if isinstance(module, LoraLayer):
                    for name in module.lora_A:
                        module.reset_lora_parameters(name, True)

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self._params, lr=self.settings.lr, weight_decay=self.settings.weight_decay)


def _comparable(value):
    return sorted(value) if isinstance(value, (list, tuple, set)) else value


class DraftTrainer(TrainedWeights):
    """A LoRA adapter on the draft and its optimiser.

    Start from scratch (LoRA's B = 0, so the untrained adapter leaves the draft exactly as it was)
    or, with `init_adapter`, from an adapter directory such as the champion's; then the adapter's
    own shape (r, alpha, dropout, target modules) overrides `settings`.
    """

    def __init__(
        self,
        draft_model,
        settings: LoraSettings | None = None,
        *,
        init_adapter: str | Path | None = None,
        target_id: str = "target",
        draft_id: str = "draft",
    ) -> None:
        self.settings, lora_config = self._lora_config(settings or LoraSettings(), init_adapter, task_type="CAUSAL_LM")
        self.target_id = target_id
        self.draft_id = draft_id
        self._wrap(draft_model, lora_config, ("lora_",), "LoRA weights")
        self._start(init_adapter)

    def _group_loss(self, group: list[TrainingExample], total_weight: float, total_tokens: int) -> torch.Tensor:
        """The weighted KL (or top-1 cross-entropy) of the module docstring over the group's positions."""
        batch = collate(group)
        losses = position_losses(
            draft_logits(self.model, batch),
            batch.target_topk_ids.to(self.model.device),
            batch.target_topk_logprobs.to(self.model.device),
            self.settings.loss,
        )
        return (self._weights(batch.accepted).to(losses.device) * losses).sum() / total_weight

    def save(self, adapter_dir: str | Path) -> Path:
        """Write adapter_config.json + adapter_model.safetensors (PEFT) and adaptive_spec_adapter.json."""
        config = causal_lm(self.model).config
        draft_config = {
            key: getattr(config, key, None) for key in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size")
        }
        return self._save(Path(adapter_dir), draft_config)

    def load(self, adapter_dir: str | Path) -> None:
        """Replace the adapter's weights by those saved in adapter_dir; the optimiser starts afresh.

        ValueError if the adapter's shape differs from this trainer's (rank, alpha, modules) or
        its weights do not cover every LoRA layer.
        """
        self._load_version(Path(adapter_dir), ("r", "lora_alpha", "target_modules"), ("lora_",), "adapter")

    def reset(self) -> None:
        """LoRA as it started (B = 0: the base draft again); the optimiser's moments cleared."""
        with torch.no_grad():
            self._reset_lora()
        self.optimizer.state.clear()

    def _train_mode(self, mode: bool) -> None:
        for layer in decoder_layers(causal_lm(self.model)):
            layer.train(mode)

    def _hidden_size(self) -> int:
        return int(causal_lm(self.model).config.hidden_size)
