"""Faster linear layers for decoding on CPU: a few rows times a weight that is read from memory.

Decoding multiplies 1 to 9 rows of activations by every weight of the model, so a step costs
about the time to stream the weights from memory. PyTorch computes `nn.Linear` as
`x @ W.T`, and on this CPU the BLAS (MKL, fp32) is slow at that shape when x is skinny: one
target step of the default model spends ~60 ms in matrix products that read ~540 MB, about
twice what the memory bandwidth allows, and 2-4 rows cost 1.5-2x one row. Computed the other
way round, `(W @ x.T).T`, the same products run near the bandwidth bound, and a single row
is padded to two because MKL's one-column path is the slow one again.

Measured on the default model (fp32, 2 cores, minimum of 10-12 interleaved forwards over a
200-token cache): rows 1 / 2 / 3 / 4 / 5 took 57 / 98 / 127 / 108 / 79 ms with `nn.Linear`, and
31 / 33 / 42 / 42 / 49 ms with this. Verifying 1 draft token now costs 1.07 target steps
instead of 1.7, and 4 draft tokens 1.6 instead of 1.4-1.9. It changes no weight and no formula, only the order of the
float additions inside each dot product, as a different batch size already does: greedy
output stays the target's own (the real-model equality tests run with it).

    from adaptive_spec import cpu_linear
    cpu_linear.install(model)   # every fp32 nn.Linear of `model` on the CPU; returns how many

Applied by `Engine` to the target and the draft when they are fp32 on the CPU; set
ADAPTIVE_SPEC_CPU_LINEAR=0 to turn it off (e.g. to measure the difference). Prefill-sized
inputs and anything that needs gradients (the trainer) take the stock path.
"""

from __future__ import annotations

import os
import types

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 16  # beyond this (prefill), the stock GEMM is as fast or faster


def enabled() -> bool:
    return os.environ.get("ADAPTIVE_SPEC_CPU_LINEAR", "1").strip().lower() not in ("0", "false", "no", "off")


def applies(weight: torch.Tensor) -> bool:
    """Whether products with `weight` take `skinny_linear`: fp32 on the CPU, unless turned off."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and enabled()


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for inputs of at most MAX_ROWS rows, computed as (W @ x.T).T."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n > MAX_ROWS or torch.is_grad_enabled() or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    # Row-major rows in, row-major rows out: a transposed result fed to the next layer would hand
    # MKL the other operand layout, which costs 1.4x at 2-5 rows.
    if n == 1:
        out = torch.mm(weight, rows.expand(2, -1).contiguous().t())[:, :1].t().contiguous()
    else:
        out = torch.mm(weight, rows.contiguous().t()).t().contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return skinny_linear(x, self.weight, self.bias)


def install(model: nn.Module) -> int:
    """Route every fp32 CPU `nn.Linear` of `model` through `skinny_linear`. Idempotent.

    The new forward is bound to each module instance, so `copy.deepcopy` of a layer (early-exit
    drafts, adapter slots) carries it over to the copy.
    """
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and applies(module.weight):
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count
