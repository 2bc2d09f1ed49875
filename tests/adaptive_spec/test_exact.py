"""Batch-invariant forwards in reduced precision (`adaptive_spec.kernels.exact`), on tiny random models.

Run: .venv/bin/python -m pytest tests/adaptive_spec/test_exact.py -q   (CPU, about a minute)

What must hold:

- the blocked attention computes what SDPA computes (to rounding), and its output for a query does
  not change, bitwise, when keys are added past what the query may see, or when other rows and
  query positions share the product;
- `exact.check` passes on a bf16 model with the invariant kernels installed, and fails, naming the
  shape, when something in the forward depends on the number of rows;
- in bf16, with near-ties everywhere (initializer range 0.02: the two best logits often differ by
  less than bf16's rounding), greedy speculative output and batched output equal the bf16 target
  alone, token for token, row by row, for every draft kind, fixed and dynamic k.

The same on the default model is in test_real_model.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import llama
from torch import nn

from adaptive_spec import Engine
from adaptive_spec.kernels import exact

pytestmark = pytest.mark.usefixtures("one_thread")

BF16 = torch.bfloat16


def bf16_target(seed: int = 0) -> nn.Module:
    """A tiny Llama in bf16 with Llama's own initializer range: logits close enough for bf16 rounding
    to decide between the two best tokens."""
    return llama(seed, init=0.02).to(BF16)


def reference_attention(query, key, value, mask, scaling):
    """SDPA over repeated KV heads in fp32, the textbook formula."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1).float()
    value = value.repeat_interleave(groups, dim=1).float()
    out = F.scaled_dot_product_attention(query.float(), key, value, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2)  # [n, q, heads, d]


class _Module:
    num_key_value_groups = 3


