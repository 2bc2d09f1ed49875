"""What an adapter version holds in MLflow: the run's params and metrics, the version's tags, the
version as `adaptive-spec adapters list` and `GET /admin/adapters` show it, and the alias and tag
names of each domain.

    params, metrics = run_figures(metadata)     # lr, rank, ... / candidate_greedy_match, loss, ...
    tags = version_tags(metadata, adapter_dir)   # target_id, draft_id, lineage, adapter_sha256, domain, ...
    domain_aliases("sql")                        # ("champion-sql", "previous-sql"); None -> ("champion", "previous")
    champions_of({"champion": "3", "champion-sql": "5", "previous": "2"})   # {None: "3", "sql": "5"}

All of it is read from the adapter's adaptive_spec_adapter.json (adapter_metadata.AdapterMetadata), so
the registry shows exactly what the trainer recorded: the training settings as params, the gate's
figures and the loss as metrics, the lineage as tags. A figure that is missing or not finite (the
gate over zero held-out positions gives NaN) is left out rather than logged as a number it is not.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from adaptive_spec.contracts import ACTION_TAG, CHAMPION, EVENT_TAG, SHA_TAG, champion_alias, previous_alias
from adaptive_spec.formats.adapter_metadata import AdapterMetadata

DOMAIN_TAG = "domain"  # version (and run) tag: the domain it was trained for; absent for the general adapter


@dataclass(frozen=True)
class ServedChampion:
    """The version a champion alias names, as the trainer compares it with its own champion."""

    version: str | None  # None: no alias (or no registered model): the base draft is served
    sha256: str | None  # the version's adapter_sha256 tag; None for the base draft or an untagged version
    by: str | None  # who put it there: the registry's last event when it names this version, else OUTSIDE
    moved_from: str | None = None  # the champion before, from that event (None: no event, or the base draft)


def domain_aliases(domain: str | None) -> tuple[str, str]:
    """(champion alias, previous alias) of a domain; ValueError for a name an alias cannot carry
    (adaptive_spec/contracts.py `check_domain`)."""
    return champion_alias(domain), previous_alias(domain)


def champions_of(aliases: dict[str, str]) -> dict[str | None, str]:
    """Every champion alias by domain (None: the general adapter); aliases of other names are skipped."""
    found: dict[str | None, str] = {}
    for alias, version in aliases.items():
        domain = None if alias == CHAMPION else alias.removeprefix(CHAMPION + "-")
        if domain == alias:  # neither `champion` nor `champion-<domain>`
            continue
        try:
            if domain_aliases(domain)[0] == alias:
                found[domain] = version
        except ValueError:  # e.g. `champion--x`, set by hand: not a domain's alias
            continue
    return found


def event_tag(domain: str | None) -> str:
    """The registered-model tag holding a domain's last event (JSON): `adaptive_spec.last_event` for the
    general adapter, `adaptive_spec.last_event.sql` for sql, so one domain's promotion never hides
    who moved another domain's alias (the watcher and the trainer read `by` from it)."""
    return EVENT_TAG if domain is None else f"{EVENT_TAG}.{domain}"


def event_record(
    action: str, model: str, domain: str | None, version: str, old: str | None, by: str, at: float
) -> dict:
    """A promote or rollback as published on pub/sub and kept in event_tag(domain), e.g.
    {"event": "rollback", "model": "adaptive-spec-draft", "domain": "sql", "version": "2", "from": "3",
    "by": "cli:alice@host", "at": 1767225600.0}; the registry adds "changed", "target_id" and "draft_id"."""
    return {"event": action, "model": model, "domain": domain, "version": version, "from": old, "by": by, "at": at}


def audit_tags(action: str, by: str, alias: str, at: float) -> dict[str, str]:
    """The version tags of its last promote or rollback, whichever alias that moved: one set per
    version, naming the alias. Version 3 promoted for sql, then for general, says "promote" by whom
    to `champion`; that it still serves sql shows in its aliases (`champion-sql`)."""
    return {ACTION_TAG: action, ACTION_TAG + "_by": by, ACTION_TAG + "_at": str(at), ACTION_TAG + "_alias": alias}


