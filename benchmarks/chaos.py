"""`adaptive-spec bench-chaos`: a small fleet on loopback under traffic, with a random fault every 20-40 s.

    adaptive-spec bench-chaos --minutes 20 --json chaos.json --plot chaos.png     # the run RELIABILITY.md reports
    adaptive-spec bench-chaos --minutes 3                                          # a short look (CPU: ~3 minutes)
    adaptive-spec bench-chaos --target smollm2-135m-instruct --draft head          # the default model instead

The fleet, as the README's fleet section and ops/compose.yaml run it, every process on 127.0.0.1: Redis
(append-only, a password, `maxmemory` with `noeviction`), an `mlflow server`, two `adaptive-spec serve`
replicas and one `adaptive-spec train`, sharing one signing key. `--users` closed-loop users send
completions; each picks the next replica in turn and, when a request fails (refused, reset, or a 5xx),
sends it once to the other replica, as a load balancer that retries would.

Faults, one at a time, each 20-40 s after the last one ended, chosen at random (`--seed`):

| fault | what happens | what must hold |
|---|---|---|
| `redis_kill` | SIGKILL, restarted 3 s later on its port and files | no request fails; no record Redis acknowledged is lost |
| `redis_stop` | SIGSTOP for 5 s, then SIGCONT | the same |
| `trainer_kill` | SIGKILL, restarted 2 s later (an orchestrator's job) | it resumes from its checkpoint and re-reads what it had not acknowledged |
| `mlflow_down` | the server stopped for 15 s | serving goes on; promotions wait and land |
| `replica_restart` | SIGTERM to one replica, restarted on its port | its requests in flight finish; the others go to the other replica |
| `bad_records` | 6 bad records (ids past the vocabulary, another target, NaN log-probabilities) written into the stream | the trainer drops them and trains on |
| `forged_version` | a version registered by hand without the key (unsigned, or with a NaN weight) and promoted | both replicas refuse it and keep serving; then an operator's rollback |
| `rollback_race` | `adapters rollback` (a process) and an admin-API promotion at the same moment | the aliases end as the two moves made one after the other |

The report: requests sent, answered and failed (on both replicas), retried, 5xx from a replica that was
not being faulted; records Redis acknowledged (each writer's `written`, from the line each server process logs
as it stops) against the distinct records in the stream at the end: lost is the larger of two lower bounds,
acknowledged minus in the stream, and answered requests without a record minus what the writers dropped (a
record dropped while Redis was away for longer than the writer's queue lasts was never acknowledged); the
trainer's status; versions the trainer promoted, versions forged and which replicas refused each; swaps;
every fault with its outcome; processes that exited without a fault (restarted, as an orchestrator would).
`--json` writes it with a timeline (one sample a second) and `--plot` draws the timeline with the faults
marked. The bar (`bar`) is the issue's: no acknowledged record lost, no request failed on both replicas, no
5xx from a live replica, at least one version promoted, every forged or NaN version refused by both
replicas; the command exits 1 when any of them fails.

The model: by default the tests' tiny random Llama (benchmarks/tiny_model.py: 4 layers, 64 wide, 112
tokens) with the draft `early-exit:1`. On 2 CPU cores, three processes of the default model would decode
a few requests a minute between them and promote perhaps once in 20 minutes; the tiny model runs every
code path (records, rounds, the gate, registration, signatures, swaps) hundreds of times in the same time,
which is what faults need.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import json
import logging
import random
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from adaptive_spec.contracts import (
    ACTION_TAG,
    COMPILE_ENV,
    CORRECTION_STREAM,
    PAYLOAD_FIELD,
    SIGNATURE_FILE,
    WEIGHTS_FILE,
)
from launch.mlflow import MlflowServer
from launch.processes import Child, child_env, free_port, http_ok
from launch.redis import RedisServer

log = logging.getLogger(__name__)

FAULTS = (
    "redis_kill",
    "redis_stop",
    "trainer_kill",
    "mlflow_down",
    "replica_restart",
    "bad_records",
    "forged_version",
    "rollback_race",
)
API_KEY, ADMIN_TOKEN = secrets.token_hex(16), secrets.token_hex(16)
TINY_TRAIN_ARGS = ["--min-new-records", "24", "--round-steps", "20", "--gate-min-positions", "60"]


@dataclass(frozen=True)
class ChaosSettings:
    minutes: float = 20.0
    users: int = 4
    seed: int = 0
    fault_gap_s: tuple[float, float] = (20.0, 40.0)
    faults: tuple[str, ...] = FAULTS  # the kinds drawn from (a test forces one or two)
    settle_s: float = 60.0  # after the traffic: how long the trainer may take to read what is left
    target: str | None = None  # None: a tiny model built in code
    draft: str = "early-exit:1"
    max_tokens: int = 12
    workdir: Path | None = None


# ---------------------------------------------------------------- the processes


class Replica:
    """One `adaptive-spec serve` on a fixed port; `life` counts its processes, `faulted` is set while a fault
    stops it on purpose (a failure then is expected; a 5xx otherwise is not)."""

    def __init__(self, name: str, fleet: Fleet) -> None:
        self.name, self.fleet, self.port = name, fleet, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.life = 0
        self.faulted = threading.Event()
        self.child: Child | None = None
        self.written: dict[int, int] = {}  # life -> its writer's `written`, as last seen on /health
        self.dropped: dict[int, int] = {}  # life -> its writer's `dropped` (Redis away and its queue full)

    def start(self, wait: bool = True) -> None:
        self.life += 1
        data = self.fleet.workdir / self.name
        # --verbose: the server logs its writer's final counts as it stops (read by `exited`)
        command = [sys.executable, "-m", "cli", "--verbose", "serve", *self.fleet.model_flags(), "--k", "3"]
        command += ["--port", str(self.port), "--data-dir", str(data)]
        self.child = Child(command, data / f"serve-{self.life}.log", env=self.fleet.env(serving=True)).start()
        if wait:
            self.ready()

    def ready(self) -> None:
        assert self.child is not None
        self.child.wait_until(lambda: http_ok(self.url + "/health"), 300, f"replica {self.name}")

    def stop(self) -> int | None:
        """SIGTERM (SIGKILL after 60 s); returns the exit code."""
        code = None if self.child is None else self.child.stop(60)
        self.exited()
        return code

    def exited(self) -> None:
        """After its process ended: the writer's final counts, from the line the server logs as it stops
        (service/runtime.py: "stopped; correction log {...}"), else the last /health's."""
        if self.child is None or self.child.log_path is None or not self.child.log_path.is_file():
            return
        found = re.findall(r"stopped; correction log (\{.*?\})", self.child.log_path.read_text(errors="replace"))
        if found:
            counts = ast.literal_eval(found[-1])
            self.written[self.life], self.dropped[self.life] = counts["written"], counts["dropped"]
        self.child = None


