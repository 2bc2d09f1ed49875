"""The fleet on loopback: Redis, an `mlflow server`, two `adaptive-spec serve` replicas and a trainer, started,
supervised (an orchestrator's restart policy) and stopped; the keys they share."""

from __future__ import annotations

import ast
import re
import secrets
import sys
import threading
from pathlib import Path

from adaptive_spec.contracts import COMPILE_ENV
from benchmarks.chaos.settings import ChaosSettings
from launch.mlflow import MlflowServer
from launch.processes import Child, child_env, free_port, http_ok
from launch.redis import RedisServer

API_KEY, ADMIN_TOKEN = secrets.token_hex(16), secrets.token_hex(16)
TINY_TRAIN_ARGS = ["--min-new-records", "24", "--round-steps", "20", "--gate-min-positions", "60"]


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
