"""The service's one settings object, read from the environment (STYLE.md §9).

    settings = Settings.from_env()                       # ADAPTIVE_SPEC_*, REDIS_URL
    settings = Settings.from_env(port=8001, host="0.0.0.0")  # command-line flags win over the environment

| field | environment | default |
|---|---|---|
| host, port | ADAPTIVE_SPEC_HOST, ADAPTIVE_SPEC_PORT | 127.0.0.1, 8000 |
| data_dir | ADAPTIVE_SPEC_DATA_DIR | ./.adaptive-spec |
| target, draft, dtype, device | ADAPTIVE_SPEC_TARGET, _DRAFT, _DTYPE, _DEVICE | the engine's defaults |
| k | ADAPTIVE_SPEC_K | unset or `dynamic`: dynamic k |
| compile, tree_budget | ADAPTIVE_SPEC_COMPILE, ADAPTIVE_SPEC_TREE_BUDGET | compiled (the core's default), chains (trees of up to N nodes per row when set) |
| (the core's) | ADAPTIVE_SPEC_PREFIX_CACHE_MB | 512 MB of prompts' cached prefixes, where the exactness check allows it (adaptive_spec/cache/prefix.py; 0: none) |
| served_model_name | ADAPTIVE_SPEC_SERVED_MODEL_NAME | the target's name |
| redis_url | REDIS_URL | none: no correction log |
| api_key | ADAPTIVE_SPEC_API_KEY | none: /v1 is open |
| admin_token | ADAPTIVE_SPEC_ADMIN_TOKEN | none: /admin refuses everything (403) |
| signing_key | ADAPTIVE_SPEC_SIGNING_KEY | none: any registry version is served (a warning at start); set: only versions the trainer signed with it |
| mlflow_tracking_uri | MLFLOW_TRACKING_URI | none: the adapter registry is `<data_dir>/mlflow.db` if that file exists, else off |
| adapter_poll_s | ADAPTIVE_SPEC_ADAPTER_POLL_S | 5 s between polls of the `champion` alias (0: no watcher) |
| max_tokens_limit, default_max_tokens | ADAPTIVE_SPEC_MAX_TOKENS, ADAPTIVE_SPEC_DEFAULT_MAX_TOKENS | 2048, 256 |
| max_body_bytes | ADAPTIVE_SPEC_MAX_BODY_BYTES | 1 MiB |
| max_batch | ADAPTIVE_SPEC_MAX_BATCH | 8 sequences decoding together (1: one request at a time) |
| adapter | ADAPTIVE_SPEC_ADAPTER | none: an adapter directory to serve from the start (the registry's champion, when one is configured, replaces it) |
| keep_versions | ADAPTIVE_SPEC_KEEP_VERSIONS | 20 downloaded versions kept in the adapter cache besides those served |
| max_adapters | ADAPTIVE_SPEC_MAX_ADAPTERS | 8 domain adapters held at once; one more evicts the least used |
| queue_size | ADAPTIVE_SPEC_QUEUE_SIZE | 32 requests waiting for the engine |
| request_timeout_s | ADAPTIVE_SPEC_REQUEST_TIMEOUT_S | 300 s, from arrival, queueing included |
| drain_timeout_s | ADAPTIVE_SPEC_DRAIN_TIMEOUT_S | 30 s to finish in-flight requests at shutdown |
| stream_maxlen | ADAPTIVE_SPEC_STREAM_MAXLEN | 100000 records (MAXLEN ~ of the correction stream) |
| stream_max_bytes | ADAPTIVE_SPEC_STREAM_MAX_BYTES | 1073741824 (1 GiB): the stream's byte budget, as a count from the mean record size (service/correction_log.py) |
| log_queue_size | ADAPTIVE_SPEC_LOG_QUEUE_SIZE | 1024 records held in memory while Redis is away |
| record_topk | ADAPTIVE_SPEC_RECORD_TOPK | 16 target top-m entries per output token |
| stats_retention_s | ADAPTIVE_SPEC_STATS_RETENTION_S | 604800 s (7 days) of dashboard buckets in Redis (10 s buckets: at most 2 days) |
| drift_window_s | ADAPTIVE_SPEC_DRIFT_WINDOW_S | 600 s of traffic the drift alert looks at |
| drift_fraction | ADAPTIVE_SPEC_DRIFT_FRACTION | 0.7: alert below this fraction of the served adapter's gated figure |
| drift_min_drafts | ADAPTIVE_SPEC_DRIFT_MIN_DRAFTS | 200 drafting steps in the window before the alert may fire |
| json_whitespace | ADAPTIVE_SPEC_JSON_WHITESPACE | `compact`: structured outputs and forced tool calls write at most one space between JSON tokens; `pretty` allows up to 8 spaces or newlines (adaptive_spec/outputs/grammar.py WHITESPACE) |
| tool_call_parser | ADAPTIVE_SPEC_TOOL_CALL_PARSER | `hermes`: how tool calls are read from the model's output and forced (adaptive_spec/outputs/tools, TOOL_PARSERS) |

The API key, the admin token and the signing key must be at least 16 characters (6 distinct) and hold no
known placeholder (`change-me`, ...): the server refuses to start otherwise, and says how to make one.
Secrets (the API key, the admin token, the signing key, a password inside REDIS_URL or MLFLOW_TRACKING_URI) never appear in `repr()`,
so logging the settings is safe. The API key and the admin token lose surrounding whitespace when read: one
written to a file by `echo` ends in a newline that no client sends, and would never match.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

from adaptive_spec.contracts import DEFAULT_DATA_DIR, ENV_PREFIX, MLFLOW_TRACKING_URI_ENV, REDIS_URL_ENV, redact_url
from adaptive_spec.options import EnvSettings, ModelOptions, check_secret
from adaptive_spec.outputs.grammar import WHITESPACE
from adaptive_spec.outputs.tools import TOOL_PARSERS

_SECRETS = ("api_key", "admin_token", "signing_key")


@dataclass(frozen=True, repr=False)
class Settings(ModelOptions, EnvSettings):
    """The serving process's settings: the model options (target, draft, k, dtype, device), then its own."""

    ENV_NAMES: ClassVar[dict[str, str]] = {
        "redis_url": REDIS_URL_ENV,
        "mlflow_tracking_uri": MLFLOW_TRACKING_URI_ENV,
        "max_tokens_limit": ENV_PREFIX + "MAX_TOKENS",
    }

    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Path(DEFAULT_DATA_DIR)
    served_model_name: str | None = None  # the `model` clients must send; None = the target's name
    redis_url: str | None = None
    api_key: str | None = None
    admin_token: str | None = None
    signing_key: str | None = None  # versions without the trainer's signature made with it are refused
    mlflow_tracking_uri: str | None = None  # the adapter registry (service/watcher.py)
    adapter_poll_s: float = 5.0
    max_tokens_limit: int = 2048
    default_max_tokens: int = 256
    max_body_bytes: int = 1 << 20
    max_batch: int = 8
    adapter: str | None = None  # an adapter directory served from the start
    max_adapters: int = 8
    keep_versions: int = 20  # downloaded adapter versions kept besides those served
    queue_size: int = 32
    request_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0
    stream_maxlen: int = 100_000
    stream_max_bytes: int = 1 << 30
    log_queue_size: int = 1024
    record_topk: int = 16
    stats_retention_s: int = 7 * 86400
    drift_window_s: float = 600.0
    drift_fraction: float = 0.7
    drift_min_drafts: int = 200
    json_whitespace: str = "compact"
    tool_call_parser: str = "hermes"

    def __post_init__(self) -> None:
        for name in _SECRETS:  # read from a file or a k8s Secret, a token often ends in a newline no client sends
            value = getattr(self, name)
            if value is not None and value.strip() != value:
                if not value.strip():
                    raise ValueError(f"{name} is blank: unset it, or give a token")
                object.__setattr__(self, name, value.strip())
            if getattr(self, name) is not None:
                check_secret(self.env_name(name), getattr(self, name))  # refused at start: placeholders, short ones
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.k is not None and self.k < 0:
            raise ValueError(f"k must be >= 0 or unset (dynamic), got {self.k}")
        for name in (
            "max_tokens_limit",
            "default_max_tokens",
            "max_body_bytes",
            "max_batch",
            "queue_size",
            "stream_maxlen",
            "stream_max_bytes",
            "log_queue_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.request_timeout_s <= 0 or self.drain_timeout_s < 0 or self.record_topk < 0:
            raise ValueError("request_timeout_s must be > 0, drain_timeout_s and record_topk >= 0")
        if self.max_adapters < 0:
            raise ValueError(f"max_adapters must be >= 0, got {self.max_adapters}")
        if self.adapter_poll_s < 0:
            raise ValueError(f"adapter_poll_s must be >= 0 (0: no adapter watcher), got {self.adapter_poll_s}")
        if self.stats_retention_s < 600 or self.drift_window_s < 10 or self.drift_min_drafts < 0:
            raise ValueError("stats_retention_s must be >= 600, drift_window_s >= 10, drift_min_drafts >= 0")
        if not 0 < self.drift_fraction <= 1:
            raise ValueError(f"drift_fraction must be in (0, 1], got {self.drift_fraction}")
        if self.json_whitespace not in WHITESPACE:
            raise ValueError(f"json_whitespace must be one of {', '.join(WHITESPACE)}, got {self.json_whitespace!r}")
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}"
            )

    def warnings(self) -> list[str]:
        """What this configuration leaves open, logged at start (service/server.py): /v1 without a key on an
        address others can reach, and a registry followed without checking signatures."""
        said = []
        if self.api_key is None and not _loopback(self.host):
            said.append(
                f"serving on {self.host} without ADAPTIVE_SPEC_API_KEY: /v1 is open to anyone who reaches this "
                "address; set a key (openssl rand -hex 24), or bind to 127.0.0.1"
            )
        if self.signing_key is None:
            said.append(
                "ADAPTIVE_SPEC_SIGNING_KEY is not set: this server serves whatever version the registry's champion "
                "alias names, signed or not; give it and the trainer the same key to refuse forged versions"
            )
        return said

    def __repr__(self) -> str:
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _SECRETS and value is not None:
                value = "***"
            elif f.name in ("redis_url", "mlflow_tracking_uri") and value is not None:
                value = redact_url(value)
            shown.append(f"{f.name}={value!r}")
        return f"Settings({', '.join(shown)})"


def _loopback(host: str) -> bool:
    """127.0.0.1, ::1 and localhost: only this machine can connect."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False