class Fleet:
    def __init__(self, settings: ChaosSettings, workdir: Path) -> None:
        self.settings, self.workdir = settings, workdir
        self.signing_key = secrets.token_hex(32)
        self.redis = RedisServer(workdir / "redis", persist=True, password=secrets.token_hex(16), maxmemory="1gb")
        self.mlflow = MlflowServer(workdir / "mlflow")
        self.replicas = [Replica("a", self), Replica("b", self)]
        self.trainer: Child | None = None
        self.trainer_life = 0
        self.busy = threading.Lock()  # held by a fault, so the supervisor never restarts what a fault stopped
        self.unplanned_exits: list[dict] = []  # processes that died without a fault, restarted as an orchestrator would
        self.target = settings.target or str(_tiny_model(workdir / "tiny-model"))

    def model_flags(self) -> list[str]:
        return ["--target", self.target, "--draft", self.settings.draft, "--dtype", "fp32", "--device", "cpu"]

    def env(self, serving: bool = False) -> dict[str, str]:
        extra = {
            "REDIS_URL": self.redis.url,
            "MLFLOW_TRACKING_URI": self.mlflow.url,
            "ADAPTIVE_SPEC_SIGNING_KEY": self.signing_key,
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            COMPILE_ENV: "0",  # eager decoding: a restarted replica serves in seconds, not after minutes of compiling
        }
        if serving:
            extra |= {
                "ADAPTIVE_SPEC_ADMIN_TOKEN": ADMIN_TOKEN,
                "ADAPTIVE_SPEC_API_KEY": API_KEY,
                "ADAPTIVE_SPEC_ADAPTER_POLL_S": "1",
                "ADAPTIVE_SPEC_RECORD_TOPK": "8",
                # every record of the run stays: a trimmed stream would look like records lost
                "ADAPTIVE_SPEC_STREAM_MAXLEN": "1000000",
                "ADAPTIVE_SPEC_SERVED_MODEL_NAME": "chaos",
            }
        drop = ("REDIS_URL", "MLFLOW_TRACKING_URI", "ADAPTIVE_SPEC_API_KEY", "ADAPTIVE_SPEC_ADMIN_TOKEN")
        return child_env(drop, **extra)

    def start(self) -> None:
        for name in ("redis", "mlflow", "trainer", "a", "b"):
            (self.workdir / name).mkdir(parents=True, exist_ok=True)
        self.redis.start()
        self.mlflow.start()
        for replica in self.replicas:
            replica.start(wait=False)
        self.start_trainer()
        for replica in self.replicas:
            replica.ready()

    def start_trainer(self) -> None:
        self.trainer_life += 1
        command = [
            sys.executable,
            "-m",
            "cli",
            "train",
            *self.model_flags(),
            "--data-dir",
            str(self.workdir / "trainer"),
        ]
        command += ["--threads", "1", "--consumer", "trainer-0", "--checkpoint-every-s", "5"]
        command += TINY_TRAIN_ARGS if self.settings.target is None else []
        log_path = self.workdir / "trainer" / f"train-{self.trainer_life}.log"
        self.trainer = Child(command, log_path, env=self.env()).start()

    def supervise(self, at: float) -> None:
        """An orchestrator's restart policy: a replica or the trainer that exited while no fault was playing
        is restarted, and counted (the report's `unplanned_exits`)."""
        if not self.busy.acquire(blocking=False):
            return
        try:
            if self.trainer is not None and not self.trainer.running:
                code = self.trainer.process.returncode if self.trainer.process else None
                self.unplanned_exits.append({"t": at, "process": "trainer", "exit": code})
                print(
                    f"bench-chaos: the trainer exited by itself ({self.trainer.log_path}); restarted", file=sys.stderr
                )
                self.start_trainer()
            for replica in self.replicas:
                if replica.child is not None and not replica.child.running:
                    code = replica.child.process.returncode if replica.child.process else None
                    self.unplanned_exits.append({"t": at, "process": replica.name, "exit": code})
                    print(f"bench-chaos: replica {replica.name} exited by itself; restarted", file=sys.stderr)
                    replica.exited()
                    replica.start(wait=False)
        finally:
            self.busy.release()

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()
        if self.trainer is not None:
            self.trainer.stop(60)
        self.mlflow.stop()
        self.redis.stop()

    def registry(self, signed: bool = True):
        from registry.client import AdapterRegistry

        return AdapterRegistry(
            self.mlflow.url,
            data_dir=self.workdir / "operator",
            redis_url=self.redis.url,
            signing_key=self.signing_key if signed else None,
        )


