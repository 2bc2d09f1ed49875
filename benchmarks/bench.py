"""`adaptive-spec bench`: speed of the target alone vs speculative decoding vs the HF peer.

    adaptive-spec bench                                   # default model and draft (head), dynamic k
    adaptive-spec bench --draft early-exit:4              # with HF assisted generation beside it
    adaptive-spec bench --k 4 --num-prompts 4 --max-new-tokens 32 --json bench.json   # quick

Every prompt runs through four paths, interleaved so that a change in machine load touches all
of them alike:

- target alone: this engine with `speculative=False` (the same code with k = 0), the baseline;
- ours: this engine with the draft;
- HF assisted: `target.generate(..., assistant_model=draft)` with the same draft model. With a
  fixed `--k` it drafts exactly k (`num_assistant_tokens=k`, constant schedule, confidence
  stop off); with dynamic k it keeps transformers' own adaptive defaults, its peer to ours.
  An `ngram` draft is compared with `prompt_lookup_num_tokens=k`. transformers has no `head`
  (EAGLE) or `ngram+` draft, so for those the HF paths are left out (the keys are null, and
  `hf_peer` says why) rather than timed without a draft.
- HF target alone: `target.generate(...)` without a draft, to show the baseline is not slowed.

A prompt that carries a `response_format` (prompts.py) runs constrained on both of our paths,
so the ratio compares like with like: structured output with the draft vs the target alone under
the same grammar. transformers' `generate` has no grammar, so the HF paths are left out then.

Tokens/s are total generated tokens over total wall time per path. `identical` is true only
when every output of ours equals the target alone's, token for token (greedy only).

Time to first token (`ttft_*_s`, the median over prompts) is timed in a separate short pass per
prompt and path: from the call to `Engine.stream` to its first chunk, prefill included, as a
streaming client sees it (less HTTP).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext

import torch
from tqdm import tqdm

from adaptive_spec.drafters.model import ModelDrafter
from adaptive_spec.drafters.ngram import NgramDrafter
from adaptive_spec.engine import Engine
from adaptive_spec.formats.stats import Totals
from adaptive_spec.outputs.prompts import PromptItem, encode_item


def run_bench(
    engine: Engine,
    items: list[PromptItem],
    max_new_tokens: int,
    k: int | None,
    temperature: float = 0.0,
    dtype: str = "auto",
    progress: bool = True,
    hf: bool = True,
    desc: str = "bench",
) -> dict:
    """The figures of one run; `hf=False` times only the target alone and ours (no HF keys). With
    any prompt carrying a `response_format` the HF keys are null: transformers cannot apply it."""
    encoded = [encode_item(item, engine) for item in items]  # tools and forced calls as the server does
    prompts, formats = [ids for ids, _ in encoded], [response_format for _, response_format in encoded]
    constrained = sum(f is not None for f in formats)
    no_peer = _no_hf_peer(engine, constrained)
    wants_hf, hf = hf, hf and no_peer is None
    paths = ("target", "spec", "hf_assisted", "hf_target") if hf else ("target", "spec")
    tokens = dict.fromkeys(paths, 0)
    seconds = dict.fromkeys(paths, 0.0)
    totals = Totals()
    free_drafted = free_accepted = 0
    ttft = {"target": [], "spec": []}
    identical = hf_identical = 0
    sampling = dict(temperature=temperature, seed=0)

    with prefixes_frozen(engine):
        _warm_up(engine, prompts[0], k, temperature, hf, formats[0])
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress, file=sys.stderr)
    for ids, response_format in zip(prompts, formats, strict=True):
        options = dict(sampling, response_format=response_format)
        with prefixes_frozen(engine):  # every timed run of this prompt finds the prompts before it, not itself
            ttft["target"].append(_first_token_s(engine, ids, max_new_tokens, speculative=False, **options))
            ttft["spec"].append(_first_token_s(engine, ids, max_new_tokens, k=k, **options))
            base = _timed(engine.generate, ids, max_new_tokens, speculative=False, **options)
            ours = _timed(engine.generate, ids, max_new_tokens, k=k, **options)
        if engine.prefix_cache is not None:  # then the prompt is kept, as a server keeps what it served
            engine.generate(ids, 1, speculative=False, **options)
        runs = [base, ours]
        if hf:
            runs.append(hf_run := _timed(_hf_generate, engine, ids, max_new_tokens, k, temperature, True))
            runs.append(_timed(_hf_generate, engine, ids, max_new_tokens, k, temperature, False))
            hf_identical += hf_run[0] == base[0].token_ids
        for path, (result, elapsed) in zip(paths, runs, strict=True):
            tokens[path] += len(result if isinstance(result, list) else result.token_ids)
            seconds[path] += elapsed
        out = ours[0]
        totals.include(out.stats)
        free_drafted += out.stats.free_drafted
        free_accepted += out.stats.free_accepted
        identical += out.token_ids == base[0].token_ids
        bar.update()
    bar.close()

    rate = {path: tokens[path] / seconds[path] for path in paths}
    greedy = temperature == 0.0
    figures = {
        "target_tok_s": rate["target"],
        "spec_tok_s": rate["spec"],
        "speedup_vs_target": rate["spec"] / rate["target"],
        **totals.figures(),  # acceptance rate, mean acceptance length, tokens verified per step, by depth
        "target_forwards_per_token": totals.target_forwards / totals.emitted if totals.emitted else None,
        "ttft_target_s": statistics.median(ttft["target"]),
        "ttft_spec_s": statistics.median(ttft["spec"]),
        "ttft_ratio": statistics.median(ttft["spec"]) / statistics.median(ttft["target"]),
        "identical": identical == len(prompts) if greedy else None,
        "identical_prompts": identical if greedy else None,
        "drafted": totals.drafted,
        "accepted": totals.accepted,
        "free_drafted": free_drafted,  # of drafted: copied proposals of ngram+ drafts, no model forward
        "free_accepted": free_accepted,
        "prompts": len(prompts),
        "constrained_prompts": constrained,
        "max_new_tokens": max_new_tokens,
        "target": engine.target_id,
        "draft": engine.draft_id,
        "k": k if k is not None else "dynamic",
        "dtype": dtype,
        "device": str(engine.device),
        "temperature": temperature,
        "torch_threads": torch.get_num_threads(),
    }
    if no_peer and (wants_hf or constrained):  # the contract's HF keys, null: no like-for-like peer
        figures.update(
            hf_assisted_tok_s=None,
            hf_target_tok_s=None,
            speedup_vs_hf=None,
            hf_identical_prompts=None,
            hf_peer=f"none: {no_peer}",
        )
    if hf:
        figures.update(
            hf_assisted_tok_s=rate["hf_assisted"],
            hf_target_tok_s=rate["hf_target"],
            speedup_vs_hf=rate["spec"] / rate["hf_assisted"],
            hf_identical_prompts=hf_identical if greedy else None,
            hf_peer=_hf_peer_description(engine, k),
        )
    return figures


def format_report(figures: dict) -> str:
    def num(value, fmt):
        return "n/a" if value is None else format(value, fmt)

    lines = [
        f"target {figures['target']}, draft {figures['draft']}, k {figures['k']}, {figures['prompts']} prompts x "
        f"{figures['max_new_tokens']} new tokens, {figures['dtype']} on {figures['device']}",
        f"  target alone      {figures['target_tok_s']:8.2f} tok/s",
        f"  speculative (ours){figures['spec_tok_s']:8.2f} tok/s   x{figures['speedup_vs_target']:.2f} vs target",
    ]
    if figures.get("hf_assisted_tok_s") is not None:
        lines += [
            f"  HF assisted       {figures['hf_assisted_tok_s']:8.2f} tok/s   ours x{figures['speedup_vs_hf']:.2f} vs HF",
            f"  HF target alone   {figures['hf_target_tok_s']:8.2f} tok/s",
        ]
    if figures.get("constrained_prompts"):
        lines.append(
            f"  {figures['constrained_prompts']} prompts with a response_format, constrained on both paths "
            "(no HF peer: transformers' generate has no grammar)"
        )
    elif (figures.get("hf_peer") or "").startswith("none: "):
        lines.append(f"  no HF peer: {figures['hf_peer'].removeprefix('none: ')}")
    lines += [
        f"  acceptance rate {num(figures['acceptance_rate'], '.3f')}, mean acceptance length "
        f"{num(figures['mean_acceptance_length'], '.2f')}, target forwards/token "
        f"{num(figures['target_forwards_per_token'], '.3f')}",
        f"  tokens verified per step {num(figures['tokens_verified_per_step'], '.2f')}, acceptance by depth "
        f"{depths(figures['acceptance_by_depth'])}",
        f"  time to first token: target alone {figures['ttft_target_s'] * 1000:.0f} ms, ours "
        f"{figures['ttft_spec_s'] * 1000:.0f} ms (x{figures['ttft_ratio']:.2f}), median over prompts",
        f"  identical to target alone: {figures['identical']} ({figures['identical_prompts']}/{figures['prompts']})",
    ]
    return "\n".join(lines)


def depths(rates: list[float]) -> str:
    """[0.71, 0.4, 0.12] -> '1: 0.71  2: 0.40  3: 0.12' (the first 8); 'none' when nothing was drafted."""
    return "  ".join(f"{depth}: {rate:.2f}" for depth, rate in enumerate(rates[:8], 1)) or "none"


def _no_hf_peer(engine: Engine, constrained: int) -> str | None:
    """Why transformers' generate has no like-for-like peer for this run; None when it has one."""
    if constrained:
        return "transformers' generate cannot apply the grammar"
    if not isinstance(engine.drafter, ModelDrafter | NgramDrafter):
        return f"transformers' generate has no {engine.draft_id} draft (it assists with a draft model or prompt lookup)"
    return None


