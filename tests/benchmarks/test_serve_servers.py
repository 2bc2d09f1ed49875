"""How `bench-serve` and `bench-drift --scenario` set up their servers (benchmarks/serve.py `served`), without
starting one: the quick part of what tests/benchmarks/test_bench_serve.py runs end to end (a slow test)."""

from __future__ import annotations

from benchmarks.serve import share_caches


def test_a_benchmarks_servers_share_the_compiled_code_and_models(tmp_path) -> None:
    """Each server of a run has a data directory of its own (its Redis, adapters, log) but takes the
    compiled step and the converted model from the invoker's, instead of compiling for minutes again."""
    shared, server = tmp_path / "main", tmp_path / "run" / "batched_speculative"
    (shared / "compile").mkdir(parents=True)
    (shared / "compile" / "step.so").write_text("compiled")
    server.mkdir(parents=True)
    share_caches(server, shared)
    assert (server / "compile" / "step.so").read_text() == "compiled"
    (server / "models" / "converted").write_text("weights")  # written through the link, kept for the next run
    assert (shared / "models" / "converted").read_text() == "weights"
    share_caches(server, shared)  # again: links already there are left as they are
    assert (server / "compile").resolve() == (shared / "compile").resolve()
