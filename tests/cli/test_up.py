"""`adaptive-spec up` as a user runs it: a real process that starts Redis, the server and the
trainer, answers a chat request, and stops all three on SIGTERM or Ctrl-C (SIGINT)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from launch.processes import free_port

pytestmark = pytest.mark.redis


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose; its parent reaps it
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(log: Path, pattern: str, process: subprocess.Popen, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found:
            return found
        assert process.poll() is None, f"up exited with {process.returncode}:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} in {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_up_starts_everything_serves_and_stops_what_it_started(tiny_model_dir, tmp_path, stop_signal):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "MLFLOW_TRACKING_URI")}
    env.update(OMP_NUM_THREADS="1", ADAPTIVE_SPEC_SERVED_MODEL_NAME="tiny")
    log = tmp_path / "up.log"
    command = [
        sys.executable,
        "-m",
        "cli",
        "up",
        "--port",
        str(port),
        "--data-dir",
        str(tmp_path / "data"),
        "--target",
        str(tiny_model_dir),
        "--draft",
        "early-exit:1",
    ]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    redis_pid = trainer_pid = None
    try:
        started = _wait_for(
            log, r"started redis-server on redis://\*\*\*@127\.0\.0\.1:(\d+)/0 \(pid (\d+)", process, 60
        )
        redis_port, redis_pid = int(started.group(1)), int(started.group(2))
        with pytest.raises(redis.AuthenticationError):  # its Redis requires the password only up and its children have
            redis.Redis(port=redis_port).ping()
        trainer_pid = int(_wait_for(log, r"started the trainer \(pid (\d+)\)", process, 120).group(1))
        banner = _wait_for(log, r"chat\s+(http://\S+/v1/chat/completions)", process, 30)
        assert re.search(rf"dashboard\s+http://127\.0\.0\.1:{port}/dashboard", log.read_text())
        assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'data' / 'mlflow.db'}" in log.read_text()

        reply = httpx.post(
            banner.group(1),
            timeout=60,
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0},
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] >= 1
        assert _alive(redis_pid) and _alive(trainer_pid)

        process.send_signal(stop_signal)
        assert process.wait(90) == 0, log.read_text()[-3000:]
        text = log.read_text()
        assert "stopped the trainer" in text and "stopped redis-server" in text
        assert not _alive(redis_pid) and not _alive(trainer_pid), "up left a child running"
        assert (tmp_path / "data" / "redis").is_dir() and (tmp_path / "data" / "logs" / "trainer.log").is_file()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        for pid in (redis_pid, trainer_pid):  # children run in their own sessions: by pid, if a check failed
            if pid is not None and _alive(pid):
                os.kill(pid, signal.SIGKILL)


# The model load as the command runs it, made to take ten minutes (the first compile takes minutes): the
# engine thread that runs it is one Python waits for at exit, so only an exit that does not wait is prompt.
SLOW_LOAD = """
import sys, time
from adaptive_spec.engine import Engine

def slow(cls, *args, **kwargs):
    print("loading slowly", flush=True)
    time.sleep(600)
    raise RuntimeError("a load nobody should have waited for")

Engine.from_pretrained = classmethod(slow)
from cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["up", "serve"])
def test_a_signal_while_the_models_load_stops_at_once(tiny_model_dir, tmp_path, command):
    """SIGTERM during the load used to wait for it to end (uvicorn acts on signals once its startup is
    done): a k8s rollout or a Ctrl-C waited minutes for a compile nobody wanted. Now the command stops at
    once, exit 0, `up` stopping its Redis on the way out."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "MLFLOW_TRACKING_URI")}
    env.update(OMP_NUM_THREADS="1")
    log = tmp_path / f"{command}.log"
    args = [command, "--port", str(port), "--target", str(tiny_model_dir), "--draft", "early-exit:1"]
    if command == "up":
        args += ["--data-dir", str(tmp_path / "data")]
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", SLOW_LOAD, *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    redis_pid = None
    try:
        if command == "up":
            redis_pid = int(_wait_for(log, r"started redis-server on \S+ \(pid (\d+)", process, 60).group(1))
        _wait_for(log, "loading slowly", process, 60)
        time.sleep(1.0)  # well inside the load
        stopped = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0, log.read_text()[-3000:]
        assert time.monotonic() - stopped < 15, "the command waited for the load"
        text = log.read_text()
        assert "stopped while the models were loading" in text, text[-3000:]
        assert "a load nobody should have waited for" not in text
        if command == "up":
            assert "stopped redis-server" in text
            assert not _alive(redis_pid), "up left its Redis running"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        if redis_pid is not None and _alive(redis_pid):
            os.kill(redis_pid, signal.SIGKILL)
