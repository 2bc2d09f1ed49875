"""The model options every process takes, and settings read from the environment (STYLE.md §9, §20).

    models = ModelOptions(target="smollm2-135m-instruct", draft="head", k=None)
    models.argv()              # ["--target", "smollm2-135m-instruct", "--draft", "head", "--dtype", "auto", "--device", "auto"]
    models.argv(k=False)       # the same without --k, for `adaptive-spec train`, which takes none

    @dataclass(frozen=True)
    class Settings(ModelOptions, EnvSettings):   # flat: target, draft, k, dtype, device, then its own fields
        port: int = 8000
    Settings.from_env(port=8001)                 # defaults, then ADAPTIVE_SPEC_<FIELD>, then the overrides given
    CoreSettings.from_env().data_dir             # what the core library itself reads from the environment

A process's settings type holds its defaults once: the command line takes its flags' defaults from
there (`None` on the command line means "not given": the environment or the default decides), and
`from_env` reads every field from `ADAPTIVE_SPEC_<FIELD>` (or the name in `ENV_NAMES`), parsed by
the field's type. `k` also takes `dynamic` (None: dynamic k). The core library, which has no process
of its own, reads its few variables through `CoreSettings`.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from adaptive_spec.contracts import (
    COMPILE_ENV,
    CPU_AMX_ENV,
    CPU_ATTENTION_ENV,
    CPU_BF16_LINEAR_ENV,
    CPU_LINEAR_ENV,
    DATA_DIR_ENV,
    DEFAULT_DATA_DIR,
    DEFAULT_DRAFT,
    DEFAULT_MODEL,
    ENV_PREFIX,
    PREFIX_CACHE_MB_ENV,
)

DTYPES = ("auto", "fp32", "bf16", "fp16")
MIN_SECRET_CHARS = 16
# Values that ship in examples and templates; a deployment that still holds one is open to anyone who read them.
PLACEHOLDERS = ("changeme", "replaceme", "placeholder", "yourtoken", "yourapikey", "yoursecret", "example", "secret")
DYNAMIC_K = "dynamic"
OFF = ("0", "false", "no", "off")  # a CoreSettings switch is off for these (any case, spaces trimmed)

S = TypeVar("S", bound="EnvSettings")


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """Which models: the target, the draft spec, k per step (None: dynamic k), dtype and device."""

    target: str = DEFAULT_MODEL
    draft: str = DEFAULT_DRAFT
    k: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    compile: bool | None = None  # compile the decoding step (None: ADAPTIVE_SPEC_COMPILE, else yes)
    tree_budget: int | None = None  # draft trees of up to this many nodes (None: chains)

    @property
    def models(self) -> ModelOptions:
        """Just the model options of a settings object that holds more."""
        return ModelOptions(self.target, self.draft, self.k, self.dtype, self.device, self.compile, self.tree_budget)

    def argv(self, *, k: bool = True) -> list[str]:
        """The flags that give a child `adaptive-spec serve` (or, with k=False, `train`) these models."""
        flags = ["--target", self.target, "--draft", self.draft, "--dtype", self.dtype, "--device", self.device]
        if k and self.compile is not None:
            flags.append("--compile" if self.compile else "--no-compile")
        if k and self.tree_budget is not None:
            flags += ["--tree-budget", str(self.tree_budget)]
        return flags + (["--k", str(self.k)] if k and self.k is not None else [])


class EnvSettings:
    """`from_env` for a frozen dataclass of settings: each field from ADAPTIVE_SPEC_<FIELD> (or ENV_NAMES)."""

    ENV_NAMES: ClassVar[dict[str, str]] = {}  # field -> environment variable, where it is not ADAPTIVE_SPEC_<FIELD>

    @classmethod
    def env_name(cls, field: str) -> str:
        return cls.ENV_NAMES.get(field, ENV_PREFIX + field.upper())

    @classmethod
    def from_env(cls: type[S], environ: Mapping[str, str] | None = None, **overrides: Any) -> S:
        """Defaults, then the environment, then `overrides` that are not None (flags that were given)."""
        env = os.environ if environ is None else environ
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            name = cls.env_name(field.name)
            raw = env.get(name)
            if raw is not None and raw.strip() != "":
                values[field.name] = _parse(field.name, hints[field.name], raw, name)
        values.update({key: value for key, value in overrides.items() if value is not None})
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class CoreSettings:
    """What the core library reads from the environment, in one place (STYLE.md §9). The core has no
    process of its own (a notebook imports it), so nothing is read at import: the code that decides
    calls `CoreSettings.from_env()` then, and hears a variable set after import (the CLI's --data-dir,
    a test's monkeypatch).

    | field | environment | default |
    |---|---|---|
    | compile | ADAPTIVE_SPEC_COMPILE | on: `Engine.from_pretrained(compile=None)` compiles the decoding step |
    | cpu_attention | ADAPTIVE_SPEC_CPU_ATTENTION | on: the compiled step's C++ attention kernel (attention_cpu.py) |
    | cpu_linear | ADAPTIVE_SPEC_CPU_LINEAR | auto: fp32 CPU products in the order timed faster; 1 always, 0 never |
    | cpu_bf16_linear | ADAPTIVE_SPEC_CPU_BF16_LINEAR | on: the compiled step's bf16 products by the C++ kernel (linear_bf16.py) |
    | cpu_amx | ADAPTIVE_SPEC_CPU_AMX | on: that kernel's products on AMX tiles where the CPU has AMX-BF16 |
    | data_dir | ADAPTIVE_SPEC_DATA_DIR | ./.adaptive-spec: the converted models, compiled code |
    | prefix_cache_mb | ADAPTIVE_SPEC_PREFIX_CACHE_MB | 512: memory for prompts' cached prefixes (prefix_cache.py); 0 none |

    A switch is off for 0, false, no or off and on for anything else, an empty value included: not
    `EnvSettings`' parsing (on only for 1, true, yes or on), and kept so because these variables always
    read so. Example: ADAPTIVE_SPEC_COMPILE=Off and ADAPTIVE_SPEC_CPU_LINEAR=" 1 " give compile=False,
    cpu_linear="1".
    """

    compile: bool = True
    cpu_attention: bool = True
    cpu_linear: str = "auto"  # "auto" (timed), "1" (always) or an OFF word (never): cpu_linear.py
    data_dir: Path = Path(DEFAULT_DATA_DIR)
    cpu_bf16_linear: bool = True  # after the others, so the fields before it keep their positions
    prefix_cache_mb: int = 512
    cpu_amx: bool = True

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CoreSettings:
        env = os.environ if environ is None else environ
        return cls(
            compile=_switch(env.get(COMPILE_ENV, "1")),
            cpu_attention=_switch(env.get(CPU_ATTENTION_ENV, "1")),
            cpu_linear=env.get(CPU_LINEAR_ENV, "auto").strip().lower(),
            data_dir=Path(env.get(DATA_DIR_ENV, DEFAULT_DATA_DIR)),
            cpu_bf16_linear=_switch(env.get(CPU_BF16_LINEAR_ENV, "1")),
            prefix_cache_mb=_megabytes(env.get(PREFIX_CACHE_MB_ENV, "512")),
            cpu_amx=_switch(env.get(CPU_AMX_ENV, "1")),
        )


def _megabytes(raw: str) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{PREFIX_CACHE_MB_ENV} must be a whole number of megabytes, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{PREFIX_CACHE_MB_ENV} must be >= 0, got {value}")
    return value


def _switch(raw: str) -> bool:
    return raw.strip().lower() not in OFF


def check_secret(env_name: str, value: str) -> str:
    """A token or key a deployment may start with: at least 16 characters, at least 6 of them distinct, and
    no known placeholder in it; ValueError saying how to make one otherwise.

        check_secret("ADAPTIVE_SPEC_ADMIN_TOKEN", "9f2c41d7a0be52e1")   # kept
        check_secret("ADAPTIVE_SPEC_ADMIN_TOKEN", "change-me")          # refused: a placeholder, and short
    """
    make = "make one with `openssl rand -hex 24` (or `python -c 'import secrets; print(secrets.token_hex(24))'`)"
    folded = "".join(c for c in value.lower() if c.isalnum())
    found = next((word for word in PLACEHOLDERS if word in folded), None)
    if found is not None:
        raise ValueError(f"{env_name} holds a placeholder ({found!r} in it), not a secret: {make}")
    if len(value) < MIN_SECRET_CHARS or len(set(value)) < 6:
        raise ValueError(
            f"{env_name} is too weak ({len(value)} characters, {len(set(value))} distinct): at least "
            f"{MIN_SECRET_CHARS} characters are required; {make}"
        )
    return value


def _parse(field: str, hint: Any, raw: str, env_name: str) -> Any:
    kinds = [kind for kind in typing.get_args(hint) if kind is not type(None)] if _optional(hint) else [hint]
    kind = kinds[0] if len(kinds) == 1 else str
    if field == "k" and raw.strip() == DYNAMIC_K:
        return None
    try:
        if kind is bool:
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if kind in (int, float):
            return kind(raw)
    except ValueError:
        raise ValueError(f"{env_name}={raw!r} is not a number") from None
    if kind is Path:
        return Path(raw)
    return raw


def _optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)
