"""The C++ bf16 product of the compiled step (`adaptive_spec.kernels.linear_bf16`).

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_linear_bf16.py -q   (builds it once: ~20 s)

What must hold: it computes x @ weight.T (+ bias) to bf16 rounding, and a row's output is bitwise the
same alone, in any batch, at any place in it, and however the threads split the outputs; with its products
on AVX512-BF16 and, on a CPU with AMX-BF16, on AMX tiles (each test runs on both there). On a CPU
without AVX512-BF16 the kernel does not serve (load gives None) and these tests are skipped as such.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from adaptive_spec.kernels import exact, linear_bf16
from adaptive_spec.options import CoreSettings


def _cpu_flag(flag: str) -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and flag in cpuinfo.read_text().split()


@pytest.fixture(scope="module", params=["avx512", "amx"])
def kernel(request, extensions_dir):
    if not _cpu_flag("avx512_bf16"):
        pytest.skip("this CPU has no AVX512-BF16: the kernel does not serve here")
    built = linear_bf16.load(extensions_dir)
    assert built is not None, "the kernel did not build on a CPU with AVX512-BF16: is g++ installed?"
    if request.param == "amx":
        if not _cpu_flag("amx_bf16"):
            pytest.skip("this CPU has no AMX-BF16: the kernel's products stay on AVX512-BF16")
        assert linear_bf16.set_amx(True), "AMX-BF16 in /proc/cpuinfo, but the kernel could not take the tiles"
    else:
        assert not linear_bf16.set_amx(False)
    yield built
    linear_bf16.set_amx(CoreSettings.from_env().cpu_amx)  # as the process's other tests expect it


def operands(m, k, n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(n, k, generator=generator) * 0.05).to(torch.bfloat16)
    bias = torch.randn(n, generator=generator).to(torch.bfloat16)
    return x, weight, bias


# the default model's shapes, and sizes that leave tails: k not a multiple of 32 (AMX leaves those to
# AVX512-BF16), n not of 4 or 16 (AMX pads the last weight rows to a tile)
SHAPES = [(576, 576), (576, 1536), (1536, 576), (50, 37), (33, 130), (576, 37), (576, 21), (576, 48)]


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_computes_the_product(kernel, k, n, with_bias) -> None:
    x, weight, bias = operands(9, k, n)
    bias = bias if with_bias else None
    out = kernel(x, weight, bias)
    assert out.shape == (9, n) and out.dtype == torch.bfloat16
    expected = linear_bf16.reference(x, weight, bias).float()
    # bf16 output: one rounding of a value up to ~|10| (an ulp is 2^-4 there), plus fp32 sums in another order
    torch.testing.assert_close(out.float(), expected, atol=0.07, rtol=0.01)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k,n", SHAPES)
def test_a_rows_output_does_not_depend_on_what_shares_the_call(kernel, k, n, threads) -> None:
    x, weight, bias = operands(40, k, n, seed=1)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = kernel(x, weight, bias)
        for row in (0, 3, 17, 39):
            assert torch.equal(kernel(x[row : row + 1], weight, bias)[0], together[row]), row
        assert torch.equal(kernel(x[5:22], weight, bias), together[5:22])  # a block of 8 starts elsewhere
        for rows in range(1, 40):  # every row count: 4, 8, 16 and 32 rows start other blockings or tiles
            assert torch.equal(kernel(x[40 - rows :], weight, bias), together[40 - rows :]), rows
        assert torch.equal(kernel(x.flip(0), weight, bias).flip(0), together)
        torch.set_num_threads(3 - threads)  # and the other thread count splits the outputs otherwise
        assert torch.equal(kernel(x, weight, bias), together)
    finally:
        torch.set_num_threads(before)


def _counting(kernel):
    """(calls, the kernel that appends each call's row count to calls): which products took the kernel."""
    calls: list[int] = []

    def counted(x, weight, bias):
        calls.append(x.shape[0])
        return kernel(x, weight, bias)

    return calls, counted


def test_the_compiled_steps_linears_take_the_kernel(kernel) -> None:
    """exact.linear routes a bf16 product to the operator while a step is being compiled, and only then."""
    calls, counted = _counting(kernel)
    saved = exact.COMPILED_LINEAR[0]
    exact.COMPILED_LINEAR[0] = counted
    try:
        x, weight, _ = operands(2, 576, 49152)  # an LM head
        step = torch.compile(lambda x, weight: exact.linear(x, weight), dynamic=True, backend="eager")
        with torch.inference_mode():
            eager = exact.linear(x[None], weight)[0]
            assert torch.equal(eager, torch.nn.functional.linear(x, weight))  # eager: PyTorch's product
            assert calls == []
            assert torch.equal(step(x[None], weight)[0], kernel(x, weight, None))
            assert calls == [2]  # (on AVX512-BF16 the two round 14 of these outputs apart; on AMX none)
    finally:
        exact.COMPILED_LINEAR[0] = saved


class _Model(torch.nn.Module):
    """One linear, and the config exact.install reads."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.config = SimpleNamespace(_attn_implementation=None)
        self.linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
        self.linear.weight.data.copy_(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def test_a_drafts_vocabulary_takes_the_kernel_for_few_rows(kernel) -> None:
    """DraftVocab.logits (the draft's LM head, whole or restricted to an adapter's tokens) takes the kernel for a
    draft's few rows, not PyTorch's product (twice as slow for one row on an Intel Xeon without AMX)."""
    from adaptive_spec.drafters.vocab import DraftVocab

    calls, counted = _counting(kernel)
    saved = exact.COMPILED_LINEAR[0]
    exact.COMPILED_LINEAR[0] = counted
    try:
        _, weight, _ = operands(1, 576, 4099)
        head = _Model(weight)
        exact.install(head)  # the target's LM head, as a draft shares it
        vocab = DraftVocab(head.linear)
        few = torch.randn(2, 3, 576).to(torch.bfloat16)  # a depth of draft trees: [n, width, hidden]
        many = torch.randn(exact.DRAFT_KERNEL_MAX_ROWS + 1, 576).to(torch.bfloat16)
        with torch.inference_mode():
            assert torch.equal(vocab.logits(few), kernel(few.reshape(6, 576), weight, None).reshape(2, 3, 4099))
            assert calls == [6]
            assert torch.equal(vocab.logits(many), torch.nn.functional.linear(many, weight))  # PyTorch's product
            assert calls == [6]
            vocab.restrict([5, 17, 4098, 300])
            rows = weight[[5, 17, 300, 4098]]
            assert torch.equal(vocab.logits(few[0]), kernel(few[0], rows, None))
            assert calls == [6, 3]
    finally:
        exact.COMPILED_LINEAR[0] = saved


def test_a_drafts_own_linears_take_the_kernel_eagerly_and_the_targets_do_not(kernel) -> None:
    """exact.draft_products marks a draft's own modules: their few-row eager products take the kernel (a draft
    need not be invariant), while a module it does not mark keeps PyTorch's product outside a compiled step."""
    calls, counted = _counting(kernel)
    saved = exact.COMPILED_LINEAR[0]
    exact.COMPILED_LINEAR[0] = counted
    try:
        x, weight, _ = operands(2, 576, 49152)
        draft, target = (_Model(weight) for _ in range(2))
        for model in (draft, target):
            exact.install(model)
        exact.draft_products(draft)
        with torch.inference_mode():
            assert torch.equal(draft(x), kernel(x, weight, None))
            assert calls == [2]
            assert torch.equal(target(x), torch.nn.functional.linear(x, weight))
            assert calls == [2]
            many = torch.randn(exact.DRAFT_KERNEL_MAX_ROWS + 1, 576).to(torch.bfloat16)
            assert torch.equal(draft(many), torch.nn.functional.linear(many, weight))  # a prompt's catch-up
            assert calls == [2]
    finally:
        exact.COMPILED_LINEAR[0] = saved


