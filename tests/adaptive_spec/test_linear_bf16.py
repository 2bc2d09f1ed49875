"""The C++ bf16 product of the compiled step (`adaptive_spec.linear_bf16`).

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_linear_bf16.py -q   (builds it once: ~20 s)

What must hold: it computes x @ weight.T (+ bias) to bf16 rounding, and a row's output is bitwise the
same alone, in any batch, at any place in it, and however the threads split the outputs. On a CPU
without AVX512-BF16 the kernel does not serve (load gives None) and these tests are skipped as such.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from adaptive_spec import exact, linear_bf16


def _has_bf16_instructions() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and "avx512_bf16" in cpuinfo.read_text()


@pytest.fixture(scope="module")
def kernel(extensions_dir):
    if not _has_bf16_instructions():
        pytest.skip("this CPU has no AVX512-BF16: the kernel does not serve here")
    built = linear_bf16.load(extensions_dir)
    assert built is not None, "the kernel did not build on a CPU with AVX512-BF16: is g++ installed?"
    return built


def operands(m, k, n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(n, k, generator=generator) * 0.05).to(torch.bfloat16)
    bias = torch.randn(n, generator=generator).to(torch.bfloat16)
    return x, weight, bias


# the default model's shapes, and sizes that leave tails: k not a multiple of 32, n not of 4
SHAPES = [(576, 576), (576, 1536), (1536, 576), (50, 37), (33, 130)]


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
        for rows in range(1, 40):  # every row count: up to 4 rows and more take different blockings
            assert torch.equal(kernel(x[40 - rows :], weight, bias), together[40 - rows :]), rows
        assert torch.equal(kernel(x.flip(0), weight, bias).flip(0), together)
    finally:
        torch.set_num_threads(before)


def test_the_compiled_steps_linears_take_the_kernel(kernel) -> None:
    """exact.linear routes a bf16 product to the operator while a step is being compiled, and only then."""
    saved = exact.COMPILED_LINEAR[0]
    exact.COMPILED_LINEAR[0] = kernel
    try:
        x, weight, _ = operands(2, 576, 49152)  # an LM head: PyTorch and the kernel round 14 outputs apart
        step = torch.compile(lambda x, weight: exact.linear(x, weight), dynamic=True, backend="eager")
        with torch.inference_mode():
            eager = exact.linear(x[None], weight)[0]
            assert torch.equal(eager, torch.nn.functional.linear(x, weight))  # eager: PyTorch's product
            assert torch.equal(step(x[None], weight)[0], kernel(x, weight, None))
            assert not torch.equal(eager, kernel(x, weight, None))  # so the two checks above tell them apart
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

    calls = []

    def counted(x, weight, bias):
        calls.append(x.shape[0])
        return kernel(x, weight, bias)

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
    saved = exact.COMPILED_LINEAR[0]
    exact.COMPILED_LINEAR[0] = kernel
    try:
        x, weight, _ = operands(2, 576, 49152)
        draft, target = (_Model(weight) for _ in range(2))
        for model in (draft, target):
            exact.install(model)
        exact.draft_products(draft)
        with torch.inference_mode():
            assert torch.equal(draft(x), kernel(x, weight, None))
            assert torch.equal(target(x), torch.nn.functional.linear(x, weight))
            assert not torch.equal(draft(x), target(x))
            many = torch.randn(exact.DRAFT_KERNEL_MAX_ROWS + 1, 576).to(torch.bfloat16)
            assert torch.equal(draft(many), torch.nn.functional.linear(many, weight))  # a prompt's catch-up
    finally:
        exact.COMPILED_LINEAR[0] = saved
