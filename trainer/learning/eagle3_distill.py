"""Distil the target into a head in the standard EAGLE-3 layout (the draft `eagle3`): every weight of the head's
own trained whole, with the multi-step recipe of the project's head, each version written as a speculators
checkpoint that vLLM and SGLang load as it is (docs/eagle3.md).

    from trainer.learning.eagle3_distill import Eagle3Settings, Eagle3Trainer
    from trainer.learning.eagle3_model import TrainableEagle3Head

    trainer = Eagle3Trainer(TrainableEagle3Head(target, draft_vocab_size=4096), Eagle3Settings(),
                            target_id="smollm2-135m-instruct", draft_id="eagle3", init_adapter=None)
    loss = trainer.train_step(replay.sample_batch(rng, 2048))   # TrainingExamples, as for every trainer
    trainer.save("adapters/candidate")     # config.json + model.safetensors (speculators) + adaptive_spec_adapter.json
    engine.load_adapter("adapters/candidate", "3")               # an Engine whose draft is "eagle3"

`OnlineTrainer` (trainer/loop/online.py) builds this trainer for a `TrainableEagle3Head`; the gate, the version
directories (`AdapterDir.standard`), the registry, champion adoption and the trainer's checkpoints treat its
versions as any other: it has the interface of `TrainedWeights` (train_step, save, load, lora_state, restore, reset,
base_draft, records_used, tokens_used), where "LoRA state" is the head's whole state.

Small CPU check (tiny random models, one thread, about 30 s):
`.venv/bin/python -m pytest tests/trainer/test_eagle3_distill.py -q -n 0`.

What trains. The head's layer (q/k/v over [embedding | state], o, the MLP, `hidden_norm`, `input_layernorm`,
`post_attention_layernorm`) and `fc`, all of it, as speculators and SpecForge train EAGLE-3 heads; LoRA would
leave q/k/v's embedding half, which an untrained head holds at zero, a low-rank update. The head's own final
`norm` and `lm_head` start as the target's (its rows of the draft vocabulary) and stay frozen
(`train_lm_head = False`): then a version's draft vocabulary is a mapping alone, and the LM head rows it ships are
the target's. With `train_lm_head` they train too; either way the checkpoint writes them.

The recipe is head_distill.py's (its module docstring has the whole of it): the target's states computed once per
example and kept with it, noise on the input states, the KL to the target's logged top-m plus the state regression,
four draft steps unrolled on the head's own predictions (`unroll`, `unroll_decay`), and the softmax over the batch's
top-m tokens (`softmax = "batch"`). What differs here:

- the states read are the target's aux states in vLLM's numbering (`aux_layer_ids`: the state entering layer i),
  through `fc`; the regression's target is the last of them, what enters the target's final norm;
- the softmax runs over the draft vocabulary only: the batch's top-m tokens that are in it ("batch"), or all of it
  ("vocab"), through the head's own norm and LM head. A logged top-m token outside it cannot be drafted: it leaves
  the KL's target distribution, which is renormalised over the rest, and a position none of whose top-m is in it
  has no KL term;
- the draft vocabulary is chosen before every step from the traffic trained on so far (eagle3_vocab.py), at the
  deployment's fixed size: the candidate the gate scores is the one saved, mapping and all.

The base draft, which a lineage's first candidate must beat, is the untrained head over the target's whole
vocabulary, as the engine serves `eagle3` without a version (`base_draft`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from adaptive_spec.drafters.eagle3_head import Eagle3Head
from adaptive_spec.formats.adapters import AdapterDir
from adaptive_spec.formats.eagle3 import Eagle3Checkpoint
from trainer.intake.examples import TrainingExample
from trainer.learning.distill import LoraSettings, TrainedWeights
from trainer.learning.eagle3_model import TrainableEagle3Head
from trainer.learning.eagle3_vocab import TrafficTokens
from trainer.learning.head_distill import HeadSettings, unrolled_loss
from trainer.learning.head_model import TargetStates, head_batch

LORA_FIELDS = ("r", "alpha", "dropout", "target_modules")  # HeadSettings' LoRA shape: nothing here


@dataclass
class Eagle3Settings(HeadSettings):
    """HeadSettings' recipe (batch, learning rate, position weights, KL and regression, noise, four unrolled steps,
    the batch softmax) for training the head's weights whole; its LoRA shape (`LORA_FIELDS`) means nothing here and
    is not written into a version's metadata.

    The learning rate, 1e-3, is ten times what speculators and SpecForge train EAGLE-3 heads at (1e-4, over epochs
    of a fixed data set): an online round is 20 to 100 steps. On the default model, 128 python records trained on
    and 32 held out (bench-head-ablation's split), steps of 2,048 tokens at one thread, a draft vocabulary of 4,096,
    the held-out first-token match and the draft tokens a greedy verify of k = 4 accepts a round, after 50 / 100 /
    150 steps (one run each, 2026-12-07):

        lr 3e-4                       0.64 / 1.13   0.76 / 1.83   0.80 / 2.14
        lr 1e-3                       0.76 / 1.79   0.79 / 2.30   0.80 / 2.40
        lr 3e-3                       0.75 / 1.84   0.79 / 2.31   0.79 / 2.35
        lr 3e-4, train_lm_head        0.67 / 1.25   0.79 / 2.00   0.81 / 2.28
        lr 1e-3, train_lm_head        0.76 / 1.89   0.80 / 2.37   0.81 / 2.42
        the project's head (HeadSettings(), on the same records)
                                      0.42 / 0.62   0.64 / 1.24   0.73 / 1.77

    The untrained head (the base draft, over the whole vocabulary) matched 0.015. 150 steps took 390-444 s of the
    EAGLE-3 head's (430-475 s training its LM head too) and 484 s of the project's, on a machine shared with other
    work whose times varied by 15%. Training the final norm and the LM head's rows gained 0.01 of match and 0.02-0.14
    accepted a round at 150 steps, within one run's noise: they stay frozen by default, so a version's LM head is
    the target's rows of its draft vocabulary and only the mapping changes between versions."""

    train_lm_head: bool = False  # the head's final norm and LM head rows train too (else they stay the target's)


def eagle3_settings(settings: LoraSettings | None) -> Eagle3Settings:
    """`settings` as an Eagle3Settings: an Eagle3Settings as it is; of another kind (an OnlineSettings' default
    LoraSettings, a HeadSettings), the fields the caller changed from that kind's defaults, over ours."""
    if settings is None or isinstance(settings, Eagle3Settings):
        return settings or Eagle3Settings()
    defaults = type(settings)()
    ours = {field.name for field in dataclasses.fields(Eagle3Settings)} - set(LORA_FIELDS)
    given = {
        name: value
        for name, value in dataclasses.asdict(settings).items()
        if name in ours and value != getattr(defaults, name)
    }
    return Eagle3Settings(**given)


def draft_softmax(head: TrainableEagle3Head, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, softmax: str):
    """(predicted states [n, h] -> logits [n, columns], the top-m as indices into the columns [positions, m], the
    top-m log-probabilities [positions, m] with -inf where the token is outside the draft vocabulary): the KL's
    softmax over the draft vocabulary ("vocab") or over the batch's top-m tokens in it ("batch").

    Example: draft vocabulary [2, 5, 9] (draft ids 0, 1, 2), a position's top-2 (9, 4): "vocab" gives the columns
    0..2 and indices (2, 0) with 4's log-probability at -inf; "batch", if 9 is the batch's only top-m token in the
    vocabulary, the one column [2] and indices (0, 0)."""
    index = head.draft_index[topk_ids]  # [positions, m]: draft ids, -1 outside
    inside = index >= 0
    logprobs = topk_logprobs.masked_fill(~inside, float("-inf"))
    index = index.clamp_min(0)  # a token outside gathers any column: its target probability is 0
    if softmax == "vocab":
        return head.logits, index, logprobs
    columns = torch.unique(index[inside])  # sorted draft ids
    if not len(columns):  # nothing in the batch can be drafted: every position has no KL term
        columns = index.new_zeros(1)
    rows = head.lm_head.weight[columns]  # [columns, h]

    def logits(states: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(head.norm(states), rows)

    return logits, torch.searchsorted(columns, index).clamp_max(len(columns) - 1), logprobs


class Eagle3Trainer(TrainedWeights):
    """A `TrainableEagle3Head`'s own weights trained whole, and the optimiser; the interface of `DraftTrainer`.

    Start from the untrained head or, with `init_adapter`, from a version directory (the champion's, or a
    trainer's checkpoint) whose aux layers and draft vocabulary size are the head's."""

    def __init__(
        self,
        head: TrainableEagle3Head,
        settings: LoraSettings | None = None,
        *,
        init_adapter: str | Path | None = None,
        target_id: str = "target",
        draft_id: str = "eagle3",
    ) -> None:
        self.settings = eagle3_settings(settings)
        self.target_id = target_id
        self.draft_id = draft_id
        self.model = self.head = head
        head.eval().requires_grad_(True)
        for frozen in (head.norm, head.lm_head):
            frozen.requires_grad_(self.settings.train_lm_head)
        self.traffic = TrafficTokens(head.vocab_size)
        self._start_state = head.state()
        self._start(init_adapter)

    @property
    def states(self) -> TargetStates:
        return self.head.states

    def train_step(self, examples: Iterable[TrainingExample]) -> float:
        """TrainedWeights.train_step, after the draft vocabulary is chosen again with these examples counted in."""
        examples = list(examples)
        for example in examples:
            self.traffic.add(example)
        if self.head.set_vocabulary(self.traffic.draft_ids(len(self.head.draft_ids), self.head.draft_ids)):
            self.optimizer.state.pop(self.head.lm_head.weight, None)  # a trained LM head's moments were per row
        return super().train_step(examples)

    def _group_loss(self, group: list[TrainingExample], total_weight: float, total_tokens: int) -> torch.Tensor:
        batch = head_batch(self.head, [(example, example) for example in group])
        softmax = draft_softmax(self.head, batch.target_topk_ids, batch.target_topk_logprobs, self.settings.softmax)
        weights = self._weights(batch.accepted)
        return unrolled_loss(self.head, batch, self.settings, weights, softmax, total_weight, total_tokens)

    def _train_mode(self, mode: bool) -> None:
        self.head.layer.train(mode)

    def _hidden_size(self) -> int:
        return int(self.head.target_config.hidden_size)

    # ---------------------------------------------------------------- versions

    def save(self, adapter_dir: str | Path) -> Path:
        """config.json + model.safetensors, the head as an EAGLE-3 checkpoint for the target `target_id` names
        (d2t and t2d its draft vocabulary; `speculative_tokens` the draft steps it trained), then
        adaptive_spec_adapter.json."""
        adapter_dir = Path(adapter_dir)
        head = self.head
        head.checkpoint(verifier=self.target_id, speculative_tokens=self.settings.unroll).write(adapter_dir)
        config = head.target_config
        draft_config = {
            "kind": "eagle3",
            **{key: getattr(config, key, None) for key in ("model_type", "hidden_size", "vocab_size")},
            "num_hidden_layers": 1,
            "aux_layer_ids": list(head.aux_layer_ids),
            "draft_vocab_size": len(head.draft_ids),
            "train_lm_head": self.settings.train_lm_head,
        }
        recipe = {k: v for k, v in dataclasses.asdict(self.settings).items() if k not in LORA_FIELDS}
        return self._write_metadata(
            adapter_dir, draft_config, settings=recipe, target_state_forwards=self.states.forwards
        )

    def load(self, adapter_dir: str | Path) -> None:
        """The weights and draft vocabulary of the version saved in adapter_dir (an EAGLE-3 checkpoint, ours or
        imported); the optimiser starts afresh. ValueError, naming what differs, when it does not fit: not such a
        checkpoint, another target's shape (Eagle3FormatError), other aux layers or another draft vocabulary size."""
        adapter_dir = Path(adapter_dir)
        loaded = Eagle3Head.from_checkpoint(self.states.target, Eagle3Checkpoint.read(adapter_dir))
        ours = self.head
        fits = {
            "aux_layer_ids": (loaded.aux_layer_ids, ours.aux_layer_ids),
            "draft_vocab_size": (len(loaded.draft_ids), len(ours.draft_ids)),
        }
        mismatched = [(field, saved, mine) for field, (saved, mine) in fits.items() if saved != mine]
        if mismatched:
            raise ValueError(f"head version {adapter_dir} does not fit this trainer: (field, saved, ours) {mismatched}")
        state = {name: tensor.detach() for name, tensor in loaded.state_dict().items()}
        ours.put(
            {**state, "draft_ids": loaded.draft_ids, "norm_before_residual": torch.tensor(loaded.norm_before_residual)}
        )
        parent = AdapterDir(adapter_dir).metadata()
        self.parent_metadata = None if parent.empty else parent
        self.optimizer = self._new_optimizer()

    def reset(self) -> None:
        """The untrained head again (its start vocabulary too); the optimiser's moments cleared."""
        self.head.put(self._start_state)
        self.optimizer.state.clear()

    def lora_state(self) -> dict[str, torch.Tensor]:
        """A copy of the head's whole state (weights, draft vocabulary), to come back to with `restore`."""
        return self.head.state()

    def restore(self, lora_state: dict[str, torch.Tensor]) -> None:
        self.head.put(lora_state)
        self.optimizer.state.clear()

    @contextlib.contextmanager
    def base_draft(self) -> Iterator[None]:
        """The untrained head over the target's whole vocabulary while the block runs (how the engine serves the
        draft without a version); then the trained state back, the optimiser untouched."""
        trained = self.head.state()
        self.head.put(self._start_state)
        self.head.whole_vocabulary = True
        try:
            yield
        finally:
            self.head.whole_vocabulary = False
            self.head.put(trained)
