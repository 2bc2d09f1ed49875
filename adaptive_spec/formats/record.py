"""The correction record: what the draft proposed, what the target kept, what it wanted instead.

One record per finished request. The serving loop already has every field when the request
ends (the target computed its top-m while verifying), so writing a record costs no extra
forward pass. The trainer distills the draft on exactly these positions.

Binary format, version 1 (all little-endian; `w` is the id width, 2 bytes or 4 with FLAG_WIDE_IDS):

    offset  size          field
    0       4             magic b"ASCR"
    4       1             format version (1)
    5       1             flags (bit 0: token ids are uint32, else uint16)
    6       8             created_at, float64 unix seconds
    14      8             temperature, float64
    22      4             n_prompt, uint32
    26      4             n_out, uint32
    30      2             m, uint16 (top-m width)
    32      5 x (2 + len) request_id, domain, target_id, draft_id, adapter_version:
                          uint16 byte length + UTF-8; length 0xFFFF means None
    ...     n_prompt * w  prompt_ids
    ...     n_out * w     output_ids
    ...     n_out * w     proposed (0 where nothing was proposed; see the next bitmask)
    ...     ceil(n_out/8) has_proposal bitmask (LSB first)
    ...     ceil(n_out/8) accepted bitmask (LSB first)
    ...     n_out * m * w target_topk_ids, row-major [n_out, m]
    ...     n_out * m * 2 target_topk_logprobs, float16, row-major [n_out, m]
    end-4   4             CRC-32 (zlib) of every byte before it

Size, worked example: 64 output tokens, m = 16, a 100-token prompt, uint16 ids, a 32-character
request id, domain "json", target "smollm2-135m-instruct", draft "early-exit:4", adapter "3":

    header 32 + strings (5 * 2 + 32 + 4 + 21 + 12 + 1 = 80) + prompt 100 * 2 = 200
    + output 64 * 2 = 128 + proposed 128 + two bitmasks 2 * 8 = 16
    + top-m ids 64 * 16 * 2 = 2048 + top-m logprobs 2048 + CRC 4          = 4684 bytes,

that is 68.25 bytes per output token at m = 16 (`bytes_per_output_token(16)`): 2 (output id)
+ 2 (proposed id) + 0.25 (two bits) + 16 * (2 + 2) (top-m ids and fp16 logprobs). The same
top-m as JSON floats would take about 20 kB. With ids >= 65536 the per-token cost is
4 + 4 + 0.25 + 16 * (4 + 2) = 104.25 bytes.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"ASCR"
FORMAT_VERSION = 1
FLAG_WIDE_IDS = 0x01  # token ids stored as uint32 instead of uint16
_KNOWN_FLAGS = FLAG_WIDE_IDS

_HEADER = struct.Struct("<4sBBddIIH")  # magic, version, flags, created_at, temperature, n_prompt, n_out, m
_STRLEN = struct.Struct("<H")
_CRC = struct.Struct("<I")
_NONE_STR = 0xFFFF  # string length meaning None
_MAX_ID = 2**32 - 1
_STRING_FIELDS = ("request_id", "domain", "target_id", "draft_id", "adapter_version")


def bytes_per_output_token(m: int, wide_ids: bool = False) -> float:
    """Encoded bytes that each output token adds to a record, excluding header, strings and prompt.

    bytes_per_output_token(16) == 68.25: output id 2 + proposed id 2 + 2 bits + 16 * (2 + 2).
    """
    id_bytes = 4 if wide_ids else 2
    return 2 * id_bytes + 2 / 8 + m * (id_bytes + 2)


@dataclass(eq=False)
class CorrectionRecord:
    """One finished request, as the trainer needs it.

    Token arrays may be given as lists, numpy arrays or torch tensors; they are normalised on
    construction (lists of int/bool, numpy int64 ids, numpy float16 logprobs), so a record
    compares equal to its own `decode(encode())`.
    """

    request_id: str
    created_at: float  # unix seconds
    domain: str | None  # the prompt's domain tag, if any
    target_id: str
    draft_id: str
    adapter_version: str | None  # None for the base draft
    temperature: float  # 0.0 = greedy
    prompt_ids: list[int]  # [n_prompt]
    output_ids: list[int]  # [n_out] generated tokens only
    proposed: list[int]  # [n_out] draft token proposed at that output position, -1 for none
    accepted: list[bool]  # [n_out] True when output_ids[i] is an accepted draft token
    target_topk_ids: np.ndarray  # [n_out, m] int64, the target's top-m tokens at each position
    target_topk_logprobs: np.ndarray  # [n_out, m] float16, their log-probabilities

    def __post_init__(self) -> None:
        self.prompt_ids = _int_list(self.prompt_ids)
        self.output_ids = _int_list(self.output_ids)
        self.proposed = _int_list(self.proposed)
        self.accepted = [bool(a) for a in _plain(self.accepted)]
        self.target_topk_ids = _matrix(self.target_topk_ids, np.int64)
        self.target_topk_logprobs = _matrix(self.target_topk_logprobs, np.float16)

    @property
    def encoded_size(self) -> int:
        """len(self.encode()), computed without encoding."""
        id_bytes = 4 if self._wide_ids() else 2
        n_out, m = self.target_topk_ids.shape
        strings = sum(_STRLEN.size + len((getattr(self, f) or "").encode()) for f in _STRING_FIELDS)
        bitmasks = 2 * ((n_out + 7) // 8)
        ids = (len(self.prompt_ids) + 2 * n_out + n_out * m) * id_bytes
        return _HEADER.size + strings + ids + bitmasks + n_out * m * 2 + _CRC.size

    @property
    def bytes_per_token(self) -> float:
        """encoded_size / n_out: this record's whole cost (header and prompt included) per output token."""
        return self.encoded_size / max(1, len(self.output_ids))

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("request_id must be a non-empty str")
        for name in _STRING_FIELDS:
            value = getattr(self, name)
            if value is None and name in ("domain", "adapter_version"):
                continue
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a str, got {type(value).__name__}")
            if len(value.encode()) >= _NONE_STR:
                raise ValueError(f"{name} is longer than {_NONE_STR - 1} UTF-8 bytes")
        if not math.isfinite(self.created_at):
            raise ValueError(f"created_at must be finite, got {self.created_at}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")

        n_out = len(self.output_ids)
        if len(self.proposed) != n_out:
            raise ValueError(f"len(proposed) = {len(self.proposed)} but len(output_ids) = {n_out}")
        if len(self.accepted) != n_out:
            raise ValueError(f"len(accepted) = {len(self.accepted)} but len(output_ids) = {n_out}")
        if self.target_topk_ids.ndim != 2 or self.target_topk_ids.shape[0] != n_out:
            raise ValueError(f"target_topk_ids has shape {self.target_topk_ids.shape}, want [{n_out}, m]")
        if self.target_topk_logprobs.shape != self.target_topk_ids.shape:
            raise ValueError(
                f"target_topk_logprobs has shape {self.target_topk_logprobs.shape}, "
                f"want {self.target_topk_ids.shape} like target_topk_ids"
            )
        if self.target_topk_ids.shape[1] > 0xFFFF:
            raise ValueError(f"m = {self.target_topk_ids.shape[1]} is larger than 65535")

        _check_ids("prompt_ids", np.asarray(self.prompt_ids, dtype=np.int64), low=0)
        _check_ids("output_ids", np.asarray(self.output_ids, dtype=np.int64), low=0)
        _check_ids("proposed", np.asarray(self.proposed, dtype=np.int64), low=-1)
        _check_ids("target_topk_ids", self.target_topk_ids, low=0)
        for i, (was_accepted, draft_token, token) in enumerate(
            zip(self.accepted, self.proposed, self.output_ids, strict=True)
        ):
            if was_accepted and draft_token != token:
                raise ValueError(
                    f"accepted[{i}] is True but proposed[{i}] = {draft_token} != output_ids[{i}] = {token}"
                )

    def encode(self) -> bytes:
        """The version-1 binary form described in the module docstring. Validates first."""
        self.validate()
        wide = self._wide_ids()
        id_dtype = np.dtype("<u4" if wide else "<u2")
        n_out, m = self.target_topk_ids.shape
        proposed = np.asarray(self.proposed, dtype=np.int64)  # [n_out]
        has_proposal = proposed >= 0  # [n_out]

        parts = [
            _HEADER.pack(
                MAGIC,
                FORMAT_VERSION,
                FLAG_WIDE_IDS if wide else 0,
                float(self.created_at),
                float(self.temperature),
                len(self.prompt_ids),
                n_out,
                m,
            )
        ]
        for name in _STRING_FIELDS:
            value = getattr(self, name)
            if value is None:
                parts.append(_STRLEN.pack(_NONE_STR))
            else:
                raw = value.encode()
                parts += [_STRLEN.pack(len(raw)), raw]
        parts += [
            np.asarray(self.prompt_ids, dtype=np.int64).astype(id_dtype).tobytes(),
            np.asarray(self.output_ids, dtype=np.int64).astype(id_dtype).tobytes(),
            np.where(has_proposal, proposed, 0).astype(id_dtype).tobytes(),
            np.packbits(has_proposal, bitorder="little").tobytes(),
            np.packbits(np.asarray(self.accepted, dtype=bool), bitorder="little").tobytes(),
            self.target_topk_ids.astype(id_dtype).tobytes(),
            self.target_topk_logprobs.astype("<f2").tobytes(),
        ]
        body = b"".join(parts)
        return body + _CRC.pack(zlib.crc32(body))

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> CorrectionRecord:
        """Inverse of encode(). ValueError on a wrong magic, an unknown version or flag,
        truncated or trailing bytes, a checksum mismatch or inconsistent fields."""
        reader = _Reader(bytes(data))
        magic = reader.take(len(MAGIC), "magic")
        if magic != MAGIC:
            raise ValueError(f"not a correction record: magic {magic!r}, want {MAGIC!r}")
        version = reader.take(1, "format version")[0]
        if version != FORMAT_VERSION:
            raise ValueError(
                f"unsupported correction record format version {version} (this build reads {FORMAT_VERSION})"
            )
        reader.offset = 0
        _, _, flags, created_at, temperature, n_prompt, n_out, m = _HEADER.unpack(reader.take(_HEADER.size, "header"))
        if flags & ~_KNOWN_FLAGS:
            raise ValueError(f"unknown correction record flags 0x{flags:02x}")
        strings: dict[str, Any] = {}
        for name in _STRING_FIELDS:
            (length,) = _STRLEN.unpack(reader.take(_STRLEN.size, f"{name} length"))
            strings[name] = None if length == _NONE_STR else _utf8(reader.take(length, name), name)

        id_dtype = np.dtype("<u4" if flags & FLAG_WIDE_IDS else "<u2")
        prompt_ids = reader.array(id_dtype, n_prompt, "prompt_ids")
        output_ids = reader.array(id_dtype, n_out, "output_ids")
        proposed = reader.array(id_dtype, n_out, "proposed").astype(np.int64)
        mask_bytes = (n_out + 7) // 8
        has_proposal = np.unpackbits(reader.array(np.uint8, mask_bytes, "has_proposal"), count=n_out, bitorder="little")
        accepted = np.unpackbits(reader.array(np.uint8, mask_bytes, "accepted"), count=n_out, bitorder="little")
        topk_ids = reader.array(id_dtype, n_out * m, "target_topk_ids").reshape(n_out, m)
        topk_logprobs = reader.array(np.dtype("<f2"), n_out * m, "target_topk_logprobs").reshape(n_out, m)
        body_end = reader.offset
        (crc,) = _CRC.unpack(reader.take(_CRC.size, "checksum"))
        if reader.offset != len(reader.data):
            raise ValueError(f"correction record has {len(reader.data) - reader.offset} trailing bytes")
        if zlib.crc32(reader.data[:body_end]) != crc:
            raise ValueError("correction record checksum mismatch: the bytes are corrupt")

        record = cls(
            request_id=strings["request_id"],
            created_at=created_at,
            domain=strings["domain"],
            target_id=strings["target_id"],
            draft_id=strings["draft_id"],
            adapter_version=strings["adapter_version"],
            temperature=temperature,
            prompt_ids=prompt_ids.tolist(),
            output_ids=output_ids.tolist(),
            proposed=np.where(has_proposal.astype(bool), proposed, -1).tolist(),
            accepted=accepted.astype(bool).tolist(),
            target_topk_ids=topk_ids,
            target_topk_logprobs=topk_logprobs,
        )
        record.validate()
        return record

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CorrectionRecord):
            return NotImplemented
        scalars = (
            "request_id",
            "created_at",
            "domain",
            "target_id",
            "draft_id",
            "adapter_version",
            "temperature",
            "prompt_ids",
            "output_ids",
            "proposed",
            "accepted",
        )
        return (
            all(getattr(self, name) == getattr(other, name) for name in scalars)
            and np.array_equal(self.target_topk_ids, other.target_topk_ids)
            and np.array_equal(self.target_topk_logprobs, other.target_topk_logprobs, equal_nan=True)
        )

    def _wide_ids(self) -> bool:
        largest = max(
            max(self.prompt_ids, default=0),
            max(self.output_ids, default=0),
            max(self.proposed, default=0),
            int(self.target_topk_ids.max()) if self.target_topk_ids.size else 0,
        )
        return largest > 0xFFFF


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.offset = 0

    def take(self, size: int, what: str) -> bytes:
        end = self.offset + size
        if end > len(self.data):
            raise ValueError(
                f"truncated correction record: {what} needs bytes {self.offset}..{end}, only {len(self.data)} present"
            )
        chunk = self.data[self.offset : end]
        self.offset = end
        return chunk

    def array(self, dtype: Any, count: int, what: str) -> np.ndarray:
        dtype = np.dtype(dtype)
        return np.frombuffer(self.take(count * dtype.itemsize, what), dtype=dtype)