def _tiny_model(path: Path) -> Path:
    from benchmarks.tiny_model import save_tiny_model  # torch and transformers: only when the fleet starts

    return save_tiny_model(path)


# ---------------------------------------------------------------- traffic


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    failed_both: int = 0
    retried: int = 0
    live_5xx: int = 0
    by_status: Counter = field(default_factory=Counter)  # per attempt: "a:200", "b:ConnectError", ...
    answered_at: list[float] = field(default_factory=list)
    failed_at: list[float] = field(default_factory=list)
    versions: Counter = field(default_factory=Counter)
    ids: list[str] = field(default_factory=list)  # request ids answered: each has a record unless dropped


class Users:
    """Closed-loop users; a failed attempt is sent once more to the other replica."""

    def __init__(self, fleet: Fleet, settings: ChaosSettings, tally: Tally) -> None:
        self.fleet, self.tally, self.settings = fleet, tally, settings
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._turn = 0
        rng = np.random.default_rng(settings.seed)
        if settings.target is None:  # token prompts from a narrow range: a 1-layer draft can learn the traffic
            self.prompts: list = [rng.integers(3, 19, 8).tolist() for _ in range(16)]
        else:
            from adaptive_spec.prompts import load_prompts
            from benchmarks.prompts import shipped

            self.prompts = [item.prompt for item in load_prompts(shipped("json_extraction"))[:64]]
        self.threads = [threading.Thread(target=self._user, daemon=True) for _ in range(settings.users)]

    def __enter__(self) -> Users:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)

    def _user(self) -> None:
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            while not self.stop.is_set():
                with self._lock:
                    self._turn += 1
                    first = self._turn % 2
                    prompt = self.prompts[self._turn % len(self.prompts)]
                    self.tally.sent += 1
                order = [self.fleet.replicas[first], self.fleet.replicas[1 - first]]
                for attempt, replica in enumerate(order):
                    ok = self._attempt(client, replica, prompt)
                    if ok:
                        break
                    if attempt == 0:
                        with self._lock:
                            self.tally.retried += 1
                else:
                    with self._lock:
                        self.tally.failed_both += 1
                        self.tally.failed_at.append(time.time())
                    time.sleep(0.2)

    def _attempt(self, client: httpx.Client, replica: Replica, prompt) -> bool:
        faulted = replica.faulted.is_set()
        body = {"model": "chaos", "max_tokens": self.settings.max_tokens, "temperature": 0}
        chat = isinstance(prompt, list) and isinstance(prompt[0], dict)
        try:
            if chat:
                answer = client.post(replica.url + "/v1/chat/completions", json={**body, "messages": prompt})
            else:
                answer = client.post(replica.url + "/v1/completions", json={**body, "prompt": prompt})
            status = str(answer.status_code)
        except httpx.HTTPError as exc:
            answer, status = None, type(exc).__name__
        with self._lock:
            self.tally.by_status[f"{replica.name}:{status}"] += 1
            if answer is not None and answer.status_code >= 500 and not (faulted or replica.faulted.is_set()):
                self.tally.live_5xx += 1
            if answer is not None and answer.status_code == 200:
                self.tally.answered += 1
                self.tally.answered_at.append(time.time())
                self.tally.versions[answer.json()["usage"]["spec_decode"]["adapter_version"] or "base"] += 1
                self.tally.ids.append(answer.headers.get("x-request-id", ""))
                return True
        return False


