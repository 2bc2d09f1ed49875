"""Shared fixtures. Redis tests use a real redis-server, never a fake.

    .venv/bin/python -m pytest tests -q      # from the repository root; helpers come from tests/helpers

`redis_url` uses $REDIS_URL when set, else starts one redis-server on a free loopback port for
the whole session. `redis_client` FLUSHDBs that database before each test, so a $REDIS_URL
given to the tests must name a disposable database. `redis_server` starts a private
redis-server that a test may stop, pause and restart on the same port (fault tests); it
always runs locally, whatever $REDIS_URL says.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from adaptive_spec.contracts import COMPILE_ENV
from adaptive_spec.formats.record import CorrectionRecord
from launch.redis import RedisNotInstalled, RedisServer, started_server
from registry.mlflow_store import exclusive

# The suite decodes eagerly, in this process and in every server it starts: compiling the default model
# takes minutes. test_compiled.py compiles a tiny model on purpose; the `compiled` group the default one.
os.environ.setdefault(COMPILE_ENV, "0")


def _share_the_cores() -> None:
    """Under pytest-xdist (pyproject's addopts run two workers), each worker and the processes it starts
    take their share of torch's threads: two workers of 2 threads each on 2 cores would make every
    OpenMP region wait for a descheduled thread."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, torch.get_num_threads() // workers)
        torch.set_num_threads(threads)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))


_share_the_cores()


@pytest.fixture(scope="session")
def extensions_dir(tmp_path_factory) -> Path:
    """One build directory for the C++ kernels (attention_cpu, linear_bf16), as a server's data directory
    keeps them: each is built once per run wherever the first test loads it. pytest-xdist's workers share
    it (their temporary directories have one parent): torch's build lock lets one build while the other waits."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "extensions"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("extensions")


def _extensions_to_ourselves(extensions_dir: Path):
    """The tests' own lock on the shared build directory: the other worker's `kernels` waits for it
    (loading the attention kernel there would remove the stale `lock` file that test_attention_cpu.py's lock
    test leaves on purpose; the kernels' own tests stay in one worker, `--dist loadfile`)."""
    return exclusive(extensions_dir / ".tests")


@pytest.fixture
def extensions_to_ourselves(extensions_dir) -> Iterator[Path]:
    with _extensions_to_ourselves(extensions_dir):
        yield extensions_dir


@pytest.fixture(scope="session")
def kernels(extensions_dir) -> Path:
    """The C++ kernels loaded in this worker from the run's one build directory, before a test compiles a
    model. A process loads each kernel from the first directory it is asked for (attention_cpu.load,
    linear_bf16.load), and `compiled.install(model, cache_dir)` asks for `cache_dir/extensions`: a worker
    whose first compiled test came before any test of the kernels built both again under a directory of its
    own (about 30 s each on this 2-core Xeon)."""
    from adaptive_spec.kernels import attention_cpu, linear_bf16

    with _extensions_to_ourselves(extensions_dir):
        attention_cpu.load(extensions_dir)
        linear_bf16.load(extensions_dir)
    return extensions_dir


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny-model tests, restored after it.

    Tiny models make thousands of small calls; on a shared 2-core machine, intra-op threads make
    each of them about 10x slower. Real-model tests keep every thread. Use it with
    `pytestmark = pytest.mark.usefixtures("one_thread")`.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _server(workdir: Path) -> RedisServer:
    try:
        return started_server(workdir)
    except RedisNotInstalled as exc:  # the suite needs a real server: fail loudly, never skip
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    with tempfile.TemporaryDirectory(prefix="adaptive-spec-redis-") as workdir:
        server = _server(Path(workdir))
        try:
            yield server.url
        finally:
            server.stop()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A started private redis-server that the test may stop(), pause() and restart() on its port."""
    server = _server(tmp_path)
    try:
        yield server
    finally:
        server.stop()


def random_record(
    seed: int = 0,
    n_out: int = 24,
    m: int = 16,
    n_prompt: int = 12,
    vocab: int = 49152,
    request_id: str | None = None,
    target_id: str = "smollm2-135m-instruct",
    draft_id: str = "early-exit:4",
) -> CorrectionRecord:
    """A consistent random record: about half the positions drafted, some of those accepted. A trainer keeps
    only records of its own target and draft (trainer/intake/screening.py)."""
    rng = np.random.default_rng(seed)
    output_ids = rng.integers(0, vocab, n_out)  # [n_out]
    drafted = rng.random(n_out) < 0.5  # [n_out]
    accepted = drafted & (rng.random(n_out) < 0.5)  # [n_out]
    proposed = np.where(accepted, output_ids, rng.integers(0, vocab, n_out))  # [n_out]
    return CorrectionRecord(
        request_id=request_id or f"req-{seed}",
        created_at=1_700_000_000.0 + seed + rng.random(),
        domain=["json", None, "code"][seed % 3],
        target_id=target_id,
        draft_id=draft_id,
        adapter_version=None if seed % 2 else str(seed),
        temperature=[0.0, 0.7, 1.0][seed % 3],
        prompt_ids=rng.integers(0, vocab, n_prompt).tolist(),
        output_ids=output_ids.tolist(),
        proposed=np.where(drafted, proposed, -1).tolist(),
        accepted=accepted.tolist(),
        target_topk_ids=rng.integers(0, vocab, (n_out, m)),  # [n_out, m]
        target_topk_logprobs=-rng.exponential(3.0, (n_out, m)),  # [n_out, m]
    )


@pytest.fixture
def make_record():
    """random_record(seed, n_out=..., m=..., ...) for tests outside this file."""
    return random_record


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The 4-layer random Llama of tests/helpers/tiny.py with the character-level chat
    tokenizer of tests/helpers/tiny_chat.py (benchmarks/tiny_model.py), saved once, for tests
    that start `adaptive-spec` processes on a local model directory."""
    from benchmarks.tiny_model import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on a free loopback port for one test module, stopped by its process
    group (launch/mlflow.py). A test may stop and start it to play an outage."""
    from registry_support import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.stop()
