"""`adaptive-spec bench --compare-paths`: execution paths side by side, interleaved prompt by prompt.

    adaptive-spec bench --compare-paths fp32-eager,bf16-compiled --json paths.json
    adaptive-spec bench --compare-paths fp32-eager,bf16-eager,bf16-compiled --num-prompts 4 --max-new-tokens 32

A path is DTYPE-MODE: DTYPE `fp32` or `bf16`, MODE `eager` or `compiled` (torch.compile of the
decoding step, compiled.py); `bf16-compiled-avx512` is bf16 compiled with the C++ kernel's products on
AVX512-BF16 where the CPU also has AMX tiles (linear_bf16.py), which `bf16-compiled` uses there. The
kernel's choice belongs to the process, so it is switched before each path runs. Each path loads its
own engine (same target, draft, adapter and k); then every prompt runs through every path in turn, the target alone and with speculation, so a
change in machine load touches all of them alike. Per path:

- `target_tok_s`, `spec_tok_s`: generated tokens over wall time, the target alone and speculative;
- `identical`: every speculative output equals that path's own target alone, token for token;
- `exact`: whether that path's forwards are batch-invariant on this machine (exact.check: a
  position's logits bitwise the same in a plain step, verifies of 2-17 tokens and batches of 8 rows);
- `target_vs_first`: its target alone's tok/s over the first path's (e.g. bf16-compiled against fp32-eager);
- `load_s`: loading the model and (compiled) compiling the step, once; `forward_ms`: the cost of a
  target forward by rows x tokens per row over 128 cached tokens (median of 11), the table the
  dynamic-k policy works from (README "cost table").

The top-level keys are bench's contract keys for the first path, with the HF peer left out
(`hf_peer` says so), plus `paths`.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Iterator

import torch
from tqdm import tqdm

from adaptive_spec.cache import feeding, kv
from adaptive_spec.engine import Engine
from adaptive_spec.formats.stats import Totals
from adaptive_spec.kernels import linear_bf16
from adaptive_spec.options import CoreSettings
from adaptive_spec.outputs.prompts import PromptItem
from benchmarks.bench import _timed, prefixes_frozen

PATHS = {"fp32-eager": ("fp32", False), "fp32-compiled": ("fp32", True), "bf16-eager": ("bf16", False),
         "bf16-compiled": ("bf16", True), "bf16-compiled-avx512": ("bf16", True)}  # fmt: skip  # as the flag lists them
SHAPES = ((1, 1), (1, 5), (1, 9), (1, 17), (4, 1), (8, 1), (8, 5), (4, 5), (8, 9))  # rows x tokens per row


@contextlib.contextmanager
def products_of(path: str) -> Iterator[None]:
    """Run `path` with its own bf16 products: AVX512-BF16 for `-avx512`, else AMX tiles where the CPU has them
    and ADAPTIVE_SPEC_CPU_AMX allows."""
    default = CoreSettings.from_env().cpu_amx
    linear_bf16.set_amx(not path.endswith("-avx512") and default)
    try:
        yield
    finally:
        linear_bf16.set_amx(default)


def parse_paths(text: str) -> list[str]:
    """`fp32-eager,bf16-compiled` -> ["fp32-eager", "bf16-compiled"]; ValueError naming what is wrong."""
    paths = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [p for p in paths if p not in PATHS]
    if unknown or len(paths) < 1 or len(set(paths)) != len(paths):
        raise ValueError(f"--compare-paths takes distinct paths among {', '.join(PATHS)}, got {text!r}")
    return paths


def load_paths(paths: list[str], target: str, draft: str, device: str, tree_budget: int | None = None) -> dict:
    """path -> (engine, seconds it took to load and compile)."""
    engines = {}
    for path in paths:
        dtype, compiled = PATHS[path]
        started = time.perf_counter()
        print(f"loading {path} ...", file=sys.stderr)
        with products_of(path):  # the engine measures its exactness (and sets itself up by it) on its own products
            engine = Engine.from_pretrained(target, draft, device, dtype, compile=compiled, tree_budget=tree_budget)
            _ = engine.exactness  # measured now (compiles a compiled path's step), not inside the timed loop
        engines[path] = (engine, time.perf_counter() - started)
    return engines


def run_paths(
    engines: dict, items: list[PromptItem], max_new_tokens: int, k: int | None, progress: bool = True
) -> dict:
    paths = list(engines)
    first = engines[paths[0]][0]
    prompts = [first.encode_prompt(item.prompt) for item in items]
    tokens = {p: {"target": 0, "spec": 0} for p in paths}
    seconds = {p: {"target": 0.0, "spec": 0.0} for p in paths}
    totals = {p: Totals() for p in paths}
    identical = dict.fromkeys(paths, 0)
    for path, (engine, _) in engines.items():  # warm-up: the first steps of each path allocate and fill caches
        with prefixes_frozen(engine), products_of(path):
            engine.generate(prompts[0], 4, speculative=False)
            engine.generate(prompts[0], 4, k=k)
    bar = tqdm(total=len(prompts), desc="compare paths", unit="prompt", disable=not progress, file=sys.stderr)
    for ids in prompts:
        for path in paths:
            engine = engines[path][0]
            with prefixes_frozen(engine), products_of(path):  # the paths' forwards, every prompt computed whole
                base, base_s = _timed(engine.generate, ids, max_new_tokens, speculative=False)
                ours, ours_s = _timed(engine.generate, ids, max_new_tokens, k=k)
            tokens[path]["target"] += len(base.token_ids)
            tokens[path]["spec"] += len(ours.token_ids)
            seconds[path]["target"] += base_s
            seconds[path]["spec"] += ours_s
            totals[path].include(ours.stats)
            identical[path] += ours.token_ids == base.token_ids
        bar.update()
    bar.close()
    figures = []
    for path in paths:
        engine, load_s = engines[path]
        with products_of(path):
            costs = forward_costs(engine)
        target_tok_s = tokens[path]["target"] / seconds[path]["target"]
        spec_tok_s = tokens[path]["spec"] / seconds[path]["spec"]
        figures.append(
            {
                "path": path,
                "dtype": engine.dtype_name,
                "compiled": engine.path == "compiled",
                "target_tok_s": target_tok_s,
                "spec_tok_s": spec_tok_s,
                "speedup_vs_target": spec_tok_s / target_tok_s,
                "identical": identical[path] == len(prompts),
                "identical_prompts": identical[path],
                "exact": engine.exactness.exact,
                "exactness": engine.exactness.summary(),
                **totals[path].figures(),
                "load_s": load_s,
                "forward_ms": costs,
            }
        )
    base_rate = figures[0]["target_tok_s"]
    for path_figures in figures:
        path_figures["target_vs_first"] = path_figures["target_tok_s"] / base_rate
    head = figures[0]
    return {
        "target_tok_s": head["target_tok_s"],
        "spec_tok_s": head["spec_tok_s"],
        "speedup_vs_target": head["speedup_vs_target"],
        "hf_assisted_tok_s": None,
        "speedup_vs_hf": None,
        "hf_peer": "none: --compare-paths times our own paths only",
        "acceptance_rate": head["acceptance_rate"],
        "mean_acceptance_length": head["mean_acceptance_length"],
        "tokens_verified_per_step": head["tokens_verified_per_step"],
        "acceptance_by_depth": head["acceptance_by_depth"],
        "target_forwards_per_token": totals[paths[0]].target_forwards / totals[paths[0]].emitted
        if totals[paths[0]].emitted
        else None,
        "identical": all(f["identical"] for f in figures),
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "target": first.target_id,
        "draft": first.draft_id,
        "k": k if k is not None else "dynamic",
        "dtype": head["dtype"],
        "device": str(first.device),
        "torch_threads": torch.get_num_threads(),
        "paths": figures,
    }


@torch.inference_mode()
def forward_costs(engine: Engine, context: int = 128, repeats: int = 11) -> dict[str, float]:
    """Median ms of a target forward by `rows x tokens` over `context` cached tokens per row, through
    the engine's own path (compiled steps included)."""
    model, costs = engine.target, {}
    for rows, width in SHAPES:
        cache = kv.BatchCache.for_model(model)
        cache.row_capacity = rows
        for _ in range(rows):
            feeding.feed(model, cache, [cache.add_row()], [[(100 + i) % engine.vocab_size for i in range(context)]])
        times = []
        for _ in range(repeats):
            for row in range(rows):
                cache.set_length(row, context)
            started = engine.clock()
            feeding.feed(model, cache, list(range(rows)), [[5] * width] * rows, all_logits=True)
            times.append(engine.clock() - started)
        costs[f"{rows}x{width}"] = statistics.median(times[1:]) * 1000
    return costs


