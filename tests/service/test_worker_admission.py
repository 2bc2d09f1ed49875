"""How the engine worker admits queued jobs (service/worker.py `_admit`): single-choice jobs that are queued
together join the batch in one call, so that their prompts are prefilled together (Batch.add_many), and a
joint prefill that fails is tried again job by job, so that only a job at fault fails; a job whose rows fail
to join leaves none behind, and a row that no job owns cannot end the engine thread."""

from __future__ import annotations

import asyncio
import time

import pytest
from faults import fails_after
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


def test_a_job_whose_rows_fail_to_join_fails_alone_and_the_worker_steps_on(engine, monkeypatch) -> None:
    """A job of n = 2 choices whose second row cannot join (its constraints fail to build) gets the error,
    leaves no row behind, and the next step serves the job admitted beside it: a row left in the batch
    with no job of the worker's would fail the step's hand-off and end the engine thread."""
    from adaptive_spec.decoding import batch as batch_module

    second_fails, built = fails_after(1, batch_module.Constraints, "constraints could not be built")

    async def main():
        worker = EngineWorker(engine, queue_size=8, max_batch=4)
        plain = Job([engine.request([5, 6, 7], max_new_tokens=4)], deadline=time.monotonic() + 30)
        group = Job(engine.requests([8, 9], 2, max_new_tokens=4, presence_penalty=0.5), deadline=time.monotonic() + 30)
        for job in (plain, group):
            worker.submit(job)
        batch = engine.new_batch(4)
        monkeypatch.setattr(batch_module, "Constraints", second_fails)
        assert worker._admit(batch)
        monkeypatch.undo()
        await asyncio.sleep(0)
        assert built == [True] and len(batch) == 1 and [owner for owner, _ in worker._active.values()] == [plain]
        assert type(group._events[0]).__name__ == "RuntimeError"
        worker._step(batch)  # the plain job's row decodes; no row without a job
        assert worker.died is None and len(batch) == 1

    asyncio.run(main())


def test_a_row_that_no_job_owns_leaves_the_batch_and_the_worker_steps_on(engine, caplog) -> None:
    """Should a row ever be left in the batch without a job (the failures above used to leave one), a step
    takes it out and says so, instead of failing the step's hand-off and ending the engine thread."""
    worker = EngineWorker(engine, queue_size=8, max_batch=4)
    batch = engine.new_batch(4)
    batch.add(engine.request([5, 6, 7], max_new_tokens=4))
    worker._step(batch)
    assert worker.died is None and len(batch) == 0
    assert "belongs to no job" in caplog.text
