"""Loading by name: local directories, errors, device and dtype (the default model: test_real_model)."""

import os
import time
from pathlib import Path

import pytest
import torch
from tiny import llama, tiny_target

from adaptive_spec import Engine
from adaptive_spec.models import (
    STALE_CONVERSION_S,
    ModelLoadError,
    native_bf16,
    remove_stale_conversions,
    resolve_device,
    resolve_dtype,
    serving_dtype,
)


def test_a_local_directory_loads_as_target_and_as_separate_draft(tmp_path):
    tiny_target(0).save_pretrained(tmp_path / "target")
    llama(9, layers=1).save_pretrained(tmp_path / "draft")
    engine = Engine.from_pretrained(target=str(tmp_path / "target"), draft=str(tmp_path / "draft"), device="cpu")
    assert engine.tokenizer is None and engine.target_id == str(tmp_path / "target")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    assert engine.generate(prompt, 20, k=2).token_ids == engine.generate(prompt, 20, speculative=False).token_ids
    # dtype auto: bf16 where the CPU has native bf16 and the model passes the exactness check, else fp32
    plain = Engine(tiny_target(0).to(engine.dtype), None, eos_token_id=engine.eos_ids).generate(
        prompt, 20, speculative=False
    )
    assert engine.generate(prompt, 20, speculative=False).token_ids == plain.token_ids


def test_missing_models_get_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="could not load model"):
        Engine.from_pretrained(target=str(tmp_path / "nowhere"), device="cpu")
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        Engine.from_pretrained(target=str(tmp_path / "missing.gguf"), device="cpu")


def test_auto_device_and_dtype():
    device = resolve_device("auto")
    assert device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int3", device)


def test_serving_dtype_auto_is_bf16_where_the_cpu_computes_it_natively():
    cpu = torch.device("cpu")
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    assert native_bf16(cpu) == native
    assert serving_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
    assert serving_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert serving_dtype("fp32", cpu) == torch.float32 and serving_dtype("bf16", cpu) == torch.bfloat16


def test_conversions_that_never_finished_are_removed_and_one_under_way_is_not(tmp_path):
    """A conversion writes its fp32 copy under `.tmp-*` and renames it when done; a process ended mid-way
    (`serve` stopped while its models load exits with os._exit) left that copy for good. The next
    conversion removes those untouched for an hour, and nothing else."""
    now = time.time()
    stale, under_way, finished = tmp_path / ".tmp-dead", tmp_path / ".tmp-busy", tmp_path / "model-0123456789ab"
    for directory in (stale, under_way, finished):
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"weights")
    old = now - STALE_CONVERSION_S - 60
    for directory in (stale, finished):
        os.utime(directory, (old, old))
    assert remove_stale_conversions(tmp_path, now) == [stale]
    assert not stale.exists() and under_way.is_dir() and finished.is_dir()
