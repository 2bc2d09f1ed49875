"""The faults, one method each (the kinds in `settings.FAULTS`), played one at a time with their outcome."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import random
import re
import signal
import subprocess
import sys
import time

import httpx
import numpy as np

from adaptive_spec.contracts import CORRECTION_STREAM, PAYLOAD_FIELD, SIGNATURE_FILE, WEIGHTS_FILE
from benchmarks.chaos.fleet import ADMIN_TOKEN, Fleet
from benchmarks.chaos.monitor import Monitor

log = logging.getLogger(__name__)


class Faults:
    def __init__(self, fleet: Fleet, monitor: Monitor, rng: random.Random) -> None:
        self.fleet, self.monitor, self.rng = fleet, monitor, rng
        self.done: list[dict] = []
        self.forged: list[dict] = []
        self.races: list[dict] = []

    def run(self, kind: str) -> dict:
        started = time.time()
        try:
            with self.fleet.busy:
                detail = getattr(self, kind)()
            ok = detail.pop("ok", True)
        except Exception as exc:  # a fault that could not be played is reported, never fatal to the run
            log.exception("fault %s", kind)
            detail, ok = {"error": f"{type(exc).__name__}: {exc}"}, False
        record = {**detail, "kind": kind, "start": started, "end": time.time(), "ok": ok}
        self.done.append(record)
        print(
            f"bench-chaos: {kind} ({record['end'] - started:.1f} s): {'ok' if ok else 'NOT OK'} {detail}",
            file=sys.stderr,
        )
        return record

    def redis_kill(self) -> dict:
        self.fleet.redis.kill()
        time.sleep(3.0)
        self.fleet.redis.start(timeout=30)
        return {}

    def redis_stop(self) -> dict:
        self.fleet.redis.pause()
        time.sleep(5.0)
        self.fleet.redis.resume()
        return {}

    def trainer_kill(self) -> dict:
        assert self.fleet.trainer is not None
        self.fleet.trainer.signal(signal.SIGKILL)
        self.fleet.trainer.wait(10)
        time.sleep(2.0)
        self.fleet.start_trainer()
        return {}

    def mlflow_down(self) -> dict:
        self.fleet.mlflow.stop()
        time.sleep(15.0)
        self.fleet.mlflow.start()
        return {}

    def replica_restart(self) -> dict:
        replica = self.rng.choice(self.fleet.replicas)
        replica.faulted.set()
        try:
            assert replica.child is not None
            replica.child.signal(signal.SIGTERM)
            code = replica.child.wait(90)
            replica.exited()
            replica.start()
        finally:
            time.sleep(2.0)  # in-flight answers of the old process are counted as faulted
            replica.faulted.clear()
        return {"replica": replica.name, "exit": code, "ok": code == 0}

    def bad_records(self) -> dict:
        import redis

        from adaptive_spec.formats.record import CorrectionRecord

        client = redis.Redis.from_url(self.fleet.redis.url)
        try:
            entries = client.xrevrange(CORRECTION_STREAM, count=1)
            if not entries:
                return {"skipped": "no record yet to copy"}
            good = CorrectionRecord.decode(entries[0][1][PAYLOAD_FIELD.encode()])
            n = len(good.output_ids)
            plain = dataclasses.replace(good, proposed=[-1] * n, accepted=[False] * n)
            nan = plain.target_topk_logprobs.copy()
            nan[0, :] = np.nan
            made = [
                dataclasses.replace(plain, output_ids=[*plain.output_ids[:-1], 10**6]),
                dataclasses.replace(plain, prompt_ids=[10**5, *plain.prompt_ids[1:]]),
                dataclasses.replace(plain, target_id="another-model"),
                dataclasses.replace(plain, draft_id="early-exit:9"),
                dataclasses.replace(plain, target_topk_logprobs=nan),
                dataclasses.replace(plain, output_ids=[70_000, *plain.output_ids[1:]]),
            ]
            for i, record in enumerate(made):
                record = dataclasses.replace(record, request_id=f"chaos-bad-{len(self.done)}-{i}")
                client.xadd(CORRECTION_STREAM, {PAYLOAD_FIELD: record.encode()})
            return {"written": len(made)}
        finally:
            client.close()

    def forged_version(self) -> dict:
        """Register a version without the key (or with a NaN weight, sealed again) and promote it; both replicas
        must refuse it; then roll back, as an operator would."""
        from safetensors.torch import load_file, save_file

        from adaptive_spec.formats.adapters import AdapterDir

        signed = self.fleet.registry()
        champion = signed.champion()
        if champion is None:
            return {"skipped": "no champion yet to forge from"}
        kind = self.rng.choice(["unsigned", "nan"])
        path = self.fleet.workdir / "forged" / f"f{len(self.done)}"
        staging = path.parent / f"download-{len(self.done)}"
        staging.mkdir(parents=True)
        signed.download(champion, staging).rename(path)
        (path / SIGNATURE_FILE).unlink(missing_ok=True)
        weights = load_file(str(path / WEIGHTS_FILE))
        name = sorted(weights)[0]
        weights[name] = weights[name] + (float("nan") if kind == "nan" else 1e-3)  # new weights, new sha256
        save_file(weights, str(path / WEIGHTS_FILE))
        adapter = AdapterDir(path)
        adapter.seal()
        if kind == "nan":
            adapter.sign("not-the-fleet-key-0123456789abcdef")
        before = {r.name: self.monitor.refusals(r) for r in self.fleet.replicas}
        forger = self.fleet.registry(signed=False)
        with contextlib.redirect_stdout(io.StringIO()):  # MLflow prints the run's URL: not part of the report
            version = forger.register(path, by="chaos:forger")
        reason = "corrupt" if kind == "nan" else "signature"
        deadline, refused = time.time() + 40, set[str]()
        while time.time() < deadline and len(refused) < 2:
            for replica in self.fleet.replicas:
                if self.monitor.refusals(replica).get(reason, 0) > before[replica.name].get(reason, 0):
                    refused.add(replica.name)
            time.sleep(0.5)
        served = {r: [v for _, v in h] for r, h in self.monitor.served.items()}
        never_served = all(version not in versions for versions in served.values())
        back = signed.rollback(by="chaos:operator")
        forged = {"version": version, "forgery": kind, "refused_by": sorted(refused), "never_served": never_served}
        self.forged.append(forged)
        return {**forged, "rolled_back_to": back["version"], "ok": len(refused) == 2 and never_served}

    def rollback_race(self) -> dict:
        """`adaptive-spec adapters rollback` (a process) and an admin-API promote of the newest version, together."""
        registry = self.fleet.registry()
        versions = [v.version for v in registry.versions()]
        champion = registry.champion()
        if len(versions) < 2 or champion is None or registry.aliases().get("previous") is None:
            return {"skipped": "fewer than two versions, or nothing to roll back to"}
        forged = {f["version"] for f in self.forged}
        newest = next((v for v in reversed(versions) if v != champion and v not in forged), None)
        if newest is None:
            return {"skipped": "no other genuine version to promote"}
        cli = subprocess.Popen(
            [sys.executable, "-m", "cli", "adapters", "rollback", "--data-dir", str(self.fleet.workdir / "operator")],
            env=self.fleet.env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(self.rng.uniform(1.0, 3.0))  # the CLI's imports take about that long
        promoted = httpx.post(
            self.fleet.replicas[0].url + "/admin/adapters/promote",
            json={"version": newest, "by": "chaos"},
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=120,
        )
        out, err = cli.communicate(timeout=120)
        after = registry.aliases()
        moved = re.search(r"rollback: champion (\S+) -> (\S+)", out)
        event = promoted.json().get("event", {}) if promoted.status_code == 200 else {}
        # the two orders: rollback then promote (champion = newest), or promote then rollback (champion = its from)
        consistent = cli.returncode == 0 and promoted.status_code == 200
        if consistent and moved is not None:
            promote_last = after.get("champion") == newest and event.get("aliases", {}).get("champion") == newest
            rollback_last = moved.group(1) == newest and after.get("champion") == moved.group(2)
            consistent = promote_last or rollback_last
        else:
            consistent = False
        race = {"cli": out.strip() or err.strip()[-300:], "promote": promoted.status_code, "after": after}
        self.races.append({**race, "consistent": consistent})
        return {**race, "ok": consistent}
