"""cpu_linear: the same products as nn.Linear, computed in the order that is fast for skinny inputs."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from adaptive_spec.kernels import cpu_linear


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 9, 16, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_equals_linear(rows, bias):
    torch.manual_seed(rows)
    layer = nn.Linear(48, 80, bias=bias)
    x = torch.randn(1, rows, 48)
    with torch.inference_mode():
        got = cpu_linear.skinny_linear(x, layer.weight, layer.bias)
        want = F.linear(x, layer.weight, layer.bias)
    assert got.shape == want.shape == (1, rows, 80)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_wrong_product_would_be_caught():
    # Negative control for the tolerance above: transposing the weight's role changes the result.
    torch.manual_seed(0)
    w, x = torch.randn(48, 48), torch.randn(1, 3, 48)
    with torch.inference_mode():
        assert not torch.allclose(cpu_linear.skinny_linear(x, w), F.linear(x, w.T), atol=1e-3)


def test_install_routes_fp32_cpu_linears_and_survives_deepcopy():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    spare = nn.Linear(4, 4).double()
    assert cpu_linear.install(nn.ModuleList([model, spare])) == 2  # the fp64 layer keeps the stock path
    assert "forward" not in vars(spare)
    assert cpu_linear.install(model) == 2  # idempotent
    copied = copy.deepcopy(model)
    assert copied[0].forward.__self__ is copied[0]  # bound to the copy, not to the original
    x = torch.randn(2, 8)
    with torch.inference_mode():
        torch.testing.assert_close(copied(x), model(x))


def test_gradients_take_the_stock_path():
    layer = nn.Linear(8, 4)
    cpu_linear.install(layer)
    x = torch.randn(3, 8, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("ADAPTIVE_SPEC_CPU_LINEAR", "0")
    layer = nn.Linear(8, 4)
    assert not cpu_linear.applies(layer.weight)
    assert cpu_linear.install(layer) == 0 and "forward" not in vars(layer)


def test_calibration_picks_an_order_per_row_count_and_both_orders_give_linear(monkeypatch) -> None:
    monkeypatch.setattr(cpu_linear, "_transposed", dict(cpu_linear._transposed))  # restored after the test
    monkeypatch.setattr(cpu_linear, "_calibrated", False)
    weights = [torch.randn(96, 64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    chosen = cpu_linear.calibrate(weights)
    assert set(chosen) == set(range(1, cpu_linear.MAX_ROWS + 1)) and cpu_linear._calibrated
    for rows in (1, 5, 16):  # between two measured counts, the lower one's choice
        lower = max(r for r in cpu_linear.CALIBRATE_ROWS if r <= rows)
        assert chosen[rows] == chosen[lower]
    x = torch.randn(5, 64)
    with torch.inference_mode():
        for order in (True, False):
            cpu_linear._transposed[5] = order
            assert torch.allclose(cpu_linear.skinny_linear(x, weights[0]), F.linear(x, weights[0]), atol=1e-5)


def test_a_small_model_is_not_timed_and_off_means_the_stock_path(monkeypatch) -> None:
    monkeypatch.setattr(cpu_linear, "_calibrated", False)
    calls = []
    monkeypatch.setattr(cpu_linear, "calibrate", lambda weights: calls.append(len(weights)))
    cpu_linear.install(nn.Linear(8, 8))  # far below CALIBRATE_BYTES
    assert calls == []
    monkeypatch.setenv("ADAPTIVE_SPEC_CPU_LINEAR", "0")
    assert cpu_linear.install(nn.Linear(8, 8)) == 0


def test_a_compiled_graph_takes_one_product_for_every_row_count() -> None:
    """In fp32 with the step compiled, a head's draft forward runs compiled with its linears routed here
    (engine.py installs cpu_linear on fp32 drafts): choosing the product by row count made dynamo compile a
    graph per count, at request time, until its recompile limit left the head eager. Under compile the product
    is F.linear's, one graph for every count."""
    import torch._dynamo

    weight = torch.randn(24, 16)
    linear = nn.Linear(16, 24, bias=False)
    linear.weight.data.copy_(weight)
    cpu_linear.install(linear)
    torch._dynamo.reset()
    forward = torch.compile(lambda x: linear(x), dynamic=True)
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    with torch.inference_mode():
        for rows in (2, 3, 5, 9):
            x = torch.randn(rows, 16)
            assert torch.allclose(forward(x), F.linear(x, weight), atol=1e-5)
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames + 1
