"""The head as the trainer holds it: `TrainableHead` (a DraftHead that reads the target's hidden
states and scores itself for the gate), the target's states per record (`TargetStates`), padded
batches of examples with their states (`head_batch`), and the head unrolled on its own predictions
(`unrolled`). Trained by trainer/learning/head_distill.py; the module docstring there says what the head
reads and how it learns. `ScoredHead` is what it shares with the standard EAGLE-3 head as the trainer
holds it (trainer/learning/eagle3_model.py): the states it reads and the gate's figures of its drafts.

    head = TrainableHead(target)                    # a copy of the target's last layer, fuse [I | I], reading
                                                    # the target's state layers (feeding.state_layers)
    TrainableHead(target, feature_layers=(29,))     # the last layer alone (the default model's 30 layers)
    head.gate_figures(records)                      # GateFigures of its first draft token
    head.chain_figures(records, depth=4)            # how it does on its own states, step by step
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from adaptive_spec.cache.feeding import capture_states
from adaptive_spec.drafters.draft_head import DraftHead
from adaptive_spec.formats.record import CorrectionRecord
from trainer.evaluation.gate import GateFigures, Tally
from trainer.intake.examples import TrainingExample, collate, examples_from_record, micro_batches

FUSE_PROBE_TOKENS = 64  # the fixed probe that sets the fuse's embedding scale


class TargetStates:
    """The target's states at every position of a sequence (its `layers`' outputs side by side, the last what
    enters its final norm; feeding.state_layers by default), from one target forward, kept as long as the object
    it belongs to (an example, a held-out record) lives.

    Example: a record of a 90-token prompt and a 64-token output trains on 153 input tokens; one
    target forward over them gives `[153, 3 * hidden]` states, kept in fp16 (529 KB on the default model).
    """

    def __init__(self, target, dtype: torch.dtype = torch.float16, layers: tuple[int, ...] | None = None) -> None:
        self.target = target
        self.dtype = dtype
        self.layers = layers  # the layers whose outputs, side by side, make a state (None: feeding.state_layers)
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
        with capture_states(self.target, layers=self.layers) as captured:
            decoder(input_ids=input_ids[None].to(decoder.embed_tokens.weight.device), use_cache=False)
        self.forwards += 1
        self.tokens += int(input_ids.shape[0])
        self.seconds += time.perf_counter() - started
        return captured[0][0].to(self.dtype).cpu()  # [seq, hidden * layers]


class ScoredHead:
    """A head the trainer scores: called as `head(input_ids, states, position_ids, mask, cache)` -> predicted states
    [n, width, hidden], it reads the target's states (`states`, not a submodule) and says which of the target's
    tokens its predictions draft (`vocab_logits`, `draft_tokens`), so that the gate scores it (`gate_figures`) like
    any draft model, and a chain of its own steps too (`chain_figures`)."""

    states: TargetStates

    def vocab_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """[positions, hidden] predicted states -> [positions, vocab]: logits over the target's vocabulary."""
        raise NotImplementedError

    def draft_tokens(self, predicted: torch.Tensor) -> torch.Tensor:
        """[positions, hidden] -> [positions] int64: the target's token each prediction drafts greedily."""
        return self.vocab_logits(predicted).argmax(-1)

    def gate_figures(
        self, records: Iterable[CorrectionRecord | TrainingExample], batch_tokens: int = 2048, max_seq_len: int = 1024
    ) -> GateFigures:
        """The gate's figures of the head's first draft token, teacher-forced on the target's true
        states (trainer/evaluation/gate.py), with the head's adapters in whatever state they are in."""
        tally = Tally()
        with torch.inference_mode():
            for batch, ids in _head_batches(self, records, batch_tokens, max_seq_len):
                predicted = self(batch.input_ids, batch.features)  # [b, seq, hidden]
                tally.add(
                    self.vocab_logits(predicted[batch.rows, batch.cols]),
                    batch.target_topk_ids,
                    batch.target_topk_logprobs,
                    [ids[row] for row in batch.rows.tolist()],
                )
        return tally.figures()

    def chain_figures(
        self,
        records: Iterable[CorrectionRecord | TrainingExample],
        depth: int = 4,
        batch_tokens: int = 2048,
        max_seq_len: int = 1024,
    ) -> dict:
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
            for batch, _ in _head_batches(self, records, batch_tokens, max_seq_len):
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
                    drafted = self.draft_tokens(predicted[rows, cols])
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


