"""Correction records of greedy traffic on a tiny target, as the serving engine logs them, and bad ones.

from traffic import greedy_records       # tests/helpers is on the path (pyproject.toml: pythonpath)
records = greedy_records(llama(0, vocab=64), 128, domains=("json", "sql", None))
bad = bad_records(records[0], vocab=64)  # {"another target": ("model", record), ...}
"""

from __future__ import annotations

import dataclasses

import numpy as np

from adaptive_spec import Engine
from adaptive_spec.contracts import CORRECTION_STREAM, PAYLOAD_FIELD
from adaptive_spec.formats.record import CorrectionRecord, record_from_output


def greedy_records(
    target,
    count: int,
    *,
    domains=("json",),
    domain_tokens: int = 16,
    prompt_len: int = 8,
    new_tokens: int = 16,
    top_m: int = 8,
    first_token: int = 0,
    id_prefix: str = "req",
    target_id: str = "tiny-llama",
) -> list[CorrectionRecord]:
    """`count` requests served by the Engine (k = 1, early-exit:1) with the target's top-m logged.

    Prompts use tokens [first_token, first_token + domain_tokens) only: a narrow domain, so a 1-layer draft can learn it.
    Request i is tagged domains[i % len(domains)]; ids are req-0, req-1, ... (`id_prefix`), seeded, so reruns agree.
    A trainer keeps only its own target's records (trainer/intake/screening.py): `target_id` is the one it is given
    (`adaptive-spec train --target DIR` trains on DIR's).
    """
    engine = Engine(target, "early-exit:1", k=1, record_topk=top_m, eos_token_id=[], target_id=target_id)
    rng = np.random.default_rng(0)
    return [
        record_from_output(
            engine.generate(
                rng.integers(first_token, first_token + domain_tokens, prompt_len).tolist(), max_new_tokens=new_tokens
            ),
            request_id=f"{id_prefix}-{i}",
            created_at=1_700_000_000.0 + i,
            domain=domains[i % len(domains)],
            target_id=target_id,
            draft_id="early-exit:1",
            temperature=0.0,
        )
        for i in range(count)
    ]


def bad_records(good: CorrectionRecord, vocab: int) -> dict[str, tuple[str, CorrectionRecord]]:
    """One bad record of each kind a trainer of `good`'s target, draft and `vocab` must drop, made from
    `good`: name -> (the reason it is rejected for, trainer/intake/screening.py; the record). Each encodes, so it
    reaches a stream as any writer's record does. Nothing is proposed or accepted in them, so a changed
    output stays consistent with its proposals."""
    n_out = len(good.output_ids)
    plain = dataclasses.replace(good, proposed=[-1] * n_out, accepted=[False] * n_out)

    def bad(name: str, **changes) -> CorrectionRecord:
        return dataclasses.replace(plain, request_id=f"bad-{name}", **changes)

    def topk_ids(row: int, column: int, token: int) -> np.ndarray:
        ids = plain.target_topk_ids.copy()
        ids[row, column] = token
        return ids

    def logprobs(row: int, value: float) -> np.ndarray:
        values = plain.target_topk_logprobs.copy()
        values[row, :] = value
        return values

    m = vocab + 16
    wide = np.arange(n_out * m).reshape(n_out, m) % vocab  # [n_out, m]: a top-m wider than the vocabulary
    made = {
        "output id past the vocabulary": ("vocab", bad("output", output_ids=[*plain.output_ids[:-1], vocab])),
        "output id past 2^16": ("vocab", bad("output-wide", output_ids=[vocab + 70_000, *plain.output_ids[1:]])),
        "top-m id past the vocabulary": ("vocab", bad("topm", target_topk_ids=topk_ids(3, 5, vocab + 1))),
        "prompt id past the vocabulary": ("vocab", bad("prompt", prompt_ids=[vocab + 1000, *plain.prompt_ids[1:]])),
        "proposal past the vocabulary": ("vocab", bad("proposal", proposed=[vocab, *plain.proposed[1:]])),
        "another target": ("model", bad("target", target_id="another-model")),
        "another draft": ("model", bad("draft", draft_id="early-exit:2")),
        "top-m wider than the vocabulary": (
            "top_m",
            bad("wide", target_topk_ids=wide, target_topk_logprobs=np.full((n_out, m), -4.0)),
        ),
        "NaN log-probabilities": ("top_m", bad("nan", target_topk_logprobs=logprobs(2, np.nan))),
        "a top-m with no finite log-probability": ("top_m", bad("inf", target_topk_logprobs=logprobs(1, -np.inf))),
    }
    for _, record in made.values():
        record.encode()
    return made


def feed(client, records: list[CorrectionRecord], stream: str = CORRECTION_STREAM) -> None:
    """Append records to the correction stream as the servers' writers do (one pipeline)."""
    pipe = client.pipeline()
    for record in records:
        pipe.xadd(stream, {PAYLOAD_FIELD: record.encode()})
    pipe.execute()