# =================================================================================================
# The kernels
# =================================================================================================


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("q_len,kv_len", [(1, 7), (5, 130), (17, 300), (3, 256)])
def test_blocked_attention_computes_sdpa(dtype, q_len: int, kv_len: int) -> None:
    torch.manual_seed(0)
    n, heads, kv_heads, d = 2, 9, 3, 16
    query = torch.randn(n, heads, q_len, d).to(dtype)
    key = torch.randn(n, kv_heads, kv_len, d).to(dtype)
    value = torch.randn(n, kv_heads, kv_len, d).to(dtype)
    # row 0 sees everything up to its own position; row 1 sees only the first third (a shorter context)
    positions = torch.tensor([[kv_len - q_len + i for i in range(q_len)], [kv_len // 3 + i for i in range(q_len)]])
    mask = (torch.arange(kv_len)[None, None, :] <= positions[:, :, None])[:, None]  # [n, 1, q, kv_len]
    out, _ = exact.attention(_Module(), query, key, value, mask, scaling=d**-0.5)
    expected = reference_attention(query, key, value, mask, d**-0.5)
    assert out.dtype == dtype and out.shape == (n, q_len, heads, d)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_a_querys_attention_is_bitwise_the_same_whatever_shares_the_product() -> None:
    """The same query and visible keys: alone over 7 keys, as the 3rd of 5 queries over 300 keys of
    which it may see 7, and as row 1 of a batch whose row 0 sees 300 keys."""
    torch.manual_seed(1)
    heads, kv_heads, d = 4, 2, 16
    q = torch.randn(1, heads, 1, d).to(BF16)
    k = torch.randn(1, kv_heads, 300, d).to(BF16)
    v = torch.randn(1, kv_heads, 300, d).to(BF16)
    module = type("M", (), {"num_key_value_groups": 2})()

    def visible(n_queries, kv_len, seen):
        return (torch.arange(kv_len)[None, :] < seen)[None, None].expand(1, 1, n_queries, kv_len).clone()

    alone, _ = exact.attention(module, q, k[:, :, :7], v[:, :, :7], visible(1, 7, 7), scaling=0.25)
    queries = torch.cat([torch.randn(1, heads, 2, d).to(BF16), q, torch.randn(1, heads, 2, d).to(BF16)], dim=2)
    mask = visible(5, 300, 7)
    mask[0, 0, [0, 1, 3, 4]] = True  # the other queries see everything
    verify, _ = exact.attention(module, queries, k, v, mask, scaling=0.25)
    assert torch.equal(verify[0, 2], alone[0, 0])

    other = torch.randn(1, heads, 1, d).to(BF16)
    batch_mask = torch.cat([torch.ones(1, 1, 1, 300, dtype=torch.bool), visible(1, 300, 7)])
    batched, _ = exact.attention(
        module, torch.cat([other, q]), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), batch_mask, scaling=0.25
    )
    assert torch.equal(batched[1, 0], alone[0, 0])


@pytest.mark.parametrize("row_chunk", [None, 4])
def test_invariant_linear_rows_do_not_depend_on_the_others(row_chunk) -> None:
    torch.manual_seed(2)
    weight, bias = torch.randn(96, 200).to(BF16), torch.randn(96).to(BF16)
    x = torch.randn(11, 200).to(BF16)
    with torch.inference_mode():
        alone = torch.stack([exact.linear(x[i : i + 1], weight, bias, row_chunk)[0] for i in range(11)])
        together = exact.linear(x, weight, bias, row_chunk)
        three_d = exact.linear(x.reshape(1, 11, 200), weight, bias, row_chunk)[0]
    assert torch.equal(together, alone) and torch.equal(three_d, alone)
    torch.testing.assert_close(together.float(), F.linear(x.float(), weight.float(), bias.float()), atol=0.1, rtol=0.02)


# =================================================================================================
# The check
# =================================================================================================


def test_check_passes_with_the_invariant_kernels_on_a_bf16_model() -> None:
    model = bf16_target()
    report = exact.make_exact(model)
    assert report.exact, report.summary()
    assert report.compared >= 40 and report.differing == 0 and report.dtype == "bfloat16"


def test_check_fails_and_names_the_shape_when_a_kernel_depends_on_the_row_count(monkeypatch) -> None:
    """A linear whose result moves by one bf16 step when more than one row shares it: what a kernel
    switch does. The check must see it, and the engine must not claim exactness."""
    model = bf16_target()
    exact.install(model)
    real = exact.linear

    def row_count_dependent(x, weight, bias=None, row_chunk=None):
        out = real(x, weight, bias, row_chunk)
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        return out if rows == 1 else out * (1 + 2**-7)

    monkeypatch.setattr(exact, "linear", row_count_dependent)
    report = exact.check(model)
    assert not report.exact and report.differing > 0
    assert any("verify" in case or "rows" in case for case in report.cases)
    assert "NOT batch-invariant" in report.summary()
    engine = Engine(bf16_target(), None)
    assert not engine.exactness.exact  # make_exact tried row chunks too, and still saw it


def test_a_second_engine_over_the_same_target_reuses_the_measurement_unless_a_kernel_changed(monkeypatch) -> None:
    """The check takes seconds on a real model: a second engine over the same target (another draft)
    reuses the first one's report. A product changed in between (here: row-count dependent) is
    measured again, and seen."""
    model = bf16_target()
    first = Engine(model, None)
    checks = []
    real_check = exact.check
    monkeypatch.setattr(exact, "check", lambda *args, **kwargs: checks.append(1) or real_check(*args, **kwargs))
    second = Engine(model, "early-exit:1")
    assert checks == [] and second.exactness == first.exactness and second.exactness is not first.exactness
    assert second.prefix_cache is not None  # the report's prefix_reuse came along
    real_linear = exact.linear

    def row_count_dependent(x, weight, bias=None, row_chunk=None):
        out = real_linear(x, weight, bias, row_chunk)
        return out if x.reshape(-1, x.shape[-1]).shape[0] == 1 else out * (1 + 2**-7)

    monkeypatch.setattr(exact, "linear", row_count_dependent)
    third = Engine(model, None)
    assert len(checks) == 2 and not third.exactness.exact  # measured again, with and without row chunks


# =================================================================================================
# Greedy equality in bf16, row by row
# =================================================================================================

PROMPTS = [
    [5, 17, 33, 8, 5, 17, 33, 8, 5, 17],
    [44],
    [3, 9, 27, 81, 3, 9],
    list(range(20, 43)),
    [7, 7, 7, 7, 2],
    [90, 12, 64, 90, 12],
]
BUDGETS = [24, 9, 31, 16, 5, 27]


def _alone(model) -> list[list[int]]:
    engine = Engine(model, None)
    return [
        engine.generate(p, max_new_tokens=b, speculative=False).token_ids for p, b in zip(PROMPTS, BUDGETS, strict=True)
    ]


@pytest.mark.parametrize("kind", ["early-exit:1", "early-exit:3", "head", "ngram", "ngram+head", "separate-model"])
def test_bf16_greedy_speculative_and_batched_rows_equal_the_target_alone(kind: str) -> None:
    model = bf16_target()
    baseline = _alone(model)
    draft = llama(100, layers=1, init=0.02).to(BF16) if kind == "separate-model" else kind
    engine = Engine(model, draft)
    assert engine.exactness.exact, engine.exactness.summary()
    drafted = 0
    for k in (1, 3, None):
        one_at_a_time = [engine.generate(p, max_new_tokens=b, k=k) for p, b in zip(PROMPTS, BUDGETS, strict=True)]
        batch = engine.new_batch(4)
        outputs: dict[int, list[int]] = {}
        pending = list(range(len(PROMPTS)))
        rows = {}
        while pending or len(batch):
            while pending and not batch.full:  # rows join as others leave: staggered, padded
                i = pending.pop(0)
                rows[batch.add(engine.request(PROMPTS[i], max_new_tokens=BUDGETS[i], k=k))] = i
            for row, chunk in batch.step():
                if chunk.output is not None:
                    outputs[rows.pop(row)] = chunk.output.token_ids
                    drafted += chunk.output.stats.drafted
        for i, expected in enumerate(baseline):
            assert one_at_a_time[i].token_ids == expected, f"k={k} prompt {i} alone"
            assert outputs[i] == expected, f"k={k} prompt {i} in a batch of 4"
        drafted += sum(out.stats.drafted for out in one_at_a_time)
    assert drafted > 0, "nothing was drafted: nothing speculative was tested"


def test_bf16_near_ties_are_real_here() -> None:
    """The equality above means something only if bf16 rounding can flip these models' greedy
    choices: with the stock kernels (no invariance), some position's logits differ between a plain
    step and a verify."""
    from adaptive_spec.kernels import attention

    model = bf16_target()
    attention.use(model)
    report = exact.check(model)
    assert not report.exact, "the stock kernels happen to be invariant on this tiny model: the test above proves less"
