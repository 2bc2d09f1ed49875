"""`adaptive-spec purge`: delete every piece of user-derived data the deployment keeps, after a confirmation.

    adaptive-spec purge                          # lists what it will delete, then asks
    adaptive-spec purge --yes                    # for scripts: no question
    REDIS_URL=redis://:pw@host:6379/0 adaptive-spec purge --data-dir /srv/adaptive-spec --registry --yes

What is user-derived (RELIABILITY.md "Where data lives" lists each with its retention):

- in Redis (REDIS_URL): the correction stream `adaptive_spec:corrections` with its consumer group (prompts,
  outputs, the target's top-m), the dashboard's buckets and markers `adaptive_spec:stats:*` (counts by
  domain tag), the trainer's status; then an append-only file, if Redis keeps one, is rewritten so that the
  deleted entries leave the disk too;
- in the data directory: the trainer's checkpoints (`trainer/`: replay buffers and held-out records, raw
  prompt and output ids), its version directories (`adapters/`: each holds the n-gram index and vocabulary
  of the traffic it was trained on), a server's downloaded versions (`adapter-cache/`) and the queue of
  registrations (`registry-pending.json`);
- with `--registry`: every version of the registered model in MLflow and its run (their artifacts hold the
  same n-gram indexes and vocabularies). Servers then serve the base draft. MLflow only marks runs deleted:
  `mlflow gc --backend-store-uri URI` removes their artifacts for good.

Stop the trainer first: a running one keeps its buffers in memory and writes them back at its next
checkpoint. Servers need no stop (their queued records are seconds of traffic).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from adaptive_spec.contracts import (
    ADAPTER_CACHE_DIR,
    ADAPTERS_DIR,
    CHECKPOINT_DIR,
    CORRECTION_STREAM,
    MODEL_NAME,
    PENDING_FILE,
    REDIS_URL_ENV,
    STATS_PREFIX,
    TRAINER_LEADER_KEY,
    TRAINER_STATUS_KEY,
    redact_url,
)
from cli.options import CommandError

LOCAL = (CHECKPOINT_DIR, ADAPTERS_DIR, ADAPTER_CACHE_DIR, PENDING_FILE)  # under the data directory


def add_commands(commands) -> None:
    purge = commands.add_parser(
        "purge",
        help="delete every piece of user-derived data: stream, buffers, checkpoints, n-gram and vocabulary files",
        description="Delete the correction stream and the dashboard's figures in Redis (REDIS_URL or --redis-url), "
        "and the trainer's checkpoints, version directories and a server's downloaded versions in the data "
        "directory; with --registry also every registered version in MLflow. Lists what it deletes and asks "
        "first. See cli/purge.py.",
    )
    purge.add_argument(
        "--data-dir", type=Path, default=None, help="default: $ADAPTIVE_SPEC_DATA_DIR or ./.adaptive-spec"
    )
    purge.add_argument("--redis-url", default=None, help="default: $REDIS_URL (none: Redis is left alone)")
    purge.add_argument(
        "--registry", action="store_true", help="also delete every version of the registered model (and its run)"
    )
    purge.add_argument("--registered-model", default=MODEL_NAME, help="default: %(default)s")
    purge.add_argument("--yes", action="store_true", help="do not ask (for scripts)")
    purge.set_defaults(func=cmd_purge)


def cmd_purge(args) -> int:
    from adaptive_spec.models import data_dir as default_data_dir

    data_dir = Path(args.data_dir or default_data_dir())
    redis_url = args.redis_url or os.environ.get(REDIS_URL_ENV)
    client = _redis(redis_url) if redis_url else None
    keys = _redis_keys(client) if client is not None else []
    paths = [data_dir / name for name in LOCAL if (data_dir / name).exists()]
    registry = _registry(data_dir, args.registered_model) if args.registry else None
    versions = [v.version for v in registry.versions()] if registry is not None else []

    print("adaptive-spec purge will delete:")
    where = redact_url(redis_url) if redis_url else "no REDIS_URL: left alone"
    print(
        f"  Redis ({where}): {len(keys)} keys" + (f" ({', '.join(k.decode() for k in keys[:4])}, ...)" if keys else "")
    )
    for path in paths:
        print(f"  {path} ({_size(path) / 1e6:.1f} MB)")
    if registry is not None:
        print(f"  MLflow ({registry!r}): {len(versions)} versions of {registry.model_name} and their runs")
    if not keys and not paths and not versions:
        print("nothing to delete")
        return 0
    if client is not None and client.exists(TRAINER_LEADER_KEY):
        print(f"  note: a trainer holds {TRAINER_LEADER_KEY}: stop it first, or it writes its buffers back")
    if not args.yes and not _confirmed():
        print("nothing deleted")
        return 1
    if client is not None and keys:
        client.delete(*keys)
        if client.config_get("appendonly").get("appendonly") == "yes":
            client.bgrewriteaof()  # the deleted entries leave the append-only file too
    for path in paths:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    if registry is not None:
        for version in versions:
            registry.delete_version(version)
    print(f"deleted {len(keys)} Redis keys, {len(paths)} paths, {len(versions)} registered versions")
    return 0


def _redis(url: str):
    import redis

    client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=10)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise CommandError(f"cannot reach Redis at {redact_url(url)}: {exc}") from None
    return client


def _redis_keys(client) -> list[bytes]:
    keys = [key for key in (CORRECTION_STREAM, TRAINER_STATUS_KEY) if client.exists(key)]
    keys += list(client.scan_iter(match=STATS_PREFIX + "*", count=1000))
    return [key.encode() if isinstance(key, str) else key for key in keys]


def _registry(data_dir: Path, model_name: str):
    from registry.client import AdapterRegistry

    return AdapterRegistry(data_dir=data_dir, model_name=model_name)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def _confirmed() -> bool:
    if not sys.stdin.isatty():
        print("not a terminal: pass --yes to purge without a question", file=sys.stderr)
        return False
    return input("type 'purge' to delete all of it: ").strip() == "purge"
