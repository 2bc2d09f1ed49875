"""Correction records of real shape, with no model behind them: the intake benchmark's traffic.

records = [synthetic_record(rng, settings, vocab=49152, draft_id="head") for _ in range(2000)]
fill_stream(redis_url, CORRECTION_STREAM, records)      # as a server appends them
"""

from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from adaptive_spec.formats.record import CorrectionRecord
from service.correction_log import CorrectionLogWriter

DRAFT_K = 4  # draft tokens per step in the synthetic records
ACCEPTANCE = 0.5  # chance that each draft token is accepted, up to the first rejection


class RecordShape(Protocol):
    """What a synthetic record's shape follows (benchmarks/intake.py `IntakeBenchSettings`)."""

    target: str
    prompt_tokens: tuple[int, int]  # uniform, both ends included
    output_tokens: int
    topk: int


def synthetic_record(rng: np.random.Generator, settings: RecordShape, vocab: int, draft_id: str) -> CorrectionRecord:
    """One record shaped like those the server logs for a greedy, untagged request.

    Example with the defaults and the default model (vocab 49152): a 153-token prompt, 64 output
    tokens, at each the target's top-16 ids (the output token first: greedy) and log-probabilities,
    descending; uint16 ids, so header 32 + strings 75 (a 32-character request id, the target's and
    the draft's names) + 153 * 2 + 64 * 68.25 + CRC 4 = 4785 bytes encoded (record.py has the layout).
    """
    n_prompt = int(rng.integers(settings.prompt_tokens[0], settings.prompt_tokens[1] + 1))
    n_out, m = settings.output_tokens, min(settings.topk, vocab)
    output_ids = rng.integers(0, vocab, n_out)  # [n_out] the target's greedy tokens
    # Distinct ids in each row: the output token, then increasing offsets from it that stay below vocab.
    offsets = rng.integers(1, max(2, vocab // m), (n_out, m - 1)).cumsum(axis=1)  # [n_out, m - 1]
    topk_ids = np.concatenate([output_ids[:, None], (output_ids[:, None] + offsets) % vocab], axis=1)  # [n_out, m]
    probs = rng.dirichlet(np.full(m + 1, 0.5), n_out)  # [n_out, m + 1]: m tokens and the rest of the vocabulary
    topk_logprobs = np.log(np.maximum(-np.sort(-probs[:, :m], axis=1), 1e-30))  # [n_out, m] descending
    proposed, accepted = _drafting(rng, output_ids, vocab)
    return CorrectionRecord(
        request_id=rng.bytes(16).hex(),
        created_at=time.time(),
        domain=None,
        target_id=settings.target,
        draft_id=draft_id,
        adapter_version=None,
        temperature=0.0,
        prompt_ids=rng.integers(0, vocab, n_prompt),
        output_ids=output_ids,
        proposed=proposed,
        accepted=accepted,
        target_topk_ids=topk_ids,
        target_topk_logprobs=topk_logprobs,
    )


def _drafting(rng: np.random.Generator, output_ids: np.ndarray, vocab: int) -> tuple[list[int], list[bool]]:
    """(proposed, accepted) as the engine's trace fills them (adaptive_spec/decoding/request.py Trace.record):
    the prefill's token has no proposal; then each step drafts DRAFT_K tokens, keeps the accepted
    ones and adds the recovered token (proposed: the rejected draft token) or, when all were
    accepted, the bonus token (no proposal)."""
    proposed, accepted = [-1], [False]
    while len(proposed) < len(output_ids):
        n = 0
        while n < DRAFT_K and rng.random() < ACCEPTANCE:
            n += 1
        for i in range(n + 1):
            token = int(output_ids[len(proposed)])
            if i < n:
                proposed.append(token)
            else:
                proposed.append(-1 if n == DRAFT_K else (token + int(rng.integers(1, vocab))) % vocab)
            accepted.append(i < n)
            if len(proposed) == len(output_ids):
                break
    return proposed, accepted


def fill_stream(url: str, stream: str, records: list[CorrectionRecord]) -> int:
    """Append the records as a server does (CorrectionLogWriter); returns how many Redis took."""
    writer = CorrectionLogWriter(url, stream=stream, maxlen=max(100_000, len(records)), queue_size=len(records))
    for record in records:
        writer.submit(record)
    writer.flush(timeout=60.0)
    writer.close(timeout=5.0)
    return writer.written
