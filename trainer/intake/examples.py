"""A correction record as the draft trains and is scored on it: teacher-forced input, and at each kept
output position the target's logged top-m; and examples padded into one forward pass.

    example = examples_from_record(record, max_seq_len=1024)       # what the replay buffer holds
    for group in micro_batches(examples, batch_tokens=2048):       # size x longest input <= 2048
        batch = collate(group)                                     # [batch, seq] ids, the kept positions flat
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from adaptive_spec.formats.record import CorrectionRecord


@dataclass(eq=False)
class TrainingExample:
    """One record as the draft trains on it: teacher-forced input and, per output position, the target's top-m.

    The logits of the draft at `input_ids[positions[j]]` predict output position j.
    """

    request_id: str
    input_ids: torch.Tensor  # [seq] int64: prompt + output[:-1], cut from the left to max_seq_len
    positions: torch.Tensor  # [n] int64: index into input_ids of the logits that predict each kept output position
    target_topk_ids: torch.Tensor  # [n, m] int64
    target_topk_logprobs: torch.Tensor  # [n, m] float16, as logged (not renormalised)
    accepted: torch.Tensor  # [n] bool: the draft proposed this token and the target accepted it

    @property
    def num_tokens(self) -> int:
        """Tokens fed to the draft, the cost of this example in a forward pass."""
        return int(self.input_ids.numel())

    @property
    def num_positions(self) -> int:
        return int(self.positions.numel())


def examples_from_record(record: CorrectionRecord, max_seq_len: int = 1024) -> TrainingExample:
    """The teacher-forced training example of one record.

    Example: prompt [p0 p1 p2], output [o0 o1]. The input is [p0 p1 p2 o0]; the logits at index 2
    (after p2) predict o0 and those at index 3 (after o0) predict o1, so positions = [2, 3].

    A sequence longer than `max_seq_len` loses tokens from the left, prompt first, so every output
    position stays as long as the prompt can give way. Output positions whose predicting token
    was cut (outputs longer than max_seq_len) are dropped. The draft then sees a shorter context
    than the target did, at shifted rotary positions, which is the price of a bounded step cost.

    A record logged without a top-m (m = 0) still teaches at temperature 0: the output token is
    the target's greedy token, so it stands in as a top-1 with probability 1. A sampled record
    without a top-m gives an example with no positions.
    """
    n_prompt, n_out = len(record.prompt_ids), len(record.output_ids)
    topk_ids = np.asarray(record.target_topk_ids, dtype=np.int64).reshape(n_out, -1)  # [n_out, m]
    topk_logprobs = np.asarray(record.target_topk_logprobs, dtype=np.float16).reshape(n_out, -1)  # [n_out, m]
    if topk_ids.shape[1] == 0 and record.temperature == 0:
        topk_ids = np.asarray(record.output_ids, dtype=np.int64).reshape(n_out, 1)
        topk_logprobs = np.zeros((n_out, 1), dtype=np.float16)
    input_ids = list(record.prompt_ids) + list(record.output_ids[:-1])
    start = max(0, len(input_ids) - max_seq_len)
    positions = np.arange(n_prompt - 1, n_prompt - 1 + n_out) - start  # [n_out]
    keep = positions >= 0 if topk_ids.shape[1] else np.zeros(n_out, dtype=bool)
    return TrainingExample(
        request_id=record.request_id,
        input_ids=torch.tensor(input_ids[start:], dtype=torch.long),
        positions=torch.from_numpy(positions[keep]),
        target_topk_ids=torch.from_numpy(topk_ids[keep]),
        target_topk_logprobs=torch.from_numpy(topk_logprobs[keep]),
        accepted=torch.tensor(record.accepted, dtype=torch.bool)[torch.from_numpy(keep)],
    )


@dataclass
class Batch:
    """Examples padded on the right into one forward pass; the kept positions flattened."""

    input_ids: torch.Tensor  # [batch, seq] int64, 0-padded
    attention_mask: torch.Tensor  # [batch, seq] int64
    rows: torch.Tensor  # [positions] int64: which example
    cols: torch.Tensor  # [positions] int64: which index of its input
    target_topk_ids: torch.Tensor  # [positions, m] int64 (m: the widest example; narrower ones padded with id 0)
    target_topk_logprobs: torch.Tensor  # [positions, m] float32, -inf where padded
    accepted: torch.Tensor  # [positions] bool


def collate(examples: list[TrainingExample]) -> Batch:
    seq = max(example.num_tokens for example in examples)
    m = max(example.target_topk_ids.shape[1] for example in examples)
    input_ids = torch.zeros(len(examples), seq, dtype=torch.long)
    attention_mask = torch.zeros(len(examples), seq, dtype=torch.long)
    ids, logprobs = [], []
    for row, example in enumerate(examples):
        input_ids[row, : example.num_tokens] = example.input_ids
        attention_mask[row, : example.num_tokens] = 1
        pad = m - example.target_topk_ids.shape[1]
        ids.append(torch.nn.functional.pad(example.target_topk_ids, (0, pad), value=0))
        logprobs.append(torch.nn.functional.pad(example.target_topk_logprobs.float(), (0, pad), value=-torch.inf))
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        rows=torch.cat([torch.full((e.num_positions,), row, dtype=torch.long) for row, e in enumerate(examples)]),
        cols=torch.cat([example.positions for example in examples]),
        target_topk_ids=torch.cat(ids),
        target_topk_logprobs=torch.cat(logprobs),
        accepted=torch.cat([example.accepted for example in examples]),
    )


def micro_batches(examples: list[TrainingExample], batch_tokens: int) -> Iterator[list[TrainingExample]]:
    """Group examples, shortest first, so that batch size * longest input <= batch_tokens (one at least)."""
    group: list[TrainingExample] = []
    for example in sorted(examples, key=lambda e: e.num_tokens):
        if group and (len(group) + 1) * example.num_tokens > batch_tokens:
            yield group
            group = []
        group.append(example)
    if group:
        yield group
