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
31 / 33 / 42 / 42 / 49 ms with this: verifying 1 draft token costs 1.07 target steps with it
and 1.7 without, 4 draft tokens 1.6 with it and 1.4-1.9 without. It changes no weight and no formula, only the order of the
float additions inside each dot product, as a different batch size already does: greedy
output stays the target's own (the real-model equality tests run with it).

    from adaptive_spec.kernels import cpu_linear
    cpu_linear.install(model)   # every fp32 nn.Linear of `model` on the CPU; returns how many

Which order is faster depends on the CPU and its BLAS, so the first model large enough to be
memory-bound (`CALIBRATE_BYTES` of fp32 linear weights) is timed both ways at install, once per
process (about 2 s on the default model, logged at INFO): its linears' weights in sequence, as a decoding step
reads them, at 1 / 2 / 3 / 4 / 6 / 8 / 12 / 16 rows. Each row count then takes the order that
was faster (counts between two measured take the lower one's choice). On a later machine the
table flipped: `nn.Linear` took 44 / 35 / 51 / 62 ms at 1 / 2 / 3 / 4 rows against 93 / 78 / 91 / 93
ms this way, so calibration keeps the stock path there. `choices()` shows what was chosen.

Applied by `Engine` to the target and the draft when they are fp32 on the CPU.
ADAPTIVE_SPEC_CPU_LINEAR=0 turns it off, =1 takes (W @ x.T).T at every row count without
timing, =auto (the default) calibrates. Prefill-sized inputs and anything that needs gradients
(the trainer) take the stock path.
"""

from __future__ import annotations

import logging
import time
import types

import torch
import torch.nn.functional as F
from torch import nn

from adaptive_spec.options import OFF, CoreSettings

MAX_ROWS = 16  # beyond this (prefill), the stock GEMM is as fast or faster
CALIBRATE_BYTES = 64 * 2**20  # fp32 linear weights past this stream from memory: time both orders
CALIBRATE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16)

log = logging.getLogger(__name__)
# rows -> whether (W @ x.T).T is used; all True until a calibration says otherwise.
_transposed = dict.fromkeys(range(1, MAX_ROWS + 1), True)
_calibrated = False


def _mode() -> str:
    return CoreSettings.from_env().cpu_linear


def enabled() -> bool:
    return _mode() not in OFF


def choices() -> dict[int, bool]:
    """Row count -> whether it takes (W @ x.T).T (True) or the stock `nn.Linear` order (False)."""
    return dict(_transposed)


def applies(weight: torch.Tensor) -> bool:
    """Whether products with `weight` take `skinny_linear`: fp32 on the CPU, unless turned off."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and enabled()


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for inputs of at most MAX_ROWS rows, computed as (W @ x.T).T."""
    if torch.compiler.is_compiling():  # a compiled graph (a head's draft step in fp32) chooses its own product;
        return F.linear(x, weight, bias)  # a choice by row count here compiled a graph for every count
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n > MAX_ROWS or not _transposed[max(n, 1)] or torch.is_grad_enabled() or x.dtype != weight.dtype:
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
    linears = [m for m in model.modules() if type(m) is nn.Linear and applies(m.weight)]
    if _mode() == "auto" and not _calibrated and sum(m.weight.numel() * 4 for m in linears) >= CALIBRATE_BYTES:
        calibrate([m.weight for m in linears])
    for module in linears:
        module.forward = types.MethodType(_forward, module)  # type: ignore[method-assign]  # per instance, on purpose
    return len(linears)


@torch.inference_mode()
def calibrate(weights: list[torch.Tensor], reps: int = 1) -> dict[int, bool]:
    """Time a pass over `weights` both ways at each of CALIBRATE_ROWS and keep the faster order
    per row count, for every later product in this process."""
    global _calibrated
    started = time.perf_counter()
    width = {w.shape[1] for w in weights}
    inputs = {(rows, d): torch.randn(rows, d) for rows in CALIBRATE_ROWS for d in width}
    faster = {}
    for rows in CALIBRATE_ROWS:
        timings: dict[bool, float] = {}
        for transposed in (True, False, True, False):  # interleaved: a drifting machine hits both alike
            _transposed[rows] = transposed
            best = timings.get(transposed, float("inf"))
            for _ in range(reps):
                began = time.perf_counter()
                for w in weights:
                    skinny_linear(inputs[rows, w.shape[1]], w)
                best = min(best, time.perf_counter() - began)
            timings[transposed] = best
        faster[rows] = timings[True] < timings[False]
    for rows in range(1, MAX_ROWS + 1):
        _transposed[rows] = faster[max(r for r in CALIBRATE_ROWS if r <= rows)]
    _calibrated = True
    log.info(
        "cpu_linear: (W @ x.T).T at rows %s, nn.Linear at rows %s (calibrated in %.1f s)",
        [r for r, t in _transposed.items() if t],
        [r for r, t in _transposed.items() if not t],
        time.perf_counter() - started,
    )
    return choices()
