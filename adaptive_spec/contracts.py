"""Names shared across processes (DESIGN.md "Names shared across processes"), each defined here once.

    from adaptive_spec.contracts import CORRECTION_STREAM, CHAMPION, champion_alias
    client.xadd(CORRECTION_STREAM, {PAYLOAD_FIELD: record.encode()})   # the server writes ...
    client.xreadgroup(TRAINER_GROUP, "trainer-1", {CORRECTION_STREAM: ">"})  # ... the trainer reads
    champion_alias()        # "champion": the general adapter
    champion_alias("sql")   # "champion-sql": one domain's adapter, named so the MLflow UI shows it

A server, a trainer, the CLI and ops scripts may run different builds on different machines; what
one writes, another reads by these names, so renaming one is a breaking change (the table in
DESIGN.md is the contract). They live in the core package because every floor above needs them
(`service` -> `trainer` -> `adaptive_spec`), and the core needs nothing from the floors above.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

# ---------------------------------------------------------------- Redis

CORRECTION_STREAM = "adaptive_spec:corrections"  # capped by MAXLEN ~; one entry per finished request
PAYLOAD_FIELD = "r"  # each correction stream entry is {PAYLOAD_FIELD: CorrectionRecord.encode()}
TRAINER_GROUP = "adaptive-spec-trainer"  # the trainers' consumer group on the correction stream
TRAINER_LEADER_KEY = "adaptive_spec:trainer_leader"  # the lease: which trainer may train and promote
TRAINER_STATUS_KEY = "adaptive_spec:trainer_status"  # JSON: what the trainer did last or waits for
ADAPTER_EVENTS = "adaptive_spec:adapters"  # pub/sub channel: one JSON event per promote and rollback
REGISTRY_LOCK_PREFIX = "adaptive_spec:registry_lock:"  # + registered model: one alias move at a time (registry/lock.py)

STATS_PREFIX = "adaptive_spec:stats:"  # the dashboard store; every replica adds into the same keys
STATS_EVENTS_KEY = STATS_PREFIX + "events"  # stream of swap and rollback markers
STATS_ADAPTERS_KEY = STATS_PREFIX + "adapters"  # hash: version -> the adapter's gate figures (JSON)


def stats_bucket_key(resolution: int, start: int) -> str:
    """The hash of one dashboard bucket: `resolution` seconds from unix time `start`."""
    return f"{STATS_PREFIX}b:{resolution}:{start}"


# ---------------------------------------------------------------- MLflow

EXPERIMENT = "adaptive-spec"
MODEL_NAME = "adaptive-spec-draft"  # one registered model per target/draft pair; the pair is in its tags
CHAMPION = "champion"  # the alias servers follow
PREVIOUS = "previous"  # the version before the champion, for a plain rollback
ARTIFACT_PATH = "adapter"  # the adapter directory's place in a registered run's artifacts
SHA_TAG = "adapter_sha256"  # version tag (and metadata key): the sha256 of the adapter's weights
ACTION_TAG = "adaptive_spec.last_action"  # version tags: what was last done to it, `_by` whom, `_at` when
EVENT_TAG = "adaptive_spec.last_event"  # registered-model tag: the last promote or rollback event (JSON)
NOT_PROMOTED_TAG = "adaptive_spec.not_promoted"  # why a queued registration left the champion alone
OUTSIDE = "mlflow-alias"  # the `by` of an alias moved outside adaptive-spec (the MLflow UI, a client)

# The domain rule, here once, for every floor: a request's tag (service/schemas.py: a 400 otherwise), the
# trainer's lineages, the registry's aliases (`champion-sql`: MLflow aliases allow letters, digits, "_" and
# "-") and the CLI's --domain. A name no alias can carry (`sql.v2`, `a b`) is refused at the API, so no
# request's tag is silently trained into the general adapter.
MAX_DOMAIN_CHARS = 64
DOMAIN_PATTERN = r"^[A-Za-z0-9_]+(?:-[A-Za-z0-9_]+)*$"  # plus at most MAX_DOMAIN_CHARS characters
DOMAIN_TAG_PATTERN = DOMAIN_PATTERN  # the name service/schemas.py knows it by
_ALIAS_DOMAIN = re.compile(DOMAIN_PATTERN)


def check_domain(domain: str) -> str:
    """`domain` when an alias can carry it (letters, digits, '_' and inner '-', at most 64 characters);
    ValueError saying what is wrong otherwise. "sql" -> "sql"; "a b" and "-x" are refused."""
    if len(domain) > MAX_DOMAIN_CHARS:
        raise ValueError(f"a domain name is at most {MAX_DOMAIN_CHARS} characters; got {len(domain)}")
    if not _ALIAS_DOMAIN.fullmatch(domain):
        raise ValueError(f"a domain in an alias name is letters, digits, '_' and inner '-'; got {domain!r}")
    return domain


def is_alias_domain(domain: str) -> bool:
    """Whether a domain tag can have an adapter of its own (`check_domain` accepts it)."""
    try:
        check_domain(domain)
    except ValueError:
        return False
    return True


def champion_alias(domain: str | None = None) -> str:
    """The alias servers follow: `champion`, or `champion-<domain>` for one domain's adapter."""
    return _alias(CHAMPION, domain)


