"""Distil the target into a head draft (adaptive_spec/drafters/head.py): LoRA on the head's decoder
layer, its fuse trained whole, from the same correction records as an early-exit adapter.

    from trainer.head_distill import HeadSettings, HeadTrainer, TrainableHead

    trainer = HeadTrainer(TrainableHead(target), HeadSettings(), target_id="smollm2-135m-instruct",
                          draft_id="head", init_adapter=None)      # or the champion's version directory
    loss = trainer.train_step(replay.sample_batch(rng, 2048))       # TrainingExamples, as for DraftTrainer
    trainer.save("adapters/candidate")     # a PEFT directory on DraftHead: LoRA on layer.*, fuse saved whole
    engine.load_adapter("adapters/candidate", "3")                   # an Engine whose draft is "head"

`OnlineTrainer` (trainer/online.py) takes a `TrainableHead` where it takes an early-exit draft and
builds this trainer for it; the gate, the version directories, the registry and the servers' checks
then treat a head version as any adapter version.

Small CPU check (tiny random models, one thread, about 30 s):
`.venv/bin/python -m pytest tests/trainer/test_head_distill.py -q`.

What the head reads. To draft token t + 1 the head takes the target's hidden state entering its
final norm at position t - 1 (`S[t-1]`) and the embedding of token t. The records hold tokens and
the target's top-m, not states, so the trainer runs the target once over each sequence it trains
or gates on (prompt + output, `TargetStates`) and keeps the states with the example, in fp16, until
the replay buffer or the held-out set lets the example go. Teacher-forced, the input at position t
is (S[t-1], token t) (zeros before position 0), and the targets at t are the next token's logged
top-m and S[t] itself.

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
  during training, so the head learns to read states that are not exact, as its own are when it
  drafts a second token (EAGLE, Li et al. 2024, section 4);
- unroll: with `unroll = 2` a second draft step is trained on the head's own predicted states, as
  it drafts: at position t it reads (P_1[t-1], token t) and attends to the first step's keys at
  positions up to t - 1 and to itself, which is what its cache holds when it drafts (EAGLE-3's
  "training-time test", Li et al. 2025). It costs a second pass of the layer and of the LM head.

The fuse starts as [I | c I] rather than the base head's [I | I]: the default model's embeddings
have an RMS of 0.13 against 40 for its states, so a fuse of identities hands the layer the state
alone, and the Adam steps a round can take do not grow the embedding's half 300-fold. `c` is the
ratio of the target's typical state RMS to its embedding RMS, measured once on a fixed probe.

Cost, measured on the default model (fp32, one thread, in bench-drift's trainer thread): the
target forward is about 2.5 ms a token (0.4 s for a 160-token record) and the states take 1.15 KB a
token in fp16: 230 MB for a full 200,000-token replay buffer. The target is the serving engine's
own in bench-drift and `adaptive-spec up`; `adaptive-spec train` loads one (540 MB in fp32).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from peft.utils import load_peft_weights, set_peft_model_state_dict

from adaptive_spec.adapters import AdapterDir
from adaptive_spec.drafters.head import DraftHead
from adaptive_spec.record import CorrectionRecord
from trainer.distill import (
    METADATA_FORMAT,
    LoraSettings,
    TrainingExample,
    collate,
    examples_from_record,
    micro_batches,
    position_losses,
)
from trainer.gate import GateFigures, Tally

FUSE_PROBE_TOKENS = 64  # the fixed probe that sets the fuse's embedding scale


@dataclass
class HeadSettings(LoraSettings):
    """LoraSettings (rank, lr, batch, KL, position weights) plus what only a head needs."""

    regression_weight: float = 1.0  # the state regression against the KL, per position
    noise: float = 0.1  # half-width of the uniform noise on input states, relative to their RMS
    unroll: int = 1  # draft steps trained per position: 2 also trains a step on its own predicted states
    unroll_decay: float = 0.8  # weight of each further draft step relative to the one before

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.regression_weight < 0 or self.noise < 0 or self.unroll_decay < 0:
            raise ValueError("regression_weight, noise and unroll_decay must be >= 0")
        if self.unroll < 1:
            raise ValueError(f"unroll must be >= 1, got {self.unroll}")


class TargetStates:
    """The target's hidden state entering its final norm at every position of a sequence, from one
    target forward, kept as long as the object it belongs to (an example, a held-out record) lives.

    Example: a record of a 90-token prompt and a 64-token output trains on 153 input tokens; one
    target forward over them gives `[153, hidden]` states, kept in fp16 (176 KB on the default model).
    """

    def __init__(self, target, dtype: torch.dtype = torch.float16) -> None:
        self.target = target
        self.dtype = dtype
        self.forwards = 0
        self.tokens = 0
        self.seconds = 0.0
        self._kept: dict[int, torch.Tensor] = {}  # id(owner) -> [seq, hidden]; dropped when the owner is

    def __len__(self) -> int:
        return len(self._kept)

    def of(self, owner, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [seq] -> the target's states [seq, hidden] (float32), computed once per owner.

        Kept by the owner's identity (records compare by value and do not hash) until it is collected.
        """
        key = id(owner)
        states = self._kept.get(key)
        if states is None or states.shape[0] != input_ids.shape[0]:
            states = self._forward(input_ids)
            if key not in self._kept:
                weakref.finalize(owner, self._kept.pop, key, None)
            self._kept[key] = states
        return states.float()

    @torch.no_grad()
    def _forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        decoder = self.target.model
        with _final_norm_input(decoder) as captured:
            decoder(input_ids=input_ids[None].to(decoder.embed_tokens.weight.device), use_cache=False)
        self.forwards += 1
        self.tokens += int(input_ids.shape[0])
        self.seconds += time.perf_counter() - started
        return captured[0][0].to(self.dtype).cpu()  # [seq, hidden]


