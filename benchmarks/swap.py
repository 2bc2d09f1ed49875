"""`adaptive-spec bench-swap`: how long an adapter hot swap holds decoding, under steady traffic.

    adaptive-spec bench-swap                          # the default model and draft (head), rank-32 LoRA, 20 swaps
    adaptive-spec bench-swap --draft early-exit:4     # an early exit's 4 layers, rank-32 LoRA (~5 MB)
    adaptive-spec bench-swap --rank 16 --swaps 50 --json swap.json
    adaptive-spec bench-swap --target ./tiny --draft early-exit:1 --max-new-tokens 16   # a quick CPU check

The run:

1. Two random LoRA adapters for the draft (all 7 projections of its layers, `--rank`; a head's fuse
   too), written as the trainer writes them (PEFT files, metadata, checksum). For early-exit:4 of
   SmolLM2-135M in fp32, rank 16 is 2.6 MB and rank 32 (the default here) 5.2 MB.
2. The target alone decodes the prompts once: the greedy reference.
3. `--clients` threads send those prompts to the engine without pause (greedy, speculative), while
   the main thread swaps between the two adapters `--swaps` times, one every `--interval-s`, with
   `Engine.load_adapter`, as the watcher does. Each swap returns how long it held the step lock:
   the pause decoding sees. Checking and merging the adapter happen before, outside the lock.
4. Printed: the adapter size, max / p50 / mean pause, the requests served and failed, and whether
   every output equalled the target alone. The bar: max pause < 50 ms (a few decoding steps' worth), no failed request.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

from adaptive_spec.contracts import WEIGHTS_FILE
from adaptive_spec.drafters.early_exit import build_early_exit
from adaptive_spec.drafters.spec import DraftSpecError, parse_draft_spec
from adaptive_spec.formats.adapters import AdapterDir
from trainer.learning.head_distill import HeadSettings, HeadTrainer
from trainer.learning.head_model import TrainableHead

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PAUSE_BAR_S = 0.050


def write_random_adapter(engine, path: Path, rank: int, seed: int) -> Path:
    """A non-zero random LoRA for the engine's draft (an early exit's layers, or a head's layer with
    its fuse), saved with metadata and checksum as the trainer saves a version."""
    spec = parse_draft_spec(engine.draft_id)
    if spec.kind not in ("early-exit", "head"):
        raise DraftSpecError(f"bench-swap builds adapters for early-exit:N and head drafts; got {engine.draft_id!r}")
    torch.manual_seed(seed)
    with torch.no_grad():  # small deltas: a plausible adapter, not noise that swamps the base weights
        if spec.kind == "head":  # as the trainer builds a head version; it starts B at zero, so draw B
            trainer = HeadTrainer(
                TrainableHead(engine.target),
                HeadSettings(r=rank, alpha=2 * rank, seed=seed),
                target_id=engine.target_id,
                draft_id=engine.draft_id,
            )
            for parameter in _lora_parameters(trainer.model, "lora_B"):
                parameter.normal_(std=0.01)
            save = trainer.save
        else:  # init_lora_weights=False: A and B both random
            model = get_peft_model(
                build_early_exit(engine.target, spec.layers),
                LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(MODULES), init_lora_weights=False),
            )
            for parameter in _lora_parameters(model):
                parameter.mul_(0.05)
            save = model.save_pretrained
    save(path)
    AdapterDir(path).seal(target_id=engine.target_id, draft_id=engine.draft_id, version=seed)
    return path


def _lora_parameters(model, part: str = "lora_") -> list[torch.nn.Parameter]:
    return [parameter for name, parameter in model.named_parameters() if part in name]


def run_swap_bench(
    engine,
    prompts: list,
    *,
    swaps: int = 20,
    clients: int = 2,
    rank: int = 32,
    max_new_tokens: int = 32,
    interval_s: float = 0.25,
    k: int | None = None,
) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-swap-") as workdir:  # the two adapters, removed after
        paths = [write_random_adapter(engine, Path(workdir) / f"v{i}", rank, seed=i) for i in (1, 2)]
        size_mb = (paths[0] / WEIGHTS_FILE).stat().st_size / 1e6
        reference = [engine.generate(p, max_new_tokens=max_new_tokens, speculative=False).token_ids for p in prompts]

        stop = threading.Event()
        served, failed, mismatched = [0], [], []
        lock = threading.Lock()

        def client(offset: int) -> None:
            i = offset
            while not stop.is_set():
                index = i % len(prompts)
                try:
                    out = engine.generate(prompts[index], max_new_tokens=max_new_tokens, k=k)
                except Exception as exc:  # a failed request is the figure this measures
                    with lock:
                        failed.append(f"{type(exc).__name__}: {exc}")
                    continue
                with lock:
                    served[0] += 1
                    if out.token_ids != reference[index]:
                        mismatched.append(index)
                i += 1

        threads = [threading.Thread(target=client, args=(c,), name=f"client-{c}", daemon=True) for c in range(clients)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        pauses, loads = [], []
        try:
            time.sleep(interval_s)
            for n in range(swaps):
                begun = time.perf_counter()
                pauses.append(engine.load_adapter(paths[n % 2], str(n % 2 + 1)))
                loads.append(time.perf_counter() - begun)
                time.sleep(interval_s)
        finally:
            stop.set()
            for thread in threads:
                thread.join()
            engine.unload_adapter()
        wall = time.perf_counter() - started
        return {
            "adapter_mb": size_mb,
            "rank": rank,
            "draft": engine.draft_id,
            "swaps": len(pauses),
            "pause_ms_max": max(pauses) * 1000,
            "pause_ms_p50": statistics.median(pauses) * 1000,
            "pause_ms_mean": statistics.fmean(pauses) * 1000,
            "load_ms_p50": statistics.median(loads) * 1000,
            "requests": served[0],
            "failed": len(failed),
            "failures": failed[:5],
            "identical": not mismatched and served[0] > 0,
            "clients": clients,
            "max_new_tokens": max_new_tokens,
            "wall_s": wall,
            "passes": max(pauses) < PAUSE_BAR_S and not failed and not mismatched,
        }


def format_report(figures: dict) -> str:
    return "\n".join(
        [
            f"{figures['swaps']} swaps of a {figures['adapter_mb']:.1f} MB rank-{figures['rank']} adapter on "
            f"{figures['draft']}, {figures['clients']} clients of steady greedy traffic, {figures['wall_s']:.1f} s",
            f"  swap pause (decoding held)   max {figures['pause_ms_max']:.3f} ms   p50 {figures['pause_ms_p50']:.3f} ms"
            f"   mean {figures['pause_ms_mean']:.3f} ms   (bar: max < {PAUSE_BAR_S * 1000:.0f} ms)",
            f"  load + merge, outside lock   p50 {figures['load_ms_p50']:.1f} ms",
            f"  requests served {figures['requests']}, failed {figures['failed']}, identical to target alone "
            f"{figures['identical']}",
            f"  {'PASS' if figures['passes'] else 'FAIL'}",
        ]
    )
