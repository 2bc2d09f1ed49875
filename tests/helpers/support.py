"""Helpers for the fault, fuzz, load and security tests: real processes on loopback, tiny models.

    server = ServeProcess(workdir, model_dir, env={"REDIS_URL": url}, args=[])   # `adaptive-spec serve`
    server.start(); server.health(); server.metric("adaptive_spec:request_success_total")
    server.signal(signal.SIGTERM); server.wait(30)

The model directory (conftest.py `tiny_model_dir`) is the 4-layer random Llama of
tests/helpers/tiny.py with the character-level chat tokenizer of tests/helpers/tiny_chat.py,
saved once per session, so `serve` and `train` load it from disk like any local model directory
(about 5 s per process start, mostly imports).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import httpx
from fleet_env import HEALTH_PATH
from polling import wait_for as eventually  # noqa: F401  (re-exported for the tests here)
from tiny import tiny_target  # noqa: F401  (re-exported for the tests here)

from launch.processes import Child, free_port
from launch.processes import child_env as launch_child_env
from launch.redis import RedisServer

MODEL = "tiny"  # ADAPTIVE_SPEC_SERVED_MODEL_NAME of every server started here
# Variables of the machine that would leak into a child and change what it talks to.
_INHERITED_OUT = ("REDIS_URL", "MLFLOW_TRACKING_URI", "ADAPTIVE_SPEC_API_KEY", "ADAPTIVE_SPEC_ADMIN_TOKEN")


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: one torch thread, nothing inherited that points elsewhere."""
    one_thread = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    return launch_child_env(_INHERITED_OUT, **{**one_thread, **extra})


class ChildProcess(Child):
    """A command of this package as a child process with its output in `<workdir>/<name>.log`; stopped by
    its own pid (launch/processes.py). It stays in the test's session, so a test signals it directly."""

    def __init__(self, command: list[str], workdir: Path, env: dict[str, str], name: str) -> None:
        super().__init__(command, workdir / f"{name}.log", env=env, cwd=workdir, new_session=False)
        self.workdir = workdir

    def launch(self) -> None:
        """Start the process alone (a subclass's `start` also waits until it is ready)."""
        Child.start(self)


class ServeProcess(ChildProcess):
    """`python -m cli serve` on a tiny model directory and a free loopback port."""

    def __init__(
        self,
        workdir: Path,
        model_dir: Path,
        env: dict[str, str],
        args: list[str],
        verbose: bool = False,
        port: int | None = None,
    ) -> None:
        """verbose: `adaptive-spec -v serve`, which logs at INFO (the settings, swaps, the writer's state);
        port: a given one (a replica restarted where its load balancer expects it), else a free one."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "cli",
            *(["-v"] if verbose else []),
            "serve",
            "--target",
            str(model_dir),
            "--draft",
            "early-exit:1",
            "--k",
            "3",
            "--dtype",
            "fp32",
            "--device",
            "cpu",
            "--data-dir",
            str(workdir / "data"),
            *args,
        ]
        if "--port" not in args:
            command += ["--port", str(self.port)]
        env = child_env(
            **{
                "ADAPTIVE_SPEC_SERVED_MODEL_NAME": MODEL,
                "ADAPTIVE_SPEC_MAX_TOKENS": "64",
                "ADAPTIVE_SPEC_RECORD_TOPK": "8",
                "ADAPTIVE_SPEC_ADAPTER_POLL_S": "0",
                **env,
            }
        )
        super().__init__(command, workdir, env, f"serve-{self.port}")

    def start(self, timeout: float = 120.0) -> None:
        self.launch()
        self.wait_until(self.ready, timeout, f"/health on {self.url}")

    def ready(self) -> bool:
        try:
            return httpx.get(self.url + HEALTH_PATH, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def metric(self, name: str, **labels: str) -> float:
        return scrape(httpx.get(self.url + "/metrics", timeout=5).text, name, **labels)


class TrainProcess(ChildProcess):
    """`python -m cli train` on a tiny model directory, early-exit:1, one thread."""

    def __init__(
        self,
        workdir: Path,
        model_dir: Path,
        redis_url: str,
        args: list[str],
        name: str = "train",
        env: dict[str, str] | None = None,
    ) -> None:
        self.data_dir = workdir / "data"
        command = [
            sys.executable,
            "-m",
            "cli",
            "train",
            "--target",
            str(model_dir),
            "--draft",
            "early-exit:1",
            "--data-dir",
            str(self.data_dir),
            "--redis-url",
            redis_url,
            "--threads",
            "1",
            "--dtype",
            "fp32",
            "--device",
            "cpu",
            *args,
        ]
        super().__init__(command, workdir, child_env(**(env or {})), name)

    def start(self, timeout: float = 120.0) -> None:
        self.launch()
        self.wait_until(lambda: "online trainer" in self.log(), timeout, "the trainer's first log line")


def scrape(text: str, name: str, **labels: str) -> float:
    """The sum of the Prometheus samples called `name` whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def kill_redis(server: RedisServer) -> None:
    """SIGKILL the redis-server (no shutdown, no goodbye to clients), by the pid this test started."""
    server.kill()


def listening_address(port: int) -> str:
    """The local address a TCP socket listens on at `port`, from /proc/net/tcp (IPv4) and tcp6.

    Example row: `0: 0100007F:1F90 00000000:0000 0A ...` is 127.0.0.1:8000 in state 0A (LISTEN).
    """
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, _, state = line.split()[1:4]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:
                if len(address) == 8:  # little-endian IPv4
                    return ".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0))
                return "::" if set(address) == {"0"} else address
    raise AssertionError(f"nothing listens on port {port}")


class BackgroundLoad:
    """`benchmarks.load.run_load` in a thread until the `with` block ends; `.report` afterwards.

    with BackgroundLoad(server.url, users=2) as load:
        ...  # break something
    assert load.report.errors == 0
    """

    def __init__(self, url: str, users: int = 2, max_tokens: int = 8, duration_s: float = 600.0) -> None:
        self.stop = threading.Event()
        self.report = None
        self._kwargs = dict(
            users=users,
            duration_s=duration_s,
            model=MODEL,
            prompt=[5, 17, 33, 8, 5, 17],
            max_tokens=max_tokens,
            stop=self.stop,
        )
        self._thread = threading.Thread(target=self._run, args=(url,), name="background-load")

    def _run(self, url: str) -> None:
        from benchmarks.load import run_load

        self.report = asyncio.run(run_load(url, **self._kwargs))

    def __enter__(self) -> BackgroundLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self._thread.join(120)
