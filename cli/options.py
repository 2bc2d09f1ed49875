"""What the `adaptive-spec` commands share: argument types, the model flags (their defaults are
`ModelOptions`'), engine loading, JSON figures, the data directory, and a loopback Redis for the
commands that need one."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from adaptive_spec.contracts import DATA_DIR_ENV
from adaptive_spec.options import DTYPES, ModelOptions

MODELS = ModelOptions()  # the defaults of the model flags


class CommandError(Exception):
    """A command that cannot do what was asked (e.g. no redis-server to start): exit 2 with the message."""


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def confidence(text: str) -> float:
    """A one-sided confidence in [0.5, 1), e.g. 0.99."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 0.99, got {text!r}") from None
    if not 0.5 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0.5 and below 1, got {value}")
    return value


def k_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers, got {text!r}") from None
    if any(k < 1 for k in values):
        raise argparse.ArgumentTypeError(f"each k must be >= 1, got {text!r}")
    return values


def prompt_file(text: str) -> Path:
    """--prompts: a JSONL file, or the name of a shipped prompt set."""
    from adaptive_spec.outputs.prompts import PromptFileError
    from benchmarks.prompts import prompt_source

    try:
        return prompt_source(text)
    except PromptFileError as exc:
        raise argparse.ArgumentTypeError(f"no file {text!r}, and {exc}") from None


def resolve_draft(args: argparse.Namespace) -> None:
    """--draft's default, set after parsing. argparse tells a given option from its default by
    identity (`value is not action.default`), so with the default in the parser `--draft head
    --compare-drafts ...` would pass as "--draft not given" whenever the two strings are one
    object (interned), and the conflict would go unreported."""
    if getattr(args, "default_draft", None) and args.draft is None:
        args.draft = args.default_draft


def model_options(parser: argparse.ArgumentParser):
    """--target, --draft, --k, --max-new-tokens, --dtype, --device (DESIGN.md: generate, bench, bench-drift).
    Returns the mutually exclusive group --draft is in, for a command's alternative to it
    (bench-drift --compare-drafts)."""
    group = parser.add_argument_group("models")
    group.add_argument(
        "--target",
        default=MODELS.target,
        help=f"target model: the built-in {MODELS.target!r}, a Hugging Face id or local directory, "
        f"or a .gguf file (default: %(default)s)",
    )
    drafts = group.add_mutually_exclusive_group()
    drafts.add_argument(
        "--draft",
        default=None,  # MODELS.draft, filled in by `resolve_draft`: see there
        help="draft: early-exit:N (the target's first N layers), head (one layer reading the target's "
        "hidden state, EAGLE-style), ngram (prompt lookup), ngram+head or ngram+early-exit:N (prompt lookup "
        f"first), or a model with the target's vocabulary (default: {MODELS.draft})",
    )
    parser.set_defaults(default_draft=MODELS.draft)
    group.add_argument(
        "--k",
        type=non_negative_int,
        default=None,
        help="tokens drafted per step; omit it for dynamic k, which adapts to measured acceptance "
        "and cost and falls back to plain decoding when drafting does not pay",
    )
    group.add_argument("--max-new-tokens", type=positive_int, default=64, help="default: %(default)s")
    group.add_argument(
        "--dtype",
        default=MODELS.dtype,
        choices=DTYPES,
        help="auto = bf16 on a GPU and on a CPU with native bf16 (AVX512-BF16, AMX) where the start-up "
        "exactness check passes, fp32 otherwise (default: %(default)s)",
    )
    group.add_argument("--device", default=MODELS.device, help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    path_options(group)
    return drafts


def path_options(group) -> None:
    """--compile/--no-compile and --tree-budget: how the engine decodes (model_options, and `up`/`serve`,
    whose settings give them to the engine)."""
    group.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=MODELS.compile,
        help="compile the decoding step with torch.compile (default: yes, unless ADAPTIVE_SPEC_COMPILE=0; the "
        "first start on a machine compiles for a few minutes, later starts reuse the data directory's cache)",
    )
    group.add_argument(
        "--tree-budget",
        type=positive_int,
        default=MODELS.tree_budget,
        metavar="N",
        help="draft trees of up to N nodes per row (drafts that can build them: head, ngram+head); default: chains",
    )


