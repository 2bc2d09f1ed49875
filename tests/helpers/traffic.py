"""Correction records of greedy traffic on a tiny target, as the serving engine logs them.

from traffic import greedy_records       # tests/helpers is on the path (pyproject.toml: pythonpath)
records = greedy_records(llama(0, vocab=64), 128, domains=("json", "sql", None))
"""

from __future__ import annotations

import numpy as np

from adaptive_spec import Engine
from adaptive_spec.contracts import CORRECTION_STREAM, PAYLOAD_FIELD
from adaptive_spec.record import CorrectionRecord, record_from_output


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
) -> list[CorrectionRecord]:
    """`count` requests served by the Engine (k = 1, early-exit:1) with the target's top-m logged.

    Prompts use tokens [first_token, first_token + domain_tokens) only: a narrow domain, so a 1-layer draft can learn it.
    Request i is tagged domains[i % len(domains)]; ids are req-0, req-1, ... (`id_prefix`), seeded, so reruns agree.
    """
    engine = Engine(target, "early-exit:1", k=1, record_topk=top_m, eos_token_id=[], target_id="tiny-llama")
    rng = np.random.default_rng(0)
    return [
        record_from_output(
            engine.generate(
                rng.integers(first_token, first_token + domain_tokens, prompt_len).tolist(), max_new_tokens=new_tokens
            ),
            request_id=f"{id_prefix}-{i}",
            created_at=1_700_000_000.0 + i,
            domain=domains[i % len(domains)],
            target_id="tiny-llama",
            draft_id="early-exit:1",
            temperature=0.0,
        )
        for i in range(count)
    ]


def feed(client, records: list[CorrectionRecord], stream: str = CORRECTION_STREAM) -> None:
    """Append records to the correction stream as the servers' writers do (one pipeline)."""
    pipe = client.pipeline()
    for record in records:
        pipe.xadd(stream, {PAYLOAD_FIELD: record.encode()})
    pipe.execute()