def previous_alias(domain: str | None = None) -> str:
    """The alias a plain rollback returns to: `previous`, or `previous-<domain>`."""
    return _alias(PREVIOUS, domain)


def _alias(base: str, domain: str | None) -> str:
    return base if domain is None else f"{base}-{check_domain(domain)}"


# ---------------------------------------------------------------- an adapter version on disk

CONFIG_FILE = "adapter_config.json"  # PEFT's
WEIGHTS_FILE = "adapter_model.safetensors"  # PEFT's
EAGLE3_CONFIG_FILE = "config.json"  # an EAGLE-3 head version is a speculators checkpoint (formats/eagle3.py) ...
EAGLE3_WEIGHTS_FILE = "model.safetensors"  # ... in place of PEFT's two files, the others beside it as for LoRA
METADATA_FILE = "adaptive_spec_adapter.json"  # who trained it, from what, and the gate's figures
CHECKSUM_FILE = "checksum.sha256"  # sha256sum format: `sha256sum -c checksum.sha256` checks the weights and the index
VOCAB_FILE = "draft_vocab.json"  # optional: {"token_ids": [...]}, the tokens the draft may propose
NGRAMS_FILE = "draft_ngrams.json"  # optional: {"ngrams": [[n-gram, continuation], ...]}, in checksum.sha256
NGRAMS_SHA_KEY = "ngrams_sha256"  # metadata key: the sha256 of NGRAMS_FILE (drafters/ngram_index.py)
VOCAB_SHA_KEY = "vocab_sha256"  # metadata key: the sha256 of VOCAB_FILE (versions sealed before it have none)
SIGNATURE_FILE = "signature.hmac"  # with ADAPTIVE_SPEC_SIGNING_KEY: "hmac-sha256 <hex>" over the sealed manifest


def version_dir_name(version: int) -> str:
    """The trainer's directory of a promoted version: 3 -> "v0003"."""
    return f"v{version:04d}"


def cache_dir_name(version: str, sha256: str) -> str:
    """A server's download of a registry version: ("3", "9f2c...") -> "v3-9f2c0123abcd"."""
    return f"v{version}-{sha256[:12]}"


# ---------------------------------------------------------------- the data directory

DEFAULT_DATA_DIR = ".adaptive-spec"
DEFAULT_MODEL = "smollm2-135m-instruct"  # the built-in target (adaptive_spec/models.py loads it)
DEFAULT_DRAFT = "head"  # the draft a command uses without --draft (README: "Two drafts on the same traffic")
MLFLOW_DB = "mlflow.db"  # the default registry: sqlite:///<data-dir>/mlflow.db
ADAPTERS_DIR = "adapters"  # the trainer's promoted versions, version_dir_name(N)
ADAPTER_CACHE_DIR = "adapter-cache"  # a server's downloaded versions, cache_dir_name(V, sha)
CHECKPOINT_DIR = "trainer"  # the trainer's checkpoints
PENDING_FILE = "registry-pending.json"  # promotions waiting for MLflow


def sqlite_tracking_uri(data_dir: str | Path) -> str:
    """The registry in the data directory: sqlite:///<absolute data-dir>/mlflow.db."""
    return f"sqlite:///{Path(data_dir).resolve() / MLFLOW_DB}"


# ---------------------------------------------------------------- settings

REDIS_URL_ENV = "REDIS_URL"
MLFLOW_TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
ENV_PREFIX = "ADAPTIVE_SPEC_"  # every other setting: ADAPTIVE_SPEC_<FIELD>
DATA_DIR_ENV = ENV_PREFIX + "DATA_DIR"
SIGNING_KEY_ENV = ENV_PREFIX + "SIGNING_KEY"  # the trainer signs versions with it, servers refuse the others
COMPILE_ENV = ENV_PREFIX + "COMPILE"  # 0: decode eagerly (tests; a machine without a C++ compiler)
CPU_ATTENTION_ENV = ENV_PREFIX + "CPU_ATTENTION"  # 0: the compiled step attends with exact.attention, no C++ kernel
CPU_LINEAR_ENV = ENV_PREFIX + "CPU_LINEAR"  # auto (timed), 1 (always) or 0 (never): cpu_linear.py
CPU_BF16_LINEAR_ENV = ENV_PREFIX + "CPU_BF16_LINEAR"  # 0: the compiled step's bf16 products stay PyTorch's
CPU_AMX_ENV = ENV_PREFIX + "CPU_AMX"  # 0: that kernel's products on AVX512-BF16 where the CPU also has AMX
PREFIX_CACHE_MB_ENV = ENV_PREFIX + "PREFIX_CACHE_MB"  # memory for prompts' cached prefixes (prefix_cache.py); 0: none


def redact_url(url: str) -> str:
    """redis://:secret@host:6379/0 -> redis://***@host:6379/0; a URL without credentials is unchanged."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))