def adapter_option(parser: argparse.ArgumentParser) -> None:
    """--adapter (DESIGN.md: generate, bench, bench-serve): a trained draft to run."""
    parser.add_argument(
        "--adapter",
        default=None,
        metavar="DIR|VERSION",
        help="run the draft with this adapter: an adapter directory (as the trainer writes them), or a "
        "version of the registry (MLFLOW_TRACKING_URI, else the data directory's mlflow.db)",
    )


def resolve_adapter(adapter: str | None, option: str = "--adapter") -> Path | None:
    """An adapter directory for --adapter: the directory itself, or a registry version downloaded
    into the data directory's adapter cache (MLflow is imported only then)."""
    if adapter is None:
        return None
    path = Path(adapter)
    if path.is_dir():
        return path
    if not adapter.isdigit():
        raise CommandError(f"{option} {adapter!r} is neither a directory nor a registry version number")
    from adaptive_spec.contracts import ADAPTER_CACHE_DIR
    from adaptive_spec.models import data_dir
    from registry.client import AdapterRegistry, RegistryError, RegistryUnavailable

    try:
        registry = AdapterRegistry(data_dir=data_dir())
        return registry.download(adapter, data_dir() / ADAPTER_CACHE_DIR / f"cli-{adapter}")
    except (RegistryError, RegistryUnavailable) as exc:
        raise CommandError(f"{option} {adapter}: {exc}") from None


def model_options_of(args: argparse.Namespace) -> ModelOptions:
    """The model options a command's flags give (--target, --draft, --k, --dtype, --device)."""
    return ModelOptions(args.target, args.draft, args.k, args.dtype, args.device, args.compile, args.tree_budget)


def load_engine(args, **engine_options):
    """The engine the model flags describe (and --adapter, where the command has it); `engine_options` go to
    Engine.from_pretrained as they are (e.g. distill's k)."""
    from adaptive_spec.engine import Engine

    print(f"loading {args.target} with draft {args.draft} ...", file=sys.stderr)
    engine = Engine.from_pretrained(
        target=args.target,
        draft=args.draft,
        device=args.device,
        dtype=args.dtype,
        compile=args.compile,
        tree_budget=args.tree_budget,
        **engine_options,
    )
    from adaptive_spec.kernels import linear_bf16

    tiles = (
        " on AMX tiles" if engine.dtype_name == "bf16" and engine.path == "compiled" and linear_bf16.uses_amx() else ""
    )
    print(f"serving {engine.dtype_name} {engine.path}{tiles}: {engine.exactness.summary()}", file=sys.stderr)
    adapter = resolve_adapter(getattr(args, "adapter", None))
    if adapter is not None:
        engine.load_adapter(adapter)
        print(f"serving adapter {engine.adapter_version} from {adapter}", file=sys.stderr)
    return engine


def write_json(path: Path | None, figures: dict) -> None:
    if path:
        path.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"figures written to {path}", file=sys.stderr)


def raise_input(message: str):
    from adaptive_spec.engine import InputError

    raise InputError(message)


def use_data_dir(path: Path | None) -> None:
    """--data-dir, when given, for everything this process loads: the model cache (adaptive_spec/models.py
    `data_dir`) reads ADAPTIVE_SPEC_DATA_DIR, and child processes inherit it. The one place a command
    writes the environment."""
    if path is not None:
        os.environ[DATA_DIR_ENV] = str(path)


@contextlib.contextmanager
def redis_url(workdir: Path) -> Iterator[str]:
    """REDIS_URL when set; else a loopback redis-server started here and stopped on exit."""
    from launch.redis import RedisStartError, loopback_redis

    try:
        with loopback_redis(workdir, log=lambda line: print(line, file=sys.stderr)) as url:
            yield url
    except RedisStartError as exc:
        raise CommandError(str(exc)) from None