# ---------------------------------------------------------------- watching


class Monitor:
    """Once a second: what each replica serves and its writer's counters; the registry's events (pub/sub)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.samples: list[dict] = []
        self.events: list[dict] = []
        self.served: dict[str, list[tuple[float, str | None]]] = {r.name: [] for r in fleet.replicas}
        self.stop = threading.Event()
        from registry.events import AdapterEvents

        self._events = AdapterEvents(fleet.redis.url)
        self._threads = [
            threading.Thread(target=self._poll, daemon=True),
            threading.Thread(target=self._events.listen, args=(self._event, self.stop), daemon=True),
        ]

    def __enter__(self) -> Monitor:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(10)

    def _event(self, event: dict) -> None:
        self.events.append({**event, "received": time.time()})

    def health(self, replica: Replica) -> dict | None:
        try:
            answer = httpx.get(replica.url + "/health", timeout=2)
            return answer.json() if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def refusals(self, replica: Replica) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = httpx.get(replica.url + "/metrics", timeout=5).text
        except httpx.HTTPError:
            return {}
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "adaptive_spec:adapter_refusals_total":
                    found[sample.labels["reason"]] = sample.value
        return found

    def _poll(self) -> None:
        while not self.stop.wait(1.0):
            self.fleet.supervise(time.time())
            sample: dict = {"t": time.time()}
            for replica in self.fleet.replicas:
                health = self.health(replica)
                sample[replica.name] = None if health is None else health["adapter_version"]
                if health is not None:
                    replica.written[replica.life] = health["correction_log"]["written"]
                    replica.dropped[replica.life] = health["correction_log"]["dropped"]
                    history = self.served[replica.name]
                    if not history or history[-1][1] != health["adapter_version"]:
                        history.append((time.time(), health["adapter_version"]))
            self.samples.append(sample)


# ---------------------------------------------------------------- faults


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

        from adaptive_spec.record import CorrectionRecord

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

        from adaptive_spec.adapters import AdapterDir

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


# ---------------------------------------------------------------- the run


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

    from adaptive_spec.record import CorrectionRecord

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


def bar(figures: dict) -> dict[str, bool]:
    """The issue's bar, checked on the figures: what a 20-minute run must show."""
    requests, records, versions = figures["requests"], figures["records"], figures["versions"]
    return {
        "no acknowledged record lost": records["lost"] == 0,
        "no request failed on both replicas": requests["failed_on_both"] == 0,
        "no 5xx from a live replica": requests["5xx_from_a_live_replica"] == 0,
        "a version promoted": versions["promoted_by_the_trainer"] >= 1,
        "every forged or NaN version refused by both replicas": versions["forged_refused_by_both"]
        == len(versions["forged"]),
    }