def test_amx_and_avx512_products_agree_to_rounding_and_differ_only_there(extensions_dir) -> None:
    """On a CPU with AMX-BF16: the two ways of the kernel sum in other orders, so a few outputs differ in their
    last bit, never more; a weight whose k is not a multiple of 32 takes AVX512-BF16 either way (bitwise)."""
    if not (_cpu_flag("avx512_bf16") and _cpu_flag("amx_bf16")):
        pytest.skip("this CPU has no AMX-BF16")
    built = linear_bf16.load(extensions_dir)
    assert built is not None
    x, weight, bias = operands(24, 576, 1536, seed=2)
    odd_x, odd_weight, _ = operands(24, 50, 37, seed=3)
    try:
        assert linear_bf16.set_amx(True) and linear_bf16.uses_amx()
        amx, amx_odd = built(x, weight, bias), built(odd_x, odd_weight, None)
        assert not linear_bf16.set_amx(False) and not linear_bf16.uses_amx()
        avx, avx_odd = built(x, weight, bias), built(odd_x, odd_weight, None)
    finally:
        linear_bf16.set_amx(CoreSettings.from_env().cpu_amx)
    assert torch.equal(amx_odd, avx_odd)
    differ = amx != avx
    assert 0 < int(differ.sum()) < amx.numel() // 20  # other sums, so some outputs round apart, and few
    ulp = torch.finfo(torch.bfloat16).eps * avx.float().abs().clamp(min=1e-3)
    assert bool(((amx.float() - avx.float()).abs() <= ulp * 1.01)[differ].all())
