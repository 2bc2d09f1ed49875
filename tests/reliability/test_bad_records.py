"""Bad correction records written into the stream of a running `adaptive-spec train`: the process is never
restarted, and it trains its next round (trainer/intake/screening.py).

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/reliability/test_bad_records.py -q -s   (about 30 s)

As an operator met it: an `adaptive-spec up` whose trainer died with IndexError in the embedding on six
records (token ids past the vocabulary in the output or in the target's top-m, records of another
target), was restarted five times on the same records, and was given up. Here the trainer is a real
process on a tiny model directory with a private redis-server; the bad records are every kind the
screen knows, written among good ones, before and after its first round.
"""

from __future__ import annotations

import json
import signal

import pytest
import redis
from support import TrainProcess, eventually, tiny_target
from traffic import bad_records, feed, greedy_records

from adaptive_spec.contracts import CORRECTION_STREAM, TRAINER_GROUP, TRAINER_STATUS_KEY

pytestmark = pytest.mark.redis

ARGS = ["--min-new-records", "8", "--round-steps", "10", "--gate-min-positions", "48", "--checkpoint-every-s", "1"]


def status(client: redis.Redis) -> dict:
    raw = client.get(TRAINER_STATUS_KEY)
    return json.loads(raw) if raw else {}


def test_a_running_trainer_drops_bad_records_and_trains_its_next_round(redis_server, tiny_model_dir, tmp_path):
    client = redis.Redis.from_url(redis_server.url)
    target = tiny_target(0)
    records = greedy_records(target, 96, domains=(None,), target_id=str(tiny_model_dir))
    made = bad_records(records[0], target.config.vocab_size)
    bad = [record for _, record in made.values()]
    trainer = TrainProcess(tmp_path, tiny_model_dir, redis_server.url, ARGS)
    trainer.start()
    try:
        feed(client, records[:40] + bad[:5])
        eventually(lambda: status(client).get("round", 0) >= 1, 120, "the first round")
        feed(client, bad[5:] + records[40:])  # the operator's case: bad records into a trainer that runs
        first = status(client)["round"]
        eventually(lambda: status(client).get("round", 0) > first, 120, "the next round, past the bad records")
        eventually(lambda: client.xpending(CORRECTION_STREAM, TRAINER_GROUP)["pending"] == 0, 30, "all acknowledged")
        assert trainer.process.poll() is None, "the trainer exited"
        seen = status(client)
        trainer.signal(signal.SIGTERM)
        assert trainer.wait(60) == 0, trainer.log()[-3000:]
    finally:
        trainer.stop()
    log = trainer.log()
    expected: dict[str, int] = {}
    for reason, _ in made.values():
        expected[reason] = expected.get(reason, 0) + 1
    print(
        f"\n{len(bad)} bad records among {len(records)} good: rounds {first} -> {seen['round']}, the dashboard's "
        f"trainer status says {seen['rejected_records']} rejected {seen['rejected_by_reason']}; exit 0 on SIGTERM"
    )
    assert seen["rejected_records"] == len(bad) and seen["rejected_by_reason"] == expected
    assert "Traceback" not in log and "IndexError" not in log
    assert log.count("rejected correction record") >= len(expected)  # each reason logged, a flood only a few times
    client.close()
