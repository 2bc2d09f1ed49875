"""`adaptive-spec train`: the online trainer alone, as a long-lived process (`adaptive-spec up` runs it as
a child).

    REDIS_URL=redis://127.0.0.1:6379/0 adaptive-spec train                 # defaults: the built-in model, the head draft
    adaptive-spec train --redis-url redis://127.0.0.1:6379/0 --data-dir ./.adaptive-spec --threads 1
    # small CPU variant (a local tiny model directory, promotes after a few dozen records):
    adaptive-spec train --target ./tiny --draft early-exit:1 --gate-min-positions 200 --min-new-records 8

It reads correction records from `adaptive_spec:corrections` (consumer group, at-least-once), trains
the draft's LoRA adapter, and every adapter its gate accepts is written to `<data-dir>/adapters/vNNNN`
and registered and promoted in MLflow (registry/client.py: `MLFLOW_TRACKING_URI`, else
`<data-dir>/mlflow.db`). Checkpoints go to `<data-dir>/trainer`; a restarted trainer resumes from
the last one and re-reads what it had not acknowledged.

An operator's rollback or promotion (CLI, admin API, or the alias moved in the MLflow UI) is
followed: before each round and each promotion the trainer reads the `champion` alias and, when it
moved, adopts that version (downloaded, checksum verified) as the adapter it trains from and gates
against, so it never promotes over a rollback without beating the rolled-back-to version.

One trainer per stream: a second `adaptive-spec train` on the same Redis waits as a standby, and says
so in its log, until the leader's lease in Redis expires or is released (trainer/process/leader.py).

SIGTERM or SIGINT: the round under way finishes, a last checkpoint is written, the registration queue
gets one more try, and the process exits 0. MLflow down: training goes on; promoted adapters wait in
`<data-dir>/registry-pending.json` and are registered when MLflow answers again (also after a restart).
Redis is never started here: without REDIS_URL or --redis-url the command fails at once.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from pathlib import Path

from adaptive_spec.contracts import ADAPTERS_DIR, PENDING_FILE, SIGNING_KEY_ENV, redact_url
from trainer.settings import TrainerSettings

log = logging.getLogger(__name__)


class TrainerSetupError(ValueError):
    """The trainer cannot start (no Redis configured or reachable, a draft that takes no adapter) or go on
    (another trainer took its lease)."""


def run_trainer(settings: TrainerSettings, stop: threading.Event | None = None) -> dict:
    """Load the models, train until `stop` (or SIGTERM/SIGINT in the main thread); returns the counters."""
    import redis
    import torch

    from adaptive_spec.drafters.spec import parse_draft_spec
    from registry.client import AdapterRegistry
    from trainer.intake.stream import CorrectionStream, stream_client
    from trainer.process.build import build_trainer, load_draft
    from trainer.process.leader import TrainerLease, holder_id
    from trainer.promotion.champion import RegistryChampion
    from trainer.promotion.pending import PendingRegistrations

    if not settings.redis_url:
        raise TrainerSetupError(
            "the trainer reads correction records from Redis: set REDIS_URL or pass --redis-url "
            "(`adaptive-spec up` starts one for you)"
        )
    if settings.threads:
        torch.set_num_threads(settings.threads)
    client = stream_client(settings.redis_url)
    try:
        client.ping()
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise TrainerSetupError(f"cannot reach Redis at {redact_url(settings.redis_url)}: {exc}") from None
    spec = parse_draft_spec(settings.draft)
    if not spec.trainable:
        raise TrainerSetupError(f"the {spec} draft has no weights to train; use early-exit:N, head or a draft model")
    draft_model, _ = load_draft(settings)

    data_dir = Path(settings.data_dir)
    consumer = settings.consumer or f"trainer-{socket.gethostname()}"
    stop = stop or threading.Event()
    restore = _stop_on_signals(stop)
    lease = TrainerLease(settings.redis_url, holder_id(consumer), settings.lease_ttl_s)
    if not lease.acquire(stop):  # standby until the leader's lease is free; stopped meanwhile
        restore()
        lease.release()
        client.close()
        return {"leader": False}
    lease.keep(on_lost=stop.set)  # another trainer took it: stop like on SIGTERM
    registry = AdapterRegistry(
        settings.tracking_uri, data_dir=data_dir, redis_url=settings.redis_url, signing_key=settings.signing_key
    )
    if not settings.signing_key:
        log.warning(
            "%s is not set: versions are registered unsigned, and servers cannot tell them from forged ones",
            SIGNING_KEY_ENV,
        )
    pending = PendingRegistrations(
        registry,
        data_dir / PENDING_FILE,
        by=f"trainer:{consumer}",
        retry_s=settings.retry_s,
        versions_dir=data_dir / ADAPTERS_DIR,
        keep_versions=settings.keep_versions,
    ).start()
    stream = CorrectionStream(client, consumer=consumer)
    trainer = build_trainer(
        settings,
        draft_model,
        stream,
        on_promote=lease.fenced(pending.submit),
        champion_source=RegistryChampion(registry, pending),
    )
    lease.follow(lambda: trainer.progressed_at, settings.lease_stall_s)  # a hung main loop lets it lapse
    log.info("trainer %s: data in %s, registry %r", consumer, data_dir, registry)
    try:
        counters = trainer.run(stop, budget_s=settings.budget_s, checkpoint_every_s=settings.checkpoint_every_s)
    finally:
        restore()
        left = pending.stop(timeout=15.0)
        lease.release()
        registry.close()
        client.close()
    if lease.lost_to is not None:
        raise TrainerSetupError(
            f"another trainer ({lease.lost_to}) took the lease; this one stopped so that only one trainer "
            "promotes. Restarted, it waits as a standby."
        )
    counters["registrations_pending"] = left
    counters["registered_versions"] = pending.registered
    counters["leader"] = True
    log.info("trainer stopped: %s", counters)
    return counters


def _stop_on_signals(stop: threading.Event):
    """SIGTERM and SIGINT set `stop` (main thread only); returns a function that restores the old handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        log.info("%s: finishing the current round, checkpointing, then exiting", signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    return lambda: [signal.signal(sig, old) for sig, old in previous.items()]
