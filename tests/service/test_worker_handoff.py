"""The hand-off between the engine thread and the handlers' event loop (service/worker.py): a step's
chunks reach every job in order with one wake-up of the loop, and a job that waits wakes for them."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from service.worker import Ended, Job, post_all


def test_a_steps_chunks_reach_each_job_in_order_with_one_wake_up_per_loop():
    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job([], deadline=time.monotonic() + 5) for _ in range(3)]
        wakeups = []
        original = loop.call_soon_threadsafe

        def counting(callback, *args):
            wakeups.append(callback)
            return original(callback, *args)

        loop.call_soon_threadsafe = counting
        waiting = [asyncio.ensure_future(job.next_event()) for job in jobs]  # each waits before anything is posted
        await asyncio.sleep(0.01)

        def engine_thread():
            post_all([(job, f"step 1, job {i}") for i, job in enumerate(jobs)])
            post_all([(job, f"step 2, job {i}") for i, job in enumerate(jobs)])

        thread = threading.Thread(target=engine_thread)
        thread.start()
        firsts = await asyncio.gather(*waiting)
        thread.join()
        seconds = [await job.next_event() for job in jobs]
        return firsts, seconds, len(wakeups)

    firsts, seconds, wakeups = asyncio.run(main())
    assert firsts == [f"step 1, job {i}" for i in range(3)]
    assert seconds == [f"step 2, job {i}" for i in range(3)]
    assert wakeups == 2  # one per step, not one per job


def test_an_error_posted_is_raised_and_a_job_past_its_deadline_ends():
    async def main():
        job = Job([], deadline=time.monotonic() + 5)
        threading.Thread(target=job.post, args=(ValueError("bad row"),)).start()
        with pytest.raises(ValueError, match="bad row"):
            await job.next_event()
        late = Job([], deadline=time.monotonic() + 0.05)
        started = time.monotonic()
        with pytest.raises(Ended) as ended:
            await late.next_event(poll_s=0.02)  # wakes every poll_s and gives up at the deadline
        return ended.value.reason, late.cancelled, time.monotonic() - started

    reason, cancelled, waited = asyncio.run(main())
    assert (reason, cancelled) == ("timeout", True)
    assert waited < 2.0
