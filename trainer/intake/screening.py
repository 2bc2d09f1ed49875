"""Which correction records a trainer may train on: its own target's and draft's, with every token id
inside its vocabulary and a top-m it can read.

    screen = RecordScreen(target_id="smollm2-135m-instruct", draft_id="head", vocab_size=vocab_size(draft))
    screen.check(record)       # None (train on it), or why not: (one of REASONS, the detail for the log)

Any Redis client can append to the correction stream, and a second deployment with another target may
share its name. `CorrectionRecord.decode` checks that a record is well formed (ids below 2^32, lengths
that agree); only the trainer knows its own models. One record with an output id at or past the
vocabulary raised IndexError in the embedding in every round, and, still pending or in the checkpoint's
buffer, on every restart. The intake (trainer/intake/intake.py) screens each record before it keeps it: a
record that fails is acknowledged at once, counted by reason (the trainer's counters() and its status,
which the dashboard shows) and dropped, never retried.

Reasons (the label of that count):

- "model": written for another target or draft (`target_id` / `draft_id` are not the trainer's, the
  same pair a server checks before it swaps to a version): its ids name another vocabulary's tokens
  even when they fit this one;
- "vocab": a prompt, output, proposed or top-m token id at or past the vocabulary: the rows of the
  draft's embedding and of its LM head, the fewer (a head draft's are the target's);
- "shape": lengths that disagree, or an accepted token that is not the one proposed
  (`CorrectionRecord.validate`; a record built in memory, say restored from a checkpoint, gets here
  without decode);
- "top_m": a top-m wider than the vocabulary, a log-probability that is NaN or +inf, or a position
  whose top-m has no finite log-probability: the loss would be NaN, and so would the adapter.

Tests (a real redis-server): `.venv/bin/python -m pytest tests/trainer/test_bad_records.py -q`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from adaptive_spec.drafters.draft_head import DraftHead
from adaptive_spec.formats.record import CorrectionRecord

REASONS = ("model", "vocab", "shape", "top_m")


def vocab_size(draft_model) -> int:
    """Token ids the trainer can feed the draft and score: the rows of its embedding and of its LM head,
    the fewer. A head reads the target's, as it drafts with them."""
    if isinstance(draft_model, DraftHead):
        embed, lm_head = draft_model.shared.embed, draft_model.shared.lm_head
    else:
        embed, lm_head = draft_model.get_input_embeddings(), draft_model.get_output_embeddings()
    return min(embed.weight.shape[0], lm_head.weight.shape[0])


@dataclass(frozen=True)
class RecordScreen:
    target_id: str
    draft_id: str
    vocab_size: int

    def check(self, record: CorrectionRecord) -> tuple[str, str] | None:
        """None for a record the trainer may keep, else (reason, what exactly) for its count and its log,
        e.g. ("vocab", "output_ids holds 70000, the vocabulary has 49152 tokens")."""
        theirs, ours = (record.target_id, record.draft_id), (self.target_id, self.draft_id)
        if theirs != ours:
            return "model", f"written for target {theirs[0]!r} and draft {theirs[1]!r}, this trainer's are {ours}"
        try:
            record.validate()
        except ValueError as error:
            return "shape", str(error)
        topk_ids, logprobs = record.target_topk_ids, record.target_topk_logprobs  # [n_out, m] each
        for name, ids in (
            ("prompt_ids", record.prompt_ids),
            ("output_ids", record.output_ids),
            ("proposed", record.proposed),
            ("target_topk_ids", topk_ids),
        ):
            ids = np.asarray(ids)
            if ids.size and int(ids.max()) >= self.vocab_size:
                return "vocab", f"{name} holds {int(ids.max())}, the vocabulary has {self.vocab_size} tokens"
        if topk_ids.shape[1] > self.vocab_size:
            return "top_m", f"a top-{topk_ids.shape[1]} is wider than the vocabulary ({self.vocab_size} tokens)"
        if np.isnan(logprobs).any() or np.isposinf(logprobs).any():
            return "top_m", "a top-m log-probability is NaN or +inf"
        if logprobs.size and not np.isfinite(logprobs).any(axis=1).all():
            return "top_m", "a position's top-m has no finite log-probability"
        return None
