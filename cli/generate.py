"""`adaptive-spec generate` and `adaptive-spec bench`: the core library from the terminal. They import
no Redis, FastAPI or MLflow code (tests/cli/test_cli.py checks it).

    adaptive-spec generate "Write a haiku about rivers."       # one prompt, streamed
    adaptive-spec bench --json bench.json                      # target vs speculative vs HF peer
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cli.options import (
    adapter_option,
    load_engine,
    model_options,
    positive_int,
    prompt_file,
    raise_input,
    resolve_adapter,
    write_json,
)


def add_commands(commands) -> None:
    gen = commands.add_parser(
        "generate",
        help="generate for one prompt from the terminal, streamed",
        description="Generate for one prompt and stream the text to stdout. Figures for speculation go to stderr.",
    )
    gen.add_argument("prompt", nargs="?", help="the prompt; read from stdin when omitted")
    gen.add_argument(
        "--raw", action="store_true", help="send the text as is, without the chat template (default: as a user message)"
    )
    gen.add_argument(
        "--prompts",
        type=prompt_file,
        help="a JSONL prompt file, or a shipped set's name (chat, json_schema, ...): generate for each prompt in turn",
    )
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0, help="0 disables it")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--no-speculative", action="store_true", help="run the target alone (the baseline)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    model_options(gen)
    adapter_option(gen)
    gen.set_defaults(func=cmd_generate)

    bench = commands.add_parser(
        "bench",
        help="tokens/s of the target alone vs speculative vs Hugging Face assisted generation",
        description="Time the target alone, our speculative engine and the Hugging Face assisted-generation peer "
        "on the same prompts in one run, and check that every output equals the target alone's.",
    )
    bench.add_argument(
        "--prompts",
        type=prompt_file,
        help="a JSONL prompt file or a shipped set's name: chat (the default), json_extraction, sql, python, "
        "casual_chat, or json_schema (json_extraction's prompts, each with a JSON schema as its response_format)",
    )
    bench.add_argument(
        "--num-prompts", type=positive_int, default=8, help="use the first N prompts (default: %(default)s)"
    )
    bench.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default), where `identical` is checked"
    )
    bench.add_argument("--json", type=Path, metavar="FILE", help="write the figures to FILE")
    bench.add_argument(
        "--compare-paths",
        type=_paths,
        metavar="PATH,PATH",
        help="time execution paths side by side, interleaved prompt by prompt: fp32-eager, fp32-compiled, "
        "bf16-eager, bf16-compiled, bf16-compiled-avx512 (its products on AVX512-BF16 where the CPU also has "
        "AMX tiles, which bf16-compiled then uses) (e.g. fp32-eager,bf16-compiled); each loads its own engine, "
        "and --dtype and --compile are then the paths'",
    )
    model_options(bench)
    adapter_option(bench)
    bench.set_defaults(func=cmd_bench)


def cmd_generate(args) -> int:
    from adaptive_spec.outputs.prompts import PromptItem, load_prompts

    if args.prompts:
        items = load_prompts(args.prompts)
    else:
        text = args.prompt if args.prompt is not None else sys.stdin.read()
        if not text.strip():
            raise_input("give a prompt as an argument or on stdin")
        items = [PromptItem(text if args.raw else [{"role": "user", "content": text}])]
    engine = load_engine(args)
    for item in items:
        kwargs = dict(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            k=args.k,
            stop=args.stop,
            speculative=not args.no_speculative,
            domain=item.domain,
            response_format=item.response_format,
        )
        if args.json:
            out = engine.generate(item.prompt, **kwargs)
            record = {
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
                "stats": out.stats.as_dict(),
            }
            print(json.dumps(record))
            continue
        out = _stream_text(engine, item.prompt, kwargs)
        s = out.stats
        rate = f"{s.acceptance_rate:.2f}" if s.acceptance_rate is not None else "n/a"
        print(
            f"[{len(out.token_ids)} tokens in {s.wall_s:.2f} s, {len(out.token_ids) / s.wall_s:.1f} tok/s; "
            f"acceptance {rate}, mean acceptance length {s.mean_acceptance_length:.2f}, "
            f"{s.target_forwards} target forwards, finish {out.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def _stream_text(engine, prompt, kwargs):
    """Print text as steps finish, never half a character or the start of a stop string."""
    from adaptive_spec.outputs.textstream import IncrementalText

    text = IncrementalText(engine, kwargs.get("stop"))
    for chunk in engine.stream(prompt, **kwargs):
        sys.stdout.write(text.push(chunk.token_ids) if chunk.output is None else text.finish(chunk.output.text) + "\n")
        sys.stdout.flush()
        if chunk.output is not None:
            return chunk.output
    raise AssertionError("stream ended without an output")


def _paths(text: str) -> list[str]:
    from benchmarks.paths import parse_paths

    try:
        return parse_paths(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_bench(args) -> int:
    from adaptive_spec.outputs.prompts import load_prompts
    from benchmarks.bench import format_report, run_bench
    from benchmarks.prompts import shipped

    items = load_prompts(args.prompts or shipped("chat"))[: args.num_prompts]
    if args.compare_paths:
        return _bench_paths(args, items)
    engine = load_engine(args)
    figures = run_bench(engine, items, args.max_new_tokens, args.k, args.temperature, args.dtype)
    print(format_report(figures))
    write_json(args.json, figures)
    return 0 if figures["identical"] in (True, None) else 1


def _bench_paths(args, items) -> int:
    from benchmarks.paths import format_report, load_paths, run_paths

    engines = load_paths(args.compare_paths, args.target, args.draft, args.device, args.tree_budget)
    adapter = resolve_adapter(args.adapter)
    if adapter is not None:
        for engine, _ in engines.values():
            engine.load_adapter(adapter)
    figures = run_paths(engines, items, args.max_new_tokens, args.k)
    print(format_report(figures))
    write_json(args.json, figures)
    return 0 if figures["identical"] else 1
