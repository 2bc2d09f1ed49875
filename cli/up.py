"""`adaptive-spec up`: the whole loop on one machine, in one command.

    ./run adaptive-spec up                      # Redis, trainer and server on the built-in defaults
    ./run adaptive-spec up --port 8001 --data-dir /srv/adaptive-spec

What it starts, in order, and stops in reverse on Ctrl-C or SIGTERM:

1. Redis on loopback (a free port, a random password that only this process and its children get,
   at most 2 GB and never evicting, append-only file in DATA_DIR/redis so the stream survives a
   restart), unless REDIS_URL is set.
2. The HTTP server in this process (service/server.py), with the adapter registry in MLflow
   (MLFLOW_TRACKING_URI, else the sqlite file DATA_DIR/mlflow.db) and its watcher.
3. Once the server answers /health, the trainer as a child process (`adaptive-spec train`,
   one torch thread, log in DATA_DIR/logs/trainer.log). If it dies, it is restarted after a
   pause, up to `MAX_TRAINER_RESTARTS` times; serving goes on regardless.

On a signal the server drains the requests in flight (uvicorn, then the engine queue), then
the trainer gets SIGTERM (it checkpoints and exits; SIGKILL after `TRAINER_STOP_S`), then
Redis is stopped by its pid. Children run in their own sessions, so a Ctrl-C in the terminal
reaches only this process, which stops them in that order. A signal while the models still load
(the first compile takes minutes) stops Redis at once and ends the process without waiting for the
load (service/server.py `StoppedWhileLoading`).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

from adaptive_spec.contracts import MLFLOW_TRACKING_URI_ENV, REDIS_URL_ENV, redact_url, sqlite_tracking_uri
from cli.options import use_data_dir
from launch.processes import Child, child_env, http_ok
from launch.redis import started_server
from service.settings import Settings
from trainer.settings import TrainerSettings

log = logging.getLogger(__name__)

TRAINER_STOP_S = 60.0  # a round in progress finishes, then the trainer checkpoints
MAX_TRAINER_RESTARTS = 5
RESTART_PAUSE_S = 10.0
REDIS_MAXMEMORY = "2gb"  # as the shipped compose and k8s files; noeviction (launch/redis.py)


def run_up(settings: Settings, *, trainer: bool = True, trainer_threads: int = 1) -> int:
    """Start everything, serve `settings` until a signal, stop everything. Returns the exit code.
    `trainer_threads`: the trainer child's torch threads (the server decodes on the other cores)."""
    data_dir = Path(settings.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    use_data_dir(data_dir)  # the model cache and the children follow it
    # A signal while the children are started or stopped must not end this process half way: the
    # server (service/server.py) stops on it; the rest is `finally`'s work.
    previous = {sig: signal.signal(sig, _noted) for sig in (signal.SIGINT, signal.SIGTERM)}
    redis_server = child = None
    try:
        redis_url = settings.redis_url
        if not redis_url:
            (data_dir / "redis").mkdir(exist_ok=True)
            # a password (other users of this machine reach loopback too) and a memory cap that never evicts
            redis_server = started_server(
                data_dir / "redis", persist=True, password=secrets.token_hex(16), maxmemory=REDIS_MAXMEMORY
            )
            redis_url = redis_server.url
            _say(
                f"started redis-server on {redact_url(redis_url)} (pid {redis_server.process.pid}, password "
                f"required, at most {REDIS_MAXMEMORY}, data in {data_dir / 'redis'})"
            )
        tracking_uri = settings.mlflow_tracking_uri or sqlite_tracking_uri(data_dir)
        settings = dataclasses.replace(
            settings, data_dir=data_dir, redis_url=redis_url, mlflow_tracking_uri=tracking_uri
        )
        child = _Trainer(settings, trainer_threads, data_dir / "logs" / "trainer.log") if trainer else None
        if _signalled.is_set():  # stopped while Redis was starting
            return 0
        from service.server import run

        threading.Thread(target=_when_ready, args=(settings, child, tracking_uri), daemon=True).start()
        run(settings)  # returns after a graceful shutdown on SIGINT / SIGTERM (raises if one came while loading)
        return 0
    except SystemExit as exc:  # uvicorn exits when it cannot bind the port
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        if child is not None:
            child.stop()
        if redis_server is not None:
            redis_server.stop()
            _say("stopped redis-server")
        for sig, handler in previous.items():
            signal.signal(sig, handler)


_signalled = threading.Event()


def _noted(signum, frame) -> None:
    """Stand-in handler while `up` runs: the shutdown itself is uvicorn's work, then `finally`'s."""
    _signalled.set()


def _when_ready(settings: Settings, trainer: _Trainer | None, tracking_uri: str) -> None:
    """Wait for /health, print where everything is, then start the trainer."""
    base = f"http://{_client_host(settings.host)}:{settings.port}"
    while not http_ok(base + "/health"):
        time.sleep(0.5)
    if trainer is not None:
        trainer.start()
    admin = (
        "set"
        if settings.admin_token
        else "not set: /admin refuses every call (set ADAPTIVE_SPEC_ADMIN_TOKEN to use it)"
    )
    _say(
        "\n"
        f'  chat        {base}/v1/chat/completions   (OpenAI-compatible; model "{settings.served_model_name or settings.target}")\n'
        f"  dashboard   {base}/dashboard\n"
        f"  metrics     {base}/metrics\n"
        f"  mlflow ui   mlflow ui --backend-store-uri {redact_url(tracking_uri)} --port 5000\n"
        f"  trainer     {'log in ' + str(trainer.log_path) if trainer else 'off (--no-trainer)'}\n"
        f"  admin token {admin}\n"
        "  Ctrl-C stops everything.\n"
    )


class _Trainer:
    """The `adaptive-spec train` child (launch/processes.py): started, watched and restarted, stopped by its pid."""

    def __init__(self, settings: Settings, threads: int, log_path: Path) -> None:
        train = TrainerSettings(**vars(settings.models), data_dir=settings.data_dir, threads=threads)
        env = {
            REDIS_URL_ENV: settings.redis_url or "",
            MLFLOW_TRACKING_URI_ENV: settings.mlflow_tracking_uri or "",
            "OMP_NUM_THREADS": str(threads),
        }
        self.child = Child([sys.executable, "-m", "cli", "train", *train.argv()], log_path, env=child_env(**env))
        self.log_path = log_path
        self.restarts = 0
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> None:
        self._spawn()
        threading.Thread(target=self._watch, name="trainer-watch", daemon=True).start()

    def _spawn(self) -> None:
        with self._lock:
            if self._stopping.is_set():
                return
            self.child.start()
        _say(f"started the trainer (pid {self.child.pid}); log in {self.log_path}")

    def _watch(self) -> None:
        while not self._stopping.is_set():
            code = self.child.wait()
            if self._stopping.is_set():
                return
            if self.restarts >= MAX_TRAINER_RESTARTS:
                _say(
                    f"the trainer exited with {code} and was restarted {self.restarts} times; giving up "
                    f"(serving goes on with the current adapter). See {self.log_path}"
                )
                return
            self.restarts += 1
            _say(
                f"the trainer exited with {code}; restarting in {RESTART_PAUSE_S:.0f} s "
                f"({self.restarts}/{MAX_TRAINER_RESTARTS}). See {self.log_path}"
            )
            if self._stopping.wait(RESTART_PAUSE_S):
                return
            self._spawn()

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
        if not self.child.running:
            return
        _say(f"stopping the trainer (it finishes its round and checkpoints; up to {TRAINER_STOP_S:.0f} s)")
        code = self.child.stop(TRAINER_STOP_S)
        _say(f"stopped the trainer (exit {code})")


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def _say(message: str) -> None:
    print(f"adaptive-spec up: {message}", file=sys.stderr, flush=True)