@contextmanager
def prefixes_frozen(engine: Engine):
    """Inside the block no prompt enters the engine's prefix cache (prefix_cache.py); lookups still find
    what is in it. Two timed runs of one prompt then start from the same cache: without it the second
    would find the whole prompt the first left, and its prefill would be free."""
    cache = engine.prefix_cache
    with cache.frozen() if cache is not None else nullcontext():
        yield


def _first_token_s(engine: Engine, ids: list[int], max_new_tokens: int, **kwargs) -> float:
    started = time.perf_counter()
    stream = engine.stream(ids, max_new_tokens, **kwargs)
    try:
        next(stream)
        return time.perf_counter() - started
    finally:
        stream.close()


def _timed(fn, *args, **kwargs):
    """(fn(*args, **kwargs), seconds it took)."""
    started = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - started


def _warm_up(engine: Engine, ids: list[int], k: int | None, temperature: float, hf: bool, response_format) -> None:
    options = dict(temperature=temperature, seed=0, response_format=response_format)
    engine.generate(ids, 4, speculative=False, **options)
    engine.generate(ids, 4, k=k, **options)
    if hf:
        _hf_generate(engine, ids, 4, k, temperature, assisted=True)
        _hf_generate(engine, ids, 4, k, temperature, assisted=False)


