"""Signed versions (ADAPTIVE_SPEC_SIGNING_KEY): a version forged in MLflow is refused by every replica, and the
served adapter stays (issue 30, item 2).

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/reliability/test_signing.py -q -s   (about a minute)

Real parts: an `mlflow server`, a redis-server, two `adaptive-spec serve` replicas with the same signing key,
their watchers following the champion alias (poll 0.5 s plus the pub/sub event). The trainer's side is
`AdapterRegistry(signing_key=...)`, as `adaptive-spec train` builds it (trainer/process/main.py). The forgeries
are what anyone who can write to MLflow can register: a version with no signature; one signed with another
key; a genuine version's signature beside other weights (sealed again, so every checksum holds); and a genuine
signature over weights with a NaN (the finiteness check refuses it first, as "corrupt").

Without the check (before this change), each forged version was served by both replicas.
"""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch
from registry_support import write_adapter
from safetensors.torch import load_file, save_file
from support import ServeProcess, eventually, tiny_target

from adaptive_spec.contracts import SIGNATURE_FILE, WEIGHTS_FILE
from adaptive_spec.formats.adapters import AdapterDir
from registry.client import AdapterRegistry

pytestmark = pytest.mark.redis

KEY = "4f1d0c9a7be25e3816d0aa47c2f9b1e5"


def served(replicas) -> list[str | None]:
    return [replica.health()["adapter_version"] for replica in replicas]


def refusals(replica, reason: str) -> float:
    return replica.metric("adaptive_spec:adapter_refusals_total", reason=reason)


def test_every_replica_refuses_a_forged_version_and_keeps_serving_the_signed_one(
    mlflow_server, redis_url, tiny_model_dir, tmp_path
):
    target, model = tiny_target(0), str(tiny_model_dir)

    def adapter(name: str, seed: int):
        return write_adapter(target, 1, tmp_path / name, seed=seed, version=seed, target_id=model)

    trainer = AdapterRegistry(mlflow_server.url, data_dir=tmp_path, redis_url=redis_url, signing_key=KEY)
    forger = AdapterRegistry(mlflow_server.url, data_dir=tmp_path, redis_url=redis_url)  # MLflow access, no key
    assert trainer.register(adapter("v1", 1), by="trainer:test") == "1"
    assert (tmp_path / "v1" / SIGNATURE_FILE).is_file()

    unsigned = adapter("unsigned", 2)
    other_key = adapter("other-key", 3)
    AdapterDir(other_key).sign("an-entirely-different-key-0123")
    copied = adapter("copied", 4)
    shutil.copy(tmp_path / "v1" / SIGNATURE_FILE, copied / SIGNATURE_FILE)  # a real signature, other weights
    nan = tmp_path / "nan"
    shutil.copytree(tmp_path / "v1", nan)
    weights = load_file(str(nan / WEIGHTS_FILE))
    first = sorted(weights)[0]
    weights[first] = torch.full_like(weights[first], float("nan"))
    save_file(weights, str(nan / WEIGHTS_FILE))
    AdapterDir(nan).seal()  # every checksum holds again; the signature covers the old ones
    AdapterDir(nan).update_metadata(note="nan")  # a new sha256 tag, not version 1's

    env = {
        "MLFLOW_TRACKING_URI": mlflow_server.url,
        "REDIS_URL": redis_url,
        "ADAPTIVE_SPEC_ADAPTER_POLL_S": "0.5",
        "ADAPTIVE_SPEC_SIGNING_KEY": KEY,
    }
    replicas = [ServeProcess(tmp_path / name, tiny_model_dir, env, []) for name in ("a", "b")]
    try:
        for replica in replicas:
            (replica.workdir).mkdir(exist_ok=True)
            replica.launch()
        for replica in replicas:
            replica.wait_until(replica.ready, 180, f"/health on {replica.url}")
        eventually(lambda: served(replicas) == ["1", "1"], 30, "both replicas on the signed version 1")

        outcome = {}
        for name, path, reason in (
            ("unsigned", unsigned, "signature"),
            ("another key", other_key, "signature"),
            ("a copied signature", copied, "signature"),
            ("NaN weights, resealed", nan, "corrupt"),
        ):
            before = [refusals(replica, reason) for replica in replicas]
            version = forger.register(path, by="mlflow-writer")  # registered and promoted: champion <- forged
            eventually(
                lambda r=reason, b=before: all(refusals(x, r) > y for x, y in zip(replicas, b, strict=True)),
                30,
                f"both replicas to refuse {name}",
            )
            outcome[name] = (version, served(replicas))
            answer = httpx.post(
                replicas[0].url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4}
            )
            assert answer.status_code == 200 and answer.json()["usage"]["spec_decode"]["adapter_version"] == "1"

        genuine = adapter("v-good", 6)
        good = trainer.register(genuine, by="trainer:test")
        eventually(lambda: served(replicas) == [good, good], 30, "both replicas on the next signed version")
        logs = [replica.log() for replica in replicas]
    finally:
        for replica in replicas:
            replica.stop()

    print(f"\nforged versions and what the two replicas served after each: {outcome}; then signed {good}")
    for name, (version, now) in outcome.items():
        assert now == ["1", "1"], (name, version, now)
    for log in logs:
        assert log.count("(signature)") >= 3 and "not this deployment's signature" in log and "unsigned" in log