@dataclass(frozen=True)
class RegisteredAdapter:
    """One version of the registered model, as `adapters list` shows it."""

    version: str
    created_at: float  # seconds since the epoch
    aliases: tuple[str, ...]
    domain: str | None  # the domain it was trained for (its `domain` tag); None: the general adapter
    run_id: str
    sha256: str | None
    candidate_greedy_match: float | None  # the gate's figures when it was promoted by the trainer
    champion_greedy_match: float | None
    candidate_expected_acceptance: float | None
    loss: float | None
    tags: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "version": self.version,
            "domain": self.domain,
            "created_at": self.created_at,
            "aliases": list(self.aliases),
            "run_id": self.run_id,
            "sha256": self.sha256,
            "candidate_greedy_match": self.candidate_greedy_match,
            "champion_greedy_match": self.champion_greedy_match,
            "candidate_expected_acceptance": self.candidate_expected_acceptance,
            "loss": self.loss,
            "target_id": self.tags.get("target_id"),
            "draft_id": self.tags.get("draft_id"),
            "last_action": self.tags.get(ACTION_TAG),
            "last_action_by": self.tags.get(ACTION_TAG + "_by"),
            "last_action_alias": self.tags.get(ACTION_TAG + "_alias"),
        }


def registered_adapter(model_version, metrics: dict, aliases: dict[str, str]) -> RegisteredAdapter:
    """One MLflow ModelVersion with its run's metrics and the registered model's aliases."""
    version = str(model_version.version)
    tags = dict(model_version.tags or {})
    return RegisteredAdapter(
        version=version,
        created_at=model_version.creation_timestamp / 1000.0,
        aliases=tuple(sorted(alias for alias, v in aliases.items() if v == version)),
        domain=tags.get(DOMAIN_TAG) or None,
        run_id=model_version.run_id or "",
        sha256=tags.get(SHA_TAG),
        candidate_greedy_match=metrics.get("candidate_greedy_match"),
        champion_greedy_match=metrics.get("champion_greedy_match"),
        candidate_expected_acceptance=metrics.get("candidate_expected_acceptance"),
        loss=metrics.get("loss"),
        tags=tags,
    )


def run_figures(metadata: AdapterMetadata) -> tuple[dict[str, str], dict[str, float]]:
    """(params, metrics) of the run that registers an adapter, from its metadata."""
    settings = metadata.settings or {}
    params = {
        "lr": settings.get("lr"),
        "rank": settings.get("r"),
        "lora_alpha": settings.get("alpha"),
        "target_modules": ",".join(settings.get("target_modules") or []),
        "loss_kind": settings.get("loss"),
        "records_used": metadata.records_used,
        "tokens_used": metadata.tokens_used,
        "records_consumed": metadata.records_consumed,
        "tokens_consumed": metadata.tokens_consumed,
        "steps": metadata.steps,
        "round_steps": metadata.round_steps,
    }
    gate = metadata.gate or {}
    metrics = {"loss": metadata.loss, "first_loss": metadata.first_loss, "last_loss": metadata.last_loss}
    for side in ("candidate", "champion"):
        for key, value in (gate.get(side) or {}).items():
            metrics[f"{side}_{key}"] = value
    return (
        {key: str(value) for key, value in params.items() if value is not None},
        {key: float(value) for key, value in metrics.items() if value is not None and _finite(value)},
    )


def version_tags(metadata: AdapterMetadata, adapter_dir: Path) -> dict[str, str]:
    gate = metadata.gate or {}
    tags = {
        "target_id": metadata.target_id,
        "draft_id": metadata.draft_id,
        "base_version": metadata.base_version,
        "parent_version": metadata.parent_version,
        "trainer_version": metadata.version,
        "adapter_dir": adapter_dir.name,
        "domain_mix": json.dumps(metadata.domain_mix or {}, sort_keys=True),
        DOMAIN_TAG: metadata.domain or None,
        SHA_TAG: metadata.adapter_sha256,
        "gate_reason": gate.get("reason"),
    }
    return {key: str(value) for key, value in tags.items() if value is not None}


def _finite(value) -> bool:
    try:
        return value is not None and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False
