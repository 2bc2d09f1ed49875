"""A draft's weights as one sha256, the same whether read from an EAGLE-3 checkpoint (the version the sidecar sends)
or from the parameters a vLLM worker holds after loading it (`worker.DraftSwap.adaptive_spec_draft`): so that the
version vLLM serves is read back from vLLM, not echoed.

    fingerprint({"fc.weight": fc, "d2t": d2t, ...}, torch.bfloat16)    # -> "9f2c..."

Every tensor of the standard names but `t2d` (vLLM does not keep it), sorted by name; floating tensors cast to the
dtype they are served in (what a worker holds) and hashed as float32 bytes, integer ones as int64 bytes.
"""

from __future__ import annotations

import hashlib

import torch

SKIPPED = ("t2d", "embed_tokens.weight")  # not kept by vLLM (t2d), or the target's own (embed_tokens)


def fingerprint(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        if name in SKIPPED:
            continue
        tensor = tensors[name].detach().cpu()
        tensor = tensor.to(dtype).float() if tensor.is_floating_point() else tensor.long()
        digest.update(f"{name} {tuple(tensor.shape)}\n".encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()