def _plain(values: Any) -> Any:
    """Torch tensors and numpy arrays to Python lists; anything else unchanged."""
    if hasattr(values, "detach"):
        values = values.detach().cpu()
    return values.tolist() if hasattr(values, "tolist") else values


def _int_list(values: Any) -> list[int]:
    return [int(v) for v in _plain(values)]


def _matrix(values: Any, dtype: type) -> np.ndarray:
    if hasattr(values, "detach"):  # a torch tensor; numpy has no bfloat16, so widen it first
        values = values.detach().cpu()
        if str(values.dtype) == "torch.bfloat16":
            values = values.float()
        values = values.numpy()
    array: np.ndarray = np.array(values, dtype=dtype)  # always a private, writable copy
    if array.size == 0 and array.ndim != 2:
        array = array.reshape(0, 0)
    return array


def _check_ids(name: str, ids: np.ndarray, low: int) -> None:
    if ids.size and (ids.min() < low or ids.max() > _MAX_ID):
        raise ValueError(f"{name} must lie in [{low}, {_MAX_ID}], got min {ids.min()} max {ids.max()}")


def _utf8(raw: bytes, name: str) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError as error:
        raise ValueError(f"correction record field {name} is not valid UTF-8") from error


def record_from_output(
    output: Any,
    *,
    request_id: str,
    created_at: float,
    domain: str | None,
    target_id: str,
    draft_id: str,
    temperature: float,
) -> CorrectionRecord:
    """The correction record of a finished `GenerationOutput` (an engine built with record_topk > 0)."""
    if output.target_topk_ids is None:
        raise ValueError("this output carries no target top-m: build the Engine with record_topk > 0")
    return CorrectionRecord(
        request_id=request_id,
        created_at=created_at,
        domain=domain,
        target_id=target_id,
        draft_id=draft_id,
        adapter_version=output.stats.adapter_version,
        temperature=temperature,
        prompt_ids=list(output.prompt_ids),
        output_ids=list(output.token_ids),
        proposed=list(output.proposed),
        accepted=list(output.accepted),
        target_topk_ids=output.target_topk_ids,
        target_topk_logprobs=output.target_topk_logprobs,
    )