def format_report(figures: dict) -> str:
    lines = [
        f"target {figures['target']}, draft {figures['draft']}, k {figures['k']}, {figures['prompts']} prompts x "
        f"{figures['max_new_tokens']} new tokens, on {figures['device']} ({figures['torch_threads']} threads)",
        f"  {'path':20s} {'target tok/s':>12s} {'spec tok/s':>11s} {'spec/target':>11s} {'target/first':>12s}"
        f" {'identical':>9s} {'exact':>6s} {'load s':>7s}",
    ]
    for f in figures["paths"]:
        lines.append(
            f"  {f['path']:20s} {f['target_tok_s']:12.2f} {f['spec_tok_s']:11.2f} {f['speedup_vs_target']:10.2f}x"
            f" {f['target_vs_first']:11.2f}x {f['identical']!s:>9s} {f['exact']!s:>6s} {f['load_s']:7.1f}"
        )
    shapes = list(figures["paths"][0]["forward_ms"])
    lines.append("  target forward, ms (rows x tokens, 128 cached): " + "  ".join(f"{s:>5s}" for s in shapes))
    for f in figures["paths"]:
        lines.append(f"  {f['path']:20s} " + " " * 33 + "  ".join(f"{f['forward_ms'][s]:5.1f}" for s in shapes))
    return "\n".join(lines)