@contextmanager
def _final_norm_input(decoder) -> Iterator[list[torch.Tensor]]:
    """What enters `decoder.norm` during the block, from this thread only: the serving engine may run
    the same target in another thread meanwhile (bench-drift, up)."""
    captured: list[torch.Tensor] = []
    owner = threading.get_ident()

    def hook(module, args):
        if threading.get_ident() == owner:
            captured.append(args[0])

    handle = decoder.norm.register_forward_pre_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


class TrainableHead(DraftHead):
    """A `DraftHead` as the trainer holds it: with the target whose states it reads (`states`, not a
    submodule), so that the gate can score it (`gate_figures`) like any draft model."""

    def __init__(self, target, state_dtype: torch.dtype = torch.float16) -> None:
        super().__init__(target)
        self.states = TargetStates(target, state_dtype)
        self.embedding_scale = _embedding_scale(self, target)

    def gate_figures(self, records: Iterable[CorrectionRecord | TrainingExample], batch_tokens: int = 2048,
                     max_seq_len: int = 1024) -> GateFigures:  # fmt: skip
        """The gate's figures of the head's first draft token, teacher-forced on the target's true
        states (trainer/gate.py), with the head's adapters in whatever state they are in."""
        tally = Tally()
        with torch.inference_mode():
            for batch in _head_batches(self, records, batch_tokens, max_seq_len):
                predicted = self(batch.input_ids, batch.features)  # [b, seq, hidden]
                tally.add(self.logits(predicted[batch.rows, batch.cols]), batch.target_topk_ids,
                          batch.target_topk_logprobs)  # fmt: skip
        return tally.figures()

    def chain_figures(self, records: Iterable[CorrectionRecord | TrainingExample], depth: int = 4,
                      batch_tokens: int = 2048, max_seq_len: int = 1024) -> dict:  # fmt: skip
        """How the head does when it drafts `depth` tokens on its own states, greedily, teacher-forced.

        Every output position starts a chain: step 1 reads the target's true state, step j > 1 the
        head's own prediction of step j - 1. `match` is the greedy match of step j alone (given that
        the steps before it were right); `accepted_per_round` the mean number of leading steps that
        match the target's top-1, i.e. the drafts a greedy verify of k = depth would accept.
        Example: match [0.6, 0.5], chains of (1, 1), (1, 0), (0, -): accepted_per_round = (2 + 1 + 0) / 3.
        """
        hits = [0] * depth
        tried = [0] * depth
        accepted, chains = 0, 0
        with torch.inference_mode():
            for batch in _head_batches(self, records, batch_tokens, max_seq_len):
                steps = unrolled(self, batch.input_ids, batch.features, depth)
                top1 = torch.full_like(batch.input_ids, -1)  # [b, seq]: -1 off the output positions
                best = batch.target_topk_logprobs.argmax(-1, keepdim=True)
                top1[batch.rows, batch.cols] = batch.target_topk_ids.gather(-1, best)[:, 0]
                run = torch.ones_like(batch.accepted)  # [positions]: every step so far matched
                for j, predicted in enumerate(steps):
                    cols = batch.cols + j  # step j + 1 of the chain that starts at col predicts the output at col + j
                    inside = cols < batch.input_ids.shape[1]
                    rows, cols = batch.rows[inside], cols[inside]
                    wanted = top1[rows, cols]
                    drafted = self.logits(predicted[rows, cols]).argmax(-1)
                    valid = wanted >= 0
                    hit, alive = torch.zeros_like(run), torch.zeros_like(run)
                    hit[inside] = (drafted == wanted) & valid
                    alive[inside] = valid
                    tried[j] += int((run & alive).sum())
                    hits[j] += int((run & hit).sum())
                    run &= hit
                    accepted += int(run.sum())
                chains += len(batch.rows)
        return {
            "depth": depth,
            "match": [h / t if t else math.nan for h, t in zip(hits, tried, strict=True)],
            "accepted_per_round": accepted / chains if chains else math.nan,
            "chains": chains,
        }


