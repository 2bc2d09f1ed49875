"""Helpers for the registry and watcher tests: adapters written as the trainer writes them, and a real
`mlflow server` on a free loopback port that a test may stop and restart.

    from registry_support import MlflowServer, write_adapter
    server = MlflowServer(tmp_path); server.start(); ...; server.stop(); server.start()   # same port, same db
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from adaptive_spec.adapters import AdapterDir
from adaptive_spec.drafters.early_exit import build_early_exit
from service.local_redis import free_port

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(
    target,
    layers: int,
    path: Path,
    seed: int,
    *,
    rank: int = 4,
    target_id: str = "target",
    draft_id: str | None = None,
    greedy_match: float = 0.5,
    version: int = 1,
    vocab: list[int] | None = None,
    domain: str | None = None,
) -> Path:
    """A random non-zero LoRA on a fresh early-exit draft, with the metadata, checksum (and optionally the
    draft vocabulary) the online trainer writes next to it; `domain` makes it that domain's adapter."""
    torch.manual_seed(seed)
    draft = build_early_exit(target, layers)
    model = get_peft_model(
        draft, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES, init_lora_weights=False)
    )
    model.save_pretrained(path)
    adapter = AdapterDir(path)
    if vocab is not None:
        adapter.write_vocab(vocab)
    adapter.seal(
        **{
            "format": 1,
            "target_id": target_id,
            "draft_id": draft_id or f"early-exit:{layers}",
            "version": version,
            "settings": {"r": rank, "alpha": 2 * rank, "lr": 1e-3, "target_modules": MODULES, "loss": "kl_topm"},
            "records_used": 40 + seed,
            "tokens_used": 640 + seed,
            "steps": 20,
            "loss": 1.5,
            "first_loss": 2.0,
            "last_loss": 1.4,
            "base_version": None,
            "parent_version": version - 1 or None,
            "domain_mix": {"json": 30, "sql": 10},
            "gate": {
                "candidate": {"greedy_match": greedy_match, "expected_acceptance": greedy_match / 2, "positions": 400},
                "champion": {"greedy_match": greedy_match - 0.1, "expected_acceptance": 0.2, "positions": 400},
                "reason": "better",
            },
            **({"domain": domain} if domain is not None else {}),
        }
    )
    return path


class MlflowServer:
    """`mlflow server` with a sqlite backend and served artifacts in `workdir`, in its own process group."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 90.0) -> None:
        mlflow = Path(sys.executable).with_name("mlflow")
        command = [
            str(mlflow),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{self.workdir / 'server.db'}",
            "--artifacts-destination",
            str(self.workdir / "server-artifacts"),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.log_path = self.workdir / f"mlflow-server-{self.port}.log"
        with open(self.log_path, "ab") as log:  # the server keeps its own copy of the descriptor
            self.process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True
            )  # its uvicorn child joins the group we stop
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.process.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer on {self.url} within {timeout} s")

    def stop(self) -> None:
        """Stop the server's process group (the mlflow CLI and its uvicorn worker), by the pid we started."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(5)
        except ProcessLookupError:
            pass
        self.process = None
