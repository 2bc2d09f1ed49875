"""What an adapter version holds in MLflow: the run's params and metrics, the version's tags, and the
version as `adaptive-spec adapters list` and `GET /admin/adapters` show it.

    params, metrics = run_figures(metadata)     # lr, rank, ... / candidate_greedy_match, loss, ...
    tags = version_tags(metadata, adapter_dir)   # target_id, draft_id, lineage, adapter_sha256, ...

All of it is read from the adapter's adaptive_spec_adapter.json (adapters.AdapterDir.metadata), so
the registry shows exactly what the trainer recorded: the training settings as params, the gate's
figures and the loss as metrics, the lineage as tags. A figure that is missing or not finite (the
gate over zero held-out positions gives NaN) is left out rather than logged as a number it is not.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from adaptive_spec.contracts import ACTION_TAG, SHA_TAG


@dataclass(frozen=True)
class RegisteredAdapter:
    """One version of the registered model, as `adapters list` shows it."""

    version: str
    created_at: float  # seconds since the epoch
    aliases: tuple[str, ...]
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
        }


def registered_adapter(model_version, metrics: dict, aliases: dict[str, str]) -> RegisteredAdapter:
    """One MLflow ModelVersion with its run's metrics and the registered model's aliases."""
    version = str(model_version.version)
    tags = dict(model_version.tags or {})
    return RegisteredAdapter(
        version=version,
        created_at=model_version.creation_timestamp / 1000.0,
        aliases=tuple(sorted(alias for alias, v in aliases.items() if v == version)),
        run_id=model_version.run_id or "",
        sha256=tags.get(SHA_TAG),
        candidate_greedy_match=metrics.get("candidate_greedy_match"),
        champion_greedy_match=metrics.get("champion_greedy_match"),
        candidate_expected_acceptance=metrics.get("candidate_expected_acceptance"),
        loss=metrics.get("loss"),
        tags=tags,
    )


def run_figures(metadata: dict) -> tuple[dict[str, str], dict[str, float]]:
    """(params, metrics) of the run that registers an adapter, from its metadata."""
    settings = metadata.get("settings") or {}
    params = {
        "lr": settings.get("lr"),
        "rank": settings.get("r"),
        "lora_alpha": settings.get("alpha"),
        "target_modules": ",".join(settings.get("target_modules") or []),
        "loss_kind": settings.get("loss"),
        "records_used": metadata.get("records_used"),
        "tokens_used": metadata.get("tokens_used"),
        "records_consumed": metadata.get("records_consumed"),
        "tokens_consumed": metadata.get("tokens_consumed"),
        "steps": metadata.get("steps"),
        "round_steps": metadata.get("round_steps"),
    }
    gate = metadata.get("gate") or {}
    metrics = {
        "loss": metadata.get("loss"),
        "first_loss": metadata.get("first_loss"),
        "last_loss": metadata.get("last_loss"),
    }
    for side in ("candidate", "champion"):
        for key, value in (gate.get(side) or {}).items():
            metrics[f"{side}_{key}"] = value
    return (
        {key: str(value) for key, value in params.items() if value is not None},
        {key: float(value) for key, value in metrics.items() if _finite(value)},
    )


def version_tags(metadata: dict, adapter_dir: Path) -> dict[str, str]:
    gate = metadata.get("gate") or {}
    tags = {
        "target_id": metadata.get("target_id"),
        "draft_id": metadata.get("draft_id"),
        "base_version": metadata.get("base_version"),
        "parent_version": metadata.get("parent_version"),
        "trainer_version": metadata.get("version"),
        "adapter_dir": adapter_dir.name,
        "domain_mix": json.dumps(metadata.get("domain_mix") or {}, sort_keys=True),
        SHA_TAG: metadata.get(SHA_TAG),
        "gate_reason": gate.get("reason"),
    }
    return {key: str(value) for key, value in tags.items() if value is not None}


def _finite(value) -> bool:
    try:
        return value is not None and math.isfinite(float(value))
    except (TypeError, ValueError):
        return False
