"""How the engine worker admits queued jobs (service/worker.py `_admit`): single-choice jobs that are queued
together join the batch in one call, so that their prompts are prefilled together (Batch.add_many), and a
joint prefill that fails is tried again job by job, so that only a job at fault fails."""

from __future__ import annotations

import asyncio
import time

import pytest
from tiny import llama

from adaptive_spec import Engine, InputError
from service.worker import EngineWorker, Job


@pytest.fixture(scope="module")
def engine():
    return Engine(llama(0, layers=2), "early-exit:1")


def _admit(
    engine, prompts: list[list[int]], fail_together: bool = False, bad: int | None = None, error: type = RuntimeError
):
    """Queue one job per prompt, admit them into a new batch; returns (calls of add_many, what each job got)."""

    async def main():
        worker = EngineWorker(engine, queue_size=8, max_batch=4)
        jobs = [Job([engine.request(p, max_new_tokens=4)], deadline=time.monotonic() + 30) for p in prompts]
        for job in jobs:
            worker.submit(job)
        batch = engine.new_batch(4)
        calls, add_many = [], batch.add_many

        def spy(requests):
            calls.append(len(requests))
            if fail_together and len(requests) > 1:
                raise RuntimeError("a joint prefill failed")
            if bad is not None and any(r is jobs[bad].requests[0] for r in requests):
                raise error("this prompt cannot be prefilled")
            return add_many(requests)

        batch.add_many = spy
        assert worker._admit(batch)
        await asyncio.sleep(0)  # the posted errors reach their jobs on this loop
        got = []
        for job in jobs:
            rows = [row for row, (owner, _) in worker._active.items() if owner is job]
            got.append("row" if rows else type(job._events[0]).__name__ if job._events else None)
        return calls, got, len(batch)

    return asyncio.run(main())


def test_single_choice_jobs_queued_together_join_in_one_call(engine) -> None:
    calls, got, rows = _admit(engine, [[5, 6, 7], [8, 9], [10, 11, 12, 13]])
    assert calls == [3] and got == ["row", "row", "row"] and rows == 3


def test_a_joint_prefill_that_fails_is_tried_job_by_job(engine) -> None:
    calls, got, rows = _admit(engine, [[5, 6, 7], [8, 9], [10, 11, 12, 13]], fail_together=True)
    assert calls == [3, 1, 1, 1] and got == ["row", "row", "row"] and rows == 3
    for error in (RuntimeError, InputError):  # whatever the bad one raises, the others join
        calls, got, rows = _admit(engine, [[5, 6, 7], [8, 9], [10, 11, 12, 13]], bad=1, error=error)
        assert calls == [3, 1, 1, 1] and got == ["row", error.__name__, "row"] and rows == 2