def _hf_peer_description(engine: Engine, k: int | None) -> str:
    if isinstance(engine.drafter, NgramDrafter):
        return f"prompt_lookup_num_tokens={k or 10}"
    if k is None:
        return "assistant_model, transformers' default adaptive schedule"
    return f"assistant_model, num_assistant_tokens={k}, constant schedule, confidence stop off"


@contextmanager
def _assistant_config(draft_model, k: int | None):
    saved = copy.deepcopy(draft_model.generation_config)
    if k is not None:
        draft_model.generation_config.num_assistant_tokens = k
        draft_model.generation_config.num_assistant_tokens_schedule = "constant"
        draft_model.generation_config.assistant_confidence_threshold = 0.0
    try:
        yield
    finally:
        draft_model.generation_config = saved


@torch.inference_mode()
def _hf_generate(
    engine: Engine, ids: list[int], max_new_tokens: int, k: int | None, temperature: float, assisted: bool
) -> list[int]:
    inputs = torch.tensor([ids], device=engine.device)
    eos = sorted(engine.eos_ids)
    kwargs = dict(
        attention_mask=torch.ones_like(inputs),
        max_new_tokens=max_new_tokens,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
        do_sample=temperature > 0,
    )
    if temperature > 0:
        kwargs.update(temperature=temperature, top_p=1.0, top_k=0)
        torch.manual_seed(0)
    drafter = engine.drafter
    if assisted and isinstance(drafter, NgramDrafter):
        kwargs["prompt_lookup_num_tokens"] = k or 10
        assisted = False
    if assisted and isinstance(drafter, ModelDrafter):  # with the served adapter's layers merged in, if any
        with drafter.using(engine.adapters.general), _assistant_config(drafter.model, k):
            out = engine.target.generate(inputs, assistant_model=drafter.model, **kwargs)
    else:
        out = engine.target.generate(inputs, **kwargs)
    return out[0, len(ids) :].tolist()
