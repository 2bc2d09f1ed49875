"""The run: the fleet up, traffic and faults for the minutes asked, then the count (`run_chaos`'s figures)."""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

from adaptive_spec.contracts import ACTION_TAG, CORRECTION_STREAM, PAYLOAD_FIELD
from benchmarks.chaos.faults import Faults
from benchmarks.chaos.fleet import Fleet
from benchmarks.chaos.monitor import Monitor
from benchmarks.chaos.settings import ChaosSettings
from benchmarks.chaos.traffic import Tally, Users


def run_chaos(settings: ChaosSettings) -> dict:
    import tempfile

    workdir = settings.workdir or Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    fleet = Fleet(settings, workdir)
    tally = Tally()
    rng = random.Random(settings.seed)
    print(f"bench-chaos: starting the fleet in {workdir}", file=sys.stderr)
    began = time.time()
    try:
        fleet.start()
        started = time.time()
        print(
            f"bench-chaos: fleet up in {started - began:.0f} s; traffic for {settings.minutes:g} min", file=sys.stderr
        )
        with Monitor(fleet) as monitor:
            with Users(fleet, settings, tally):
                faults = Faults(fleet, monitor, rng)
                end = started + settings.minutes * 60
                while True:
                    gap = rng.uniform(*settings.fault_gap_s)
                    if time.time() + gap >= end:
                        _wait_reporting(end, tally, started)
                        break
                    _wait_reporting(time.time() + gap, tally, started)
                    faults.run(rng.choice(settings.faults))
            print(f"bench-chaos: traffic stopped after {time.time() - started:.0f} s; counting", file=sys.stderr)
        figures = _settle(fleet, monitor, tally, faults, started)
    finally:
        fleet.stop()
    figures["workdir"] = str(workdir)
    return figures


def _wait_reporting(until: float, tally: Tally, started: float, every_s: float = 30.0) -> None:
    """Sleep until `until`, with a progress line on stderr at every multiple of `every_s` since the start."""
    while (now := time.time()) < until:
        next_line = started + every_s * (int((now - started) // every_s) + 1)
        time.sleep(min(until, next_line) - now)
        if time.time() >= next_line:
            print(
                f"bench-chaos: {time.time() - started:5.0f} s: {tally.sent} sent, {tally.answered} answered, "
                f"{tally.failed_both} failed on both, {tally.live_5xx} 5xx from a live replica",
                file=sys.stderr,
            )


def _settle(fleet: Fleet, monitor: Monitor, tally: Tally, faults: Faults, started: float) -> dict:
    """After the traffic: stop the replicas (each writer flushes and logs its final counts), let the trainer
    read what is left, then count."""
    import redis

    from adaptive_spec.formats.record import CorrectionRecord

    minutes = round((time.time() - started) / 60, 2)
    for replica in fleet.replicas:
        replica.stop()
    client = redis.Redis.from_url(fleet.redis.url)
    deadline = time.time() + fleet.settings.settle_s
    while time.time() < deadline:
        group = next(iter(client.xinfo_groups(CORRECTION_STREAM)), None)
        if group and group["pending"] == 0 and (group.get("lag") or 0) == 0:
            break
        time.sleep(1.0)
    ids = []
    for _, fields in client.xrange(CORRECTION_STREAM):
        try:
            ids.append(CorrectionRecord.decode(fields[PAYLOAD_FIELD.encode()]).request_id)
        except ValueError:
            ids.append("undecodable")
    group = next(iter(client.xinfo_groups(CORRECTION_STREAM)), {})
    client.close()
    real = {i for i in ids if not i.startswith("chaos-bad-")}
    acknowledged = sum(sum(r.written.values()) for r in fleet.replicas)
    dropped = sum(sum(r.dropped.values()) for r in fleet.replicas)
    answered_without = len(set(tally.ids) - real)  # answered, and no record: dropped by a writer, or lost
    # Two lower bounds of the records Redis acknowledged and no longer holds: more acknowledged than distinct
    # records in the stream, and more answered requests without a record than the writers dropped.
    lost = max(0, acknowledged - len(real), answered_without - dropped)
    promoted = _promoted_by_the_trainer(fleet, monitor)
    swaps = {name: max(0, len(history) - 1) for name, history in monitor.served.items()}
    return {
        "minutes": minutes,
        "requests": {
            "sent": tally.sent,
            "answered": tally.answered,
            "failed_on_both": tally.failed_both,
            "retried_on_the_other": tally.retried,
            "5xx_from_a_live_replica": tally.live_5xx,
            "attempts": dict(tally.by_status),
            "by_adapter_version": dict(tally.versions),
        },
        "records": {
            "acknowledged_by_redis": acknowledged,
            "in_stream": len(real),
            "dropped_by_writers": dropped,
            "answered_without_a_record": answered_without,
            "lost": lost,
            "stream_entries": len(ids),
            "bad_injected": sum(1 for i in ids if i.startswith("chaos-bad-")),
            "group": {key: group.get(key) for key in ("entries-read", "lag", "pending")} if group else None,
            "trainer": _trainer_status(fleet),
        },
        "versions": {
            "promoted_by_the_trainer": len(promoted),
            "promoted": promoted,
            "forged": faults.forged,
            "forged_refused_by_both": sum(1 for f in faults.forged if len(f["refused_by"]) == 2 and f["never_served"]),
            "rollback_races": faults.races,
        },
        "swaps": swaps,
        "unplanned_exits": [{**e, "t": round(e["t"] - started, 1)} for e in fleet.unplanned_exits],
        "trainer_restarts": fleet.trainer_life - 1,
        "faults": [
            {**f, "start": round(f["start"] - started, 1), "end": round(f["end"] - started, 1)} for f in faults.done
        ],
        "timeline": [
            {"t": round(s["t"] - started, 1), **{k: v for k, v in s.items() if k != "t"}} for s in monitor.samples
        ],
        "answered_at": [round(t - started, 2) for t in tally.answered_at],
        "failed_at": [round(t - started, 2) for t in tally.failed_at],
        "promotions_at": sorted(
            round(e["received"] - started, 1)
            for e in monitor.events
            if e.get("event") == "promote" and str(e.get("by", "")).startswith("trainer")
        ),
    }


def _promoted_by_the_trainer(fleet: Fleet, monitor: Monitor) -> list[str]:
    """Versions the trainer promoted: from the registry's events (pub/sub, lost while Redis is away) and
    from each version's last-action tags (overwritten by a later hand move), so either one suffices."""
    heard = {
        str(e["version"])
        for e in monitor.events
        if e.get("event") == "promote" and str(e.get("by", "")).startswith("trainer")
    }
    registry = fleet.registry()
    try:
        tagged = {
            v.version
            for v in registry.versions()
            if v.tags.get(ACTION_TAG) == "promote" and str(v.tags.get(ACTION_TAG + "_by", "")).startswith("trainer")
        }
    finally:
        registry.close()
    return sorted(heard | tagged, key=int)


def _trainer_status(fleet: Fleet) -> dict | None:
    import redis

    from adaptive_spec.contracts import TRAINER_STATUS_KEY

    client = redis.Redis.from_url(fleet.redis.url)
    try:
        raw = client.get(TRAINER_STATUS_KEY)
        return json.loads(raw) if raw else None
    finally:
        client.close()