def plot(figures: dict, path: Path) -> None:
    """Requests answered per 5 s, failures, promotions and swaps on one time axis, each fault a shaded span."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seconds = figures["minutes"] * 60
    bins = np.arange(0, seconds // 5 * 5 + 1, 5)  # whole 5 s bins: a partial last one would read as a drop
    fig, ax = plt.subplots(figsize=(13, 5))
    answered, _ = np.histogram(figures["answered_at"], bins)
    ax.plot(bins[:-1], answered / 5, color="tab:blue", label="requests answered / s")
    if figures["failed_at"]:
        ax.scatter(
            figures["failed_at"], [0] * len(figures["failed_at"]), color="red", marker="x", label="failed on both"
        )
    colours = {kind: plt.get_cmap("tab10")(i) for i, kind in enumerate(FAULTS)}
    top = max(1.0, float(answered.max() / 5) if len(answered) else 1.0)
    for fault in figures["faults"]:
        ax.axvspan(
            fault["start"], max(fault["end"], fault["start"] + 1), color=colours.get(fault["kind"], "grey"), alpha=0.25
        )
        ax.text(fault["start"], top * 1.02, fault["kind"], rotation=60, fontsize=7, va="bottom")
    for t in figures["promotions_at"]:
        ax.axvline(t, color="green", linestyle="--", linewidth=0.8)
    ax.plot([], [], color="green", linestyle="--", label="promotion")
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests / s")
    ax.set_ylim(0, top * 1.35)
    held = bar(figures)
    ax.set_title(
        f"bench-chaos: {len(figures['faults'])} faults, {figures['requests']['answered']} answered, "
        f"{figures['requests']['failed_on_both']} failed on both, {figures['records']['lost']} records lost, "
        f"bar {'held' if all(held.values()) else 'NOT held'}",
        fontsize=10,
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(figures: dict) -> str:
    requests, records, versions = figures["requests"], figures["records"], figures["versions"]
    kinds = Counter(f["kind"] for f in figures["faults"])
    lines = [
        f"bench-chaos: {figures['minutes']} min, faults {dict(kinds)} ({sum(not f['ok'] for f in figures['faults'])} not ok)",
        f"  requests: {requests['sent']} sent, {requests['answered']} answered, {requests['failed_on_both']} failed on "
        f"both replicas, {requests['retried_on_the_other']} retried on the other, "
        f"{requests['5xx_from_a_live_replica']} 5xx from a live replica",
        f"  records: {records['acknowledged_by_redis']} acknowledged by Redis, {records['in_stream']} in the stream, "
        f"{records['lost']} lost; {records['bad_injected']} bad ones injected",
        f"  versions: {versions['promoted_by_the_trainer']} promoted by the trainer, {len(versions['forged'])} forged, "
        f"{versions['forged_refused_by_both']} refused by both; rollback races {len(versions['rollback_races'])} "
        f"({sum(r['consistent'] for r in versions['rollback_races'])} consistent); swaps {figures['swaps']}",
    ]
    if figures["unplanned_exits"]:
        lines.append(f"  exited without a fault (restarted): {figures['unplanned_exits']}")
    lines += [f"  bar: {name}: {'yes' if held else 'NO'}" for name, held in bar(figures).items()]
    return "\n".join(lines)