@dataclass
class HeadBatch:
    """Examples padded on the right with the target's states beside each token."""

    input_ids: torch.Tensor  # [b, seq] int64, 0-padded
    features: torch.Tensor  # [b, seq, hidden]: the target's state at t - 1 beside token t (zeros at t = 0)
    states: torch.Tensor  # [b, seq, hidden]: the target's state at t, what the head predicts there
    real: torch.Tensor  # [b, seq] bool: not padding
    rows: torch.Tensor  # [positions] int64: which example
    cols: torch.Tensor  # [positions] int64: which input index predicts the output position
    target_topk_ids: torch.Tensor  # [positions, m] int64
    target_topk_logprobs: torch.Tensor  # [positions, m] float32, -inf where padded
    accepted: torch.Tensor  # [positions] bool


def head_batch(head: TrainableHead, group: list[tuple[object, TrainingExample]]) -> HeadBatch:
    """One padded batch of (owner of the states, example) pairs."""
    batch = collate([example for _, example in group])
    b, seq = batch.input_ids.shape
    device = head.fuse.weight.device
    states = torch.zeros(b, seq, head.config.hidden_size)
    for row, (owner, example) in enumerate(group):
        states[row, : example.num_tokens] = head.states.of(owner, example.input_ids)
    features = torch.cat([torch.zeros(b, 1, states.shape[-1]), states[:, :-1]], dim=1)
    return HeadBatch(
        batch.input_ids.to(device),
        features.to(device),
        states.to(device),
        batch.attention_mask.bool().to(device),
        batch.rows.to(device),
        batch.cols.to(device),
        batch.target_topk_ids.to(device),
        batch.target_topk_logprobs.to(device),
        batch.accepted.to(device),
    )


def _head_batches(head: TrainableHead, records, batch_tokens: int, max_seq_len: int) -> Iterator[HeadBatch]:
    """Records (their states kept with each record) or examples, in padded batches of `batch_tokens`."""
    pairs = [
        (each, each if isinstance(each, TrainingExample) else examples_from_record(each, max_seq_len))
        for each in records
    ]
    owners = {id(example): owner for owner, example in pairs}
    examples = [example for _, example in pairs if example.num_positions]
    for group in micro_batches(examples, batch_tokens):
        yield head_batch(head, [(owners[id(example)], example) for example in group])


