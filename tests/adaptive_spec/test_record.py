"""The correction record's binary form: exact round trips, clear errors, and its size."""

from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

from adaptive_spec.formats import record as record_module
from adaptive_spec.formats.record import FLAG_WIDE_IDS, FORMAT_VERSION, MAGIC, CorrectionRecord, bytes_per_output_token


@pytest.mark.parametrize("seed", range(6))
def test_round_trip_is_exact(make_record, seed):
    record = make_record(seed, n_out=1 + 17 * seed, m=[16, 8, 1][seed % 3])
    data = record.encode()
    assert len(data) == record.encoded_size
    decoded = CorrectionRecord.decode(data)
    assert decoded == record
    assert decoded.encode() == data
    assert decoded.target_topk_logprobs.dtype == np.float16


def test_uint16_path_holds_ids_up_to_65535(make_record):
    record = make_record(1, vocab=65536)
    record.output_ids[0] = record.proposed[0] = record.target_topk_ids[0, 0] = 65535
    record.accepted[0] = True
    data = record.encode()
    assert data[5] & FLAG_WIDE_IDS == 0
    assert CorrectionRecord.decode(data) == record


def test_uint32_path_for_large_vocabularies(make_record):
    narrow = make_record(2, vocab=65536)
    wide = make_record(2, vocab=65536)
    wide.prompt_ids[0] = 151_000  # e.g. a Qwen-sized vocabulary
    data = wide.encode()
    assert data[5] & FLAG_WIDE_IDS
    assert CorrectionRecord.decode(data) == wide
    n_out, m = wide.target_topk_ids.shape
    n_ids = len(wide.prompt_ids) + 2 * n_out + n_out * m
    assert len(data) - len(narrow.encode()) == 2 * n_ids  # every id went from 2 bytes to 4


def test_empty_output(make_record):
    record = make_record(3, n_out=0)
    assert record.target_topk_ids.shape == (0, 16)
    assert CorrectionRecord.decode(record.encode()) == record
    bare = CorrectionRecord("r", 0.0, None, "t", "d", None, 0.0, [], [], [], [], np.zeros(0), np.zeros(0))
    decoded = CorrectionRecord.decode(bare.encode())
    assert decoded == bare and decoded.target_topk_ids.shape == (0, 0)


def test_torch_inputs_are_converted(make_record):
    reference = make_record(4)
    from_torch = CorrectionRecord(
        **{
            **reference.__dict__,
            "output_ids": torch.tensor(reference.output_ids),
            "proposed": torch.tensor(reference.proposed),
            "accepted": torch.tensor(reference.accepted),
            "target_topk_ids": torch.from_numpy(reference.target_topk_ids),
            "target_topk_logprobs": torch.from_numpy(reference.target_topk_logprobs.astype(np.float32)).bfloat16(),
        }
    )
    assert isinstance(from_torch.target_topk_logprobs, np.ndarray) and isinstance(from_torch.output_ids[0], int)
    assert from_torch.output_ids == reference.output_ids and from_torch.accepted == reference.accepted
    assert CorrectionRecord.decode(from_torch.encode()) == from_torch


def test_strings_and_none_survive(make_record):
    record = make_record(5)
    record.domain, record.adapter_version, record.request_id = "données-δ", None, "ü" * 300
    assert CorrectionRecord.decode(record.encode()) == record


def test_wrong_magic(make_record):
    data = bytearray(make_record(0).encode())
    data[:4] = b"JSON"
    with pytest.raises(ValueError, match="magic"):
        CorrectionRecord.decode(bytes(data))
    with pytest.raises(ValueError, match="magic"):
        CorrectionRecord.decode(b'{"request_id": "x"}')


def test_unknown_version_and_flags(make_record):
    data = bytearray(make_record(0).encode())
    data[4] = FORMAT_VERSION + 1
    with pytest.raises(ValueError, match=f"version {FORMAT_VERSION + 1}"):
        CorrectionRecord.decode(bytes(data))
    data[4], data[5] = FORMAT_VERSION, 0x80
    with pytest.raises(ValueError, match="flags"):
        CorrectionRecord.decode(bytes(data))