class TrainableHead(ScoredHead, DraftHead):
    """A `DraftHead` as the trainer holds it: with the target whose states it reads, scored by the gate."""

    def __init__(
        self, target, state_dtype: torch.dtype = torch.float16, feature_layers: tuple[int, ...] | None = None
    ) -> None:
        super().__init__(target, feature_layers)
        self.states = TargetStates(target, state_dtype, self.feature_layers)
        self.embedding_scale = _embedding_scale(self, target)

    def vocab_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        return self.logits(predicted)  # the target's own final norm and LM head: the whole vocabulary


@dataclass
class HeadBatch:
    """Examples padded on the right with the target's states beside each token."""

    input_ids: torch.Tensor  # [b, seq] int64, 0-padded
    features: torch.Tensor  # [b, seq, layers * hidden]: the target's state at t - 1 beside token t (zeros at t = 0)
    states: torch.Tensor  # [b, seq, hidden]: the target's last layer's at t, what the head predicts there
    real: torch.Tensor  # [b, seq] bool: not padding
    rows: torch.Tensor  # [positions] int64: which example
    cols: torch.Tensor  # [positions] int64: which input index predicts the output position
    target_topk_ids: torch.Tensor  # [positions, m] int64
    target_topk_logprobs: torch.Tensor  # [positions, m] float32, -inf where padded
    accepted: torch.Tensor  # [positions] bool


def head_batch(head: ScoredHead, group: list[tuple[object, TrainingExample]]) -> HeadBatch:
    """One padded batch of (owner of the states, example) pairs."""
    batch = collate([example for _, example in group])
    b, seq = batch.input_ids.shape
    device = next(head.parameters()).device  # a ScoredHead is a module
    hidden = head.states.target.config.hidden_size  # each state layer's width: the last is what the head predicts
    computed = [head.states.of(owner, example.input_ids) for owner, example in group]  # [seq_i, layers * hidden]
    states = torch.zeros(b, seq, computed[0].shape[-1])
    for row, each in enumerate(computed):
        states[row, : each.shape[0]] = each
    features = torch.cat([torch.zeros(b, 1, states.shape[-1]), states[:, :-1]], dim=1)
    return HeadBatch(
        batch.input_ids.to(device),
        features.to(device),
        states[..., -hidden:].to(device),
        batch.attention_mask.bool().to(device),
        batch.rows.to(device),
        batch.cols.to(device),
        batch.target_topk_ids.to(device),
        batch.target_topk_logprobs.to(device),
        batch.accepted.to(device),
    )


def _head_batches(
    head: ScoredHead, records, batch_tokens: int, max_seq_len: int
) -> Iterator[tuple[HeadBatch, list[str]]]:
    """Records (their states kept with each record) or examples, in padded batches of `batch_tokens`,
    each with the request ids of its rows."""
    pairs = [
        (each, each if isinstance(each, TrainingExample) else examples_from_record(each, max_seq_len))
        for each in records
    ]
    owners = {id(example): owner for owner, example in pairs}
    examples = [example for _, example in pairs if example.num_positions]
    for group in micro_batches(examples, batch_tokens):
        yield head_batch(head, [(owners[id(example)], example) for example in group]), [e.request_id for e in group]


def unrolled(head: ScoredHead, input_ids: torch.Tensor, features: torch.Tensor, depth: int) -> list[torch.Tensor]:
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
    (token ids 1..64 of the vocabulary, positions 1 on: position 0 holds an attention sink). The
    embeddings as the head reads them, through the module: Gemma 3's scales its rows by sqrt(hidden),
    and the rows' own RMS put the head's fuse 8x off on a 64-wide Gemma 3, which training made worse."""
    vocab = head.shared.embed.weight.shape[0]
    probe = torch.arange(1, FUSE_PROBE_TOKENS + 1) % vocab
    states = TargetStates(target, torch.float32, head.feature_layers[-1:])._forward(probe)[1:]  # [probe - 1, hidden]
    state_rms = states.pow(2).mean(-1).sqrt().median()
    with torch.no_grad():
        embedded = head.shared.embed(probe.to(head.shared.embed.weight.device))  # [probe, hidden]
    embed_rms = embedded.float().pow(2).mean(-1).sqrt().median()
    return float(state_rms / embed_rms.clamp_min(1e-12))