def unrolled(head: DraftHead, input_ids: torch.Tensor, features: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """The head's predicted states `[b, seq, hidden]` for draft steps 1..depth at every position.

    Step 1 at position t reads (features[t], token t): the target's state at t - 1. Step j > 1 at t
    belongs to the chain that started at t - j + 1: it reads (its own step j - 1 prediction at t - 1,
    token t) and attends to step 1's keys at positions up to t - j + 1 (fed with true states, as the
    head's cache holds them when it drafts) and to steps 2..j of the same chain. Example, depth 2,
    t = 5: step 2 reads (P_1[4], token 5) and attends to step 1's keys 0..4 and to its own.
    """
    b, seq = input_ids.shape
    device = input_ids.device
    positions = torch.arange(seq, device=device)[None].expand(b, seq)  # [b, seq]
    cache = _KeyValueStack()
    steps = [head(input_ids, features, positions, None, cache)]  # causal over the width
    keys = torch.arange(seq, device=device)
    for j in range(2, depth + 1):
        fed = torch.cat([torch.zeros_like(steps[-1][:, :1]), steps[-1][:, :-1]], dim=1)  # [b, seq, hidden]
        blocks = [keys[None, :] <= (keys - (j - 1))[:, None]]  # step 1: true-state keys of the chain's context
        blocks += [keys[None, :] == (keys - (j - i))[:, None] for i in range(2, j + 1)]  # this chain's own steps
        mask = torch.cat(blocks, dim=1)[None, None]  # [1, 1, seq, j * seq], True = attend
        steps.append(head(input_ids, fed, positions, mask, cache))
    return steps


class _KeyValueStack:
    """A one-layer cache for `unrolled`: each pass appends its keys and values after the last pass's."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # [b, kv_heads, passes * seq, head_dim]
        self.values: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.keys is None:
            self.keys, self.values = key_states, value_states
        else:
            self.keys = torch.cat([self.keys, key_states], dim=2)
            self.values = torch.cat([self.values, value_states], dim=2)
        return self.keys, self.values


def _embedding_scale(head: DraftHead, target) -> float:
    """Typical RMS of the target's states over that of its embeddings, on a fixed probe sequence
    (token ids 1..64 of the vocabulary, positions 1 on: position 0 holds an attention sink)."""
    vocab = head.shared.embed.weight.shape[0]
    probe = torch.arange(1, FUSE_PROBE_TOKENS + 1) % vocab
    states = TargetStates(target, torch.float32)._forward(probe)[1:]  # [probe - 1, hidden]
    state_rms = states.pow(2).mean(-1).sqrt().median()
    embed_rms = head.shared.embed.weight.detach().float().pow(2).mean(-1).sqrt().median()
    return float(state_rms / embed_rms.clamp_min(1e-12))


def _smooth_l1_scaled(predicted: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """[n, hidden] x 2 -> [n]: smooth L1 of the prediction onto the state, both over the state's RMS."""
    scale = states.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)
    loss = torch.nn.functional.smooth_l1_loss(predicted / scale, states / scale, reduction="none")
    return loss.mean(-1)