def test_every_truncation_is_a_value_error(make_record):
    data = make_record(1, n_out=5, m=4).encode()
    for length in range(len(data)):
        with pytest.raises(ValueError, match=r"truncated|magic"):
            CorrectionRecord.decode(data[:length])
    with pytest.raises(ValueError, match="trailing"):
        CorrectionRecord.decode(data + b"\0")


def test_corrupt_bytes_fail_the_checksum(make_record):
    data = make_record(2).encode()
    for position in (50, len(data) // 2, len(data) - 5):  # a string, an id array, a logprob
        corrupt = bytearray(data)
        corrupt[position] ^= 0x10
        with pytest.raises(ValueError, match="checksum"):
            CorrectionRecord.decode(bytes(corrupt))
    corrupt = bytearray(data)
    corrupt[26] ^= 0x10  # n_out: the arrays no longer fit the bytes
    with pytest.raises(ValueError, match=r"truncated|trailing"):
        CorrectionRecord.decode(bytes(corrupt))


def test_validate_names_the_problem(make_record):
    cases = {
        "len\\(proposed\\)": lambda r: r.proposed.pop(),
        "len\\(accepted\\)": lambda r: r.accepted.append(False),
        "target_topk_ids has shape": lambda r: setattr(r, "target_topk_ids", r.target_topk_ids[1:]),
        "target_topk_logprobs has shape": lambda r: setattr(r, "target_topk_logprobs", r.target_topk_logprobs[:, :3]),
        "output_ids must lie": lambda r: r.output_ids.__setitem__(0, -5),
        "proposed must lie": lambda r: r.proposed.__setitem__(0, -2),
        "accepted\\[0\\] is True": lambda r: (r.accepted.__setitem__(0, True), r.proposed.__setitem__(0, -1)),
        "temperature": lambda r: setattr(r, "temperature", -1.0),
        "request_id": lambda r: setattr(r, "request_id", ""),
    }
    for message, break_it in cases.items():
        record = make_record(3)
        record.validate()
        break_it(record)
        with pytest.raises(ValueError, match=message):
            record.encode()


def test_size_per_token():
    """The module docstring's worked example: 64 output tokens at m = 16."""
    n_out, m = 64, 16
    rng = np.random.default_rng(0)
    output_ids = rng.integers(0, 49152, n_out).tolist()
    record = CorrectionRecord(
        request_id="0123456789abcdef0123456789abcdef",
        created_at=1_700_000_000.0,
        domain="json",
        target_id="smollm2-135m-instruct",
        draft_id="early-exit:4",
        adapter_version="3",
        temperature=0.0,
        prompt_ids=list(range(100)),
        output_ids=output_ids,
        proposed=[t if i % 3 else -1 for i, t in enumerate(output_ids)],
        accepted=[i % 3 == 1 for i in range(n_out)],
        target_topk_ids=rng.integers(0, 49152, (n_out, m)),
        target_topk_logprobs=-rng.exponential(3.0, (n_out, m)),
    )
    size = len(record.encode())
    print(
        f"\ncorrection record: {size} bytes for {n_out} output tokens at m={m} (100-token prompt); "
        f"{bytes_per_output_token(m)} bytes per output token marginal, {record.bytes_per_token:.2f} all-in; "
        f"uint32 ids: {bytes_per_output_token(m, wide_ids=True)}"
    )
    assert size == record.encoded_size == 4684
    assert bytes_per_output_token(16) == 68.25
    assert bytes_per_output_token(16, wide_ids=True) == 104.25


def test_header_layout_is_the_documented_one(make_record):
    record = make_record(0, n_out=7, m=5, n_prompt=3)
    magic, version, flags, created_at, temperature, n_prompt, n_out, m = struct.unpack_from(
        "<4sBBddIIH", record.encode()
    )
    assert (magic, version, flags) == (MAGIC, FORMAT_VERSION, 0)
    assert (created_at, temperature, n_prompt, n_out, m) == (record.created_at, record.temperature, 3, 7, 5)


def test_core_library_imports_no_service_code():
    """record.py alone (not the package __init__, which loads torch) must not pull in service code."""
    banned = ("redis", "fastapi", "mlflow")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('record', {record_module.__file__!r})\n"
        "sys.modules['record'] = module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        f"print([m for m in {banned!r} if m in sys.modules])\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
