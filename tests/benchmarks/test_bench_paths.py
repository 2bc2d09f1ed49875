"""`adaptive-spec bench --compare-paths` on a tiny model: each path's engine, its figures and the
contract's `paths` keys; the command line refuses a bad list. The eager paths run in the default suite; with
the compiled path beside them (it compiles the tiny model, about a minute) the test is in the `slow` group."""

import subprocess
import sys

import pytest

from adaptive_spec.outputs.prompts import PromptItem
from benchmarks.paths import SHAPES, format_report, load_paths, parse_paths, run_paths

pytestmark = pytest.mark.usefixtures("one_thread")

PATH_KEYS = {"path", "target_tok_s", "spec_tok_s", "identical", "exact"}  # DESIGN.md's contract


def run_side_by_side(names, model_dir):
    engines = load_paths(names, str(model_dir), "head", "cpu")
    items = [PromptItem([5, 6, 7, 8]), PromptItem([9, 3, 9, 3, 9])]
    figures = run_paths(engines, items, max_new_tokens=10, k=2, progress=False)
    paths = {f["path"]: f for f in figures["paths"]}
    assert list(paths) == names
    for path, f in paths.items():
        assert set(f) >= PATH_KEYS
        assert f["identical"] is True, path  # speculative equals that path's own target alone
        assert isinstance(f["exact"], bool)
        assert set(f["forward_ms"]) == {f"{r}x{w}" for r, w in SHAPES} and all(v > 0 for v in f["forward_ms"].values())
    assert paths["fp32-eager"]["target_vs_first"] == 1.0
    assert figures["target_tok_s"] == paths["fp32-eager"]["target_tok_s"]  # the top level is the first path
    assert figures["identical"] is True and figures["hf_peer"].startswith("none")
    return figures, paths


def test_paths_side_by_side(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPTIVE_SPEC_DATA_DIR", str(tmp_path))  # nothing of a test's in the user's data directory
    figures, paths = run_side_by_side(["fp32-eager", "bf16-eager"], tiny_model_dir)
    assert paths["bf16-eager"]["exact"]  # the invariant kernels, checked
    assert not paths["bf16-eager"]["compiled"]
    assert "bf16-eager" in format_report(figures)


@pytest.mark.slow  # it compiles the tiny model (about a minute on 2 cores); the compiled step's own tests run by default
def test_the_compiled_path_side_by_side(tiny_model_dir, tmp_path, monkeypatch, kernels):
    monkeypatch.setenv("ADAPTIVE_SPEC_DATA_DIR", str(tmp_path))  # the compiled path's cache
    figures, paths = run_side_by_side(["fp32-eager", "bf16-eager", "bf16-compiled"], tiny_model_dir)
    assert paths["bf16-eager"]["exact"] and paths["bf16-compiled"]["exact"]
    assert paths["bf16-compiled"]["compiled"] and not paths["bf16-eager"]["compiled"]
    assert "bf16-compiled" in format_report(figures)


def test_a_bad_path_list_is_refused():
    for bad in ("fp16-eager", "bf16-jit", "bf16-eager,bf16-eager", ","):
        with pytest.raises(ValueError, match="distinct paths"):
            parse_paths(bad)
    result = subprocess.run(
        [sys.executable, "-m", "cli", "bench", "--compare-paths", "bf16-fast"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--compare-paths" in result.stderr


def test_the_avx512_path_switches_the_products_off_amx_and_back(extensions_dir):
    """`bf16-compiled-avx512` runs with the kernel's AVX512-BF16 products where the CPU has AMX tiles, which
    `bf16-compiled` takes: the kernel's choice belongs to the process, so each path sets it before it runs."""
    from adaptive_spec.kernels import linear_bf16
    from benchmarks.paths import products_of

    if linear_bf16.load(extensions_dir) is None or not linear_bf16.uses_amx():  # load takes the tiles where it can
        pytest.skip("no AMX-BF16 here (or ADAPTIVE_SPEC_CPU_AMX=0, or no kernel): both paths take the same products")
    assert "bf16-compiled-avx512" in parse_paths("bf16-compiled,bf16-compiled-avx512")
    with products_of("bf16-compiled-avx512"):
        assert not linear_bf16.uses_amx()
    assert linear_bf16.uses_amx()  # the process's own choice again (ADAPTIVE_SPEC_CPU_AMX on by default)
    with products_of("bf16-compiled"):
        assert linear_bf16.uses_amx()