class HeadTrainer:
    """LoRA on a `TrainableHead`'s layer, its fuse trained whole, and the optimiser; the interface of
    `DraftTrainer` (train_step, save, load, lora_state, restore, reset, records_used, tokens_used)."""

    def __init__(self, head: TrainableHead, settings: LoraSettings | None = None, *,
                 init_adapter: str | Path | None = None, target_id: str = "target",
                 draft_id: str = "head") -> None:  # fmt: skip
        settings = settings or HeadSettings()
        if not isinstance(settings, HeadSettings):  # an OnlineSettings' default: the head's own defaults on top
            settings = HeadSettings(**dataclasses.asdict(settings))
        if init_adapter is not None:
            lora_config = LoraConfig.from_pretrained(str(init_adapter))
            lora_config.inference_mode = False  # saved adapters say True: they would load frozen
            settings = dataclasses.replace(settings, r=lora_config.r, alpha=lora_config.lora_alpha,
                                           dropout=lora_config.lora_dropout,
                                           target_modules=tuple(sorted(lora_config.target_modules)))  # fmt: skip
        else:
            lora_config = LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                                     target_modules=list(settings.target_modules), modules_to_save=["fuse"],
                                     bias="none")  # fmt: skip
        self.settings = settings
        self.target_id = target_id
        self.draft_id = draft_id
        self.head = head
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            torch.manual_seed(settings.seed)
            self.model = get_peft_model(head, lora_config)
        self.model.eval()
        trainable = [name for name, p in self.model.named_parameters() if p.requires_grad]
        strays = [name for name in trainable if "lora_" not in name and ".fuse.modules_to_save." not in name]
        if not trainable or strays:
            raise AssertionError(f"only LoRA weights and the fuse may train, found {strays[:3]}")
        self._fuse = head.fuse.modules_to_save["default"]  # the trained copy; head.fuse.original_module is the base
        self._fuse_start = self._initial_fuse()
        with torch.no_grad():
            self._fuse.weight.copy_(self._fuse_start)
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = self._new_optimizer()
        self.steps = 0
        self.positions_trained = 0
        self._records: dict[str, int] = {}
        self.init_adapter = str(init_adapter) if init_adapter is not None else None
        self.parent_metadata: dict | None = None
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

    @property
    def states(self) -> TargetStates:
        return self.head.states

    def train_step(self, examples: Iterable[TrainingExample]) -> float:
        """One optimiser step on these examples; returns the step's loss (module docstring).

        The examples' target states are computed on first use and kept with them.
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
        self.head.layer.train(True)  # LoRA dropout on the head's own layer only
        total = 0.0
        try:
            for group in micro_batches(examples, settings.batch_tokens):
                batch = head_batch(self.head, [(example, example) for example in group])
                loss = self._loss(batch, total_weight, total_tokens)
                loss.backward()
                total += float(loss.detach())
        finally:
            self.head.layer.train(False)
        torch.nn.utils.clip_grad_norm_(self._params, settings.max_grad_norm)
        self.optimizer.step()
        self.steps += 1
        for example in examples:
            self.positions_trained += example.num_positions
            self._records.setdefault(example.request_id, example.num_positions)
        return total

    def _loss(self, batch: HeadBatch, total_weight: float, total_tokens: int) -> torch.Tensor:
        settings = self.settings
        features = batch.features
        if settings.noise > 0:
            scale = features.pow(2).mean(-1, keepdim=True).sqrt()  # [b, seq, 1]: 0 before position 0
            features = features + (torch.rand_like(features) * 2 - 1) * settings.noise * scale
        weights = self._weights(batch.accepted).to(features.device)  # [positions]
        loss = features.new_zeros(())
        for j, predicted in enumerate(unrolled(self.head, batch.input_ids, features, settings.unroll)):
            step_weight = settings.unroll_decay**j
            usable = batch.cols >= j  # step j + 1 needs a chain start at col - j >= 0
            picked = predicted[batch.rows[usable], batch.cols[usable]]  # [positions, hidden]
            kl = position_losses(self.head.logits(picked).float(), batch.target_topk_ids[usable],
                                 batch.target_topk_logprobs[usable], settings.loss)  # fmt: skip
            loss = loss + step_weight * (weights[usable] * kl).sum() / total_weight
            if settings.regression_weight > 0:
                real = batch.real.clone()
                real[:, :j] = False
                regression = _smooth_l1_scaled(predicted[real], batch.states[real]).sum() / total_tokens
                loss = loss + step_weight * settings.regression_weight * regression
        return loss

    def save(self, adapter_dir: str | Path) -> Path:
        """Write PEFT's adapter_config.json + adapter_model.safetensors and adaptive_spec_adapter.json."""
        adapter_dir = Path(adapter_dir)
        self.model.save_pretrained(str(adapter_dir))
        config = self.head.config
        metadata = {
            "format": METADATA_FORMAT,
            "created_at": time.time(),
            "target_id": self.target_id,
            "draft_id": self.draft_id,
            "draft_config": {
                "kind": "head",
                **{key: getattr(config, key, None) for key in ("model_type", "hidden_size", "vocab_size")},
                "num_hidden_layers": 1,
            },
            "settings": dataclasses.asdict(self.settings),
            "init_adapter": self.init_adapter,
            "steps": self.steps,
            "records_used": self.records_used,
            "tokens_used": self.tokens_used,
            "positions_trained": self.positions_trained,
            "target_state_forwards": self.states.forwards,
        }
        AdapterDir(adapter_dir).write_metadata(metadata)
        return adapter_dir

    def load(self, adapter_dir: str | Path) -> None:
        """Replace the LoRA and fuse weights by those saved in adapter_dir; the optimiser starts afresh.

        ValueError if the version's shape differs from this trainer's (rank, alpha, modules) or it
        does not cover every LoRA layer and the fuse.
        """
        adapter_dir = Path(adapter_dir)
        saved = LoraConfig.from_pretrained(str(adapter_dir))
        ours = self.model.peft_config["default"]
        shape = ("r", "lora_alpha", "target_modules", "modules_to_save")
        mismatched = [(f, getattr(saved, f), getattr(ours, f)) for f in shape
                      if _comparable(getattr(saved, f)) != _comparable(getattr(ours, f))]  # fmt: skip
        if mismatched:
            raise ValueError(f"head version {adapter_dir} does not fit this trainer: (field, saved, ours) {mismatched}")
        result = set_peft_model_state_dict(self.model, load_peft_weights(str(adapter_dir), device="cpu"))
        missing = [key for key in result.missing_keys if "lora_" in key or "modules_to_save" in key]
        if missing or result.unexpected_keys:
            raise ValueError(f"head version {adapter_dir} does not match the head: missing {missing[:3]}, "
                             f"unexpected {list(result.unexpected_keys)[:3]}")  # fmt: skip
        self.parent_metadata = AdapterDir(adapter_dir).metadata() or None
        self.optimizer = self._new_optimizer()

    def lora_state(self) -> dict[str, torch.Tensor]:
        """A copy of the trained weights (LoRA and the fuse), to come back to with `restore`."""
        return {name: p.detach().clone() for name, p in self.model.named_parameters() if p.requires_grad}

    def restore(self, lora_state: dict[str, torch.Tensor]) -> None:
        """The weights of a `lora_state()` copy, with the optimiser's moments cleared."""
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                if parameter.requires_grad:
                    parameter.copy_(lora_state[name])
        self.optimizer.state.clear()

    def reset(self) -> None:
        """As it started: LoRA's A as PEFT draws it (seeded), B = 0, the fuse at its starting value;
        the optimiser's moments cleared."""
        from peft.tuners.lora import LoraLayer

        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(self.settings.seed)
            for module in self.model.modules():
                if isinstance(module, LoraLayer):
                    for name in module.lora_A:
                        module.reset_lora_parameters(name, True)
            self._fuse.weight.copy_(self._fuse_start)
        self.optimizer.state.clear()

    def _initial_fuse(self) -> torch.Tensor:
        """[hidden, 2 * hidden]: [I | c I], c = the head's embedding scale (module docstring)."""
        weight = self.head.fuse.original_module.weight.detach().clone()
        hidden = weight.shape[0]
        eye = torch.eye(hidden, dtype=weight.dtype, device=weight.device)
        return torch.cat([eye, self.head.embedding_scale * eye], dim=1)

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self._params, lr=self.settings.lr, weight_decay=self.settings.weight_decay)

    def _weights(self, accepted: torch.Tensor) -> torch.Tensor:
        """[positions] float32 from [positions] bool."""
        return torch.where(accepted, self.settings.accepted_weight, self.settings.rejected_weight).float()


def _comparable(value):
    return sorted(value) if isinstance(value, (list, tuple, set)) else value
