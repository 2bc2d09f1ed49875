"""Helpers for the dashboard tests: tiny LoRA adapters with gate figures, and traffic.

path = make_adapter(engine, tmp_path / "v1", seed=1, greedy_match=0.6)
swap(service, path, "1", by="test")        # as the adapter watcher does: swap, then the dashboard marker
"""

from __future__ import annotations

from pathlib import Path

import httpx
import torch
from peft import LoraConfig, get_peft_model

from adaptive_spec.drafters.early_exit import build_early_exit
from adaptive_spec.formats.adapters import AdapterDir

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    target, layers: int, path: Path, seed: int, *, version: int, greedy_match: float, expected_acceptance: float
) -> Path:
    """A random LoRA on a fresh early-exit draft, saved as the trainer saves it, with gate figures."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(
        build_early_exit(target, layers), LoraConfig(r=4, lora_alpha=8, target_modules=MODULES, init_lora_weights=False)
    )
    peft_model.save_pretrained(path)
    AdapterDir(path).seal(
        version=version,
        parent_version=version - 1 or None,
        loss=2.5 - 0.1 * version,
        gate={
            "candidate": {"greedy_match": greedy_match, "expected_acceptance": expected_acceptance, "positions": 432},
            "champion": {"greedy_match": 0.05, "expected_acceptance": 0.04, "positions": 432},
            "reason": "candidate beats champion",
        },
    )
    return path


def swap(service, path: Path, version: str, *, by: str) -> float:
    """What the adapter watcher does after it verified a version: swap the engine to it, then record
    the swap (a dashboard marker with its gate figures). Returns how long decoding was held (s)."""
    held = service.engine.load_adapter(path, version)
    service.record_swap("swap", version, by, path)
    return held


def send_traffic(url: str, requests: int, domain: str, seed: int = 0, max_tokens: int = 24) -> None:
    """Greedy token-id completions through the HTTP API, as a client would send them."""
    with httpx.Client(base_url=url, timeout=60) as client:
        for i in range(requests):
            prompt = [(seed * 7 + i * 3 + j) % 100 + 1 for j in range(8)]
            response = client.post(
                "/v1/completions",
                json={
                    "model": client.get("/v1/models").json()["data"][0]["id"],
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "adaptive_spec": {"domain": domain},
                },
            )
            response.raise_for_status()


def settle(service, requests: int, timeout: float = 10.0) -> None:
    """Wait until the worker has recorded `requests` finished requests in all (it does so just after
    the response ends), then write them to Redis."""
    import time

    deadline = time.monotonic() + timeout
    while service.stats.counts["requests"] < requests:
        if time.monotonic() > deadline:
            raise AssertionError(f"{service.stats.counts['requests']} of {requests} requests recorded")
        time.sleep(0.02)
    assert service.stats.flush()
