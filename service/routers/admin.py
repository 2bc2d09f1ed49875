"""Admin routes: the adapter registry from HTTP. Every route needs the admin token.

    H="Authorization: Bearer $ADAPTIVE_SPEC_ADMIN_TOKEN"
    curl -s -H "$H" localhost:8000/admin/adapters                                  # versions, aliases, served
    curl -s -H "$H" -X POST localhost:8000/admin/adapters/rollback                 # champion <- previous
    curl -s -H "$H" -X POST localhost:8000/admin/adapters/rollback -d '{"to": "2"}'
    curl -s -H "$H" -X POST localhost:8000/admin/adapters/promote -d '{"version": "3"}'
    curl -s -H "$H" -X POST localhost:8000/admin/adapters/promote -d '{"version": "3", "domain": "sql"}'

A body's optional `domain` acts on that domain's aliases (`champion-sql`, `previous-sql`) instead of
the general adapter's; a name an alias cannot carry (letters, digits, '_' and inner '-', at most 64)
is a 400. The list shows, besides `served_version` (the general adapter's, null for the base draft),
what this server holds for each alias it follows and what it refused, keyed by that alias:

    "served_version": "3",
    "served_versions": {"champion": "3", "champion-sql": "5"},
    "refused": {"champion-sql": {"version": "6", "reason": "incompatible"}},

No token configured (ADAPTIVE_SPEC_ADMIN_TOKEN unset): every route answers 403. A missing or wrong
token: 401 (`service/deps.py`). A promote or rollback moves the MLflow aliases (registry/aliases.py),
is recorded with `by` = "admin-api:<who>@<client address>" (`who` from the optional body field
`by`, else "token"), and wakes this server's watcher, which swaps at once; other servers follow
the pub/sub event or their next alias poll. Errors: unknown version 404, nothing to roll back to
409, no registry configured or MLflow unreachable 503.
"""

from __future__ import annotations

import re

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, field_validator

from adaptive_spec.contracts import champion_alias, check_domain
from service.deps import AdminToken, ServiceDep
from service.errors import APIError

router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[AdminToken])


def _version_number(value: str | int | None) -> str | None:
    """MLflow versions are positive integers: "3" or 3 -> "3"; anything else (-1, "v3", 10**30) is a 400 here,
    before it reaches MLflow, whose sqlite store cannot even hold an integer over 64 bits."""
    if value is None:
        return None
    if isinstance(value, bool) or not re.fullmatch(r"[1-9][0-9]{0,9}", str(value)):
        raise ValueError("a version is a positive integer of at most 10 digits, e.g. 3")
    return str(value)


def _domain_name(value: str | None) -> str | None:
    """None (the general adapter) or a name an alias can carry: "sql" -> "sql"; "a b", "" or 65 chars: a 400."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError('a domain is a string, e.g. "sql"')
    return check_domain(value)  # ValueError saying what is wrong


class RollbackRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    to: str | int | None = None  # a version; None = the `previous` alias
    domain: str | None = None  # None: the general adapter
    by: str | None = None

    _to = field_validator("to", mode="before")(_version_number)
    _domain = field_validator("domain", mode="before")(_domain_name)


class PromoteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str | int
    domain: str | None = None  # None: the general adapter
    by: str | None = None

    _version = field_validator("version", mode="before")(_version_number)
    _domain = field_validator("domain", mode="before")(_domain_name)


@router.get("/adapters")
def list_adapters(service: ServiceDep) -> dict:
    registry = _registry(service)
    versions = _call(registry.versions)
    aliases = _call(registry.aliases)
    return {
        "object": "list",
        "model": registry.model_name,
        "served_version": service.engine.adapter_version,
        "served_versions": _served_versions(service),
        "aliases": aliases,
        "refused": {
            champion_alias(domain): {"version": version, "reason": reason}
            for (domain, version), reason in (service.watcher.refused if service.watcher else {}).items()
        },
        "data": [version.as_dict() for version in versions],
    }


@router.post("/adapters/rollback")
def rollback(service: ServiceDep, request: Request, body: RollbackRequest | None = None) -> dict:
    body = body or RollbackRequest()
    event = _call(_registry(service).rollback, to=body.to, by=_by(request, body.by), domain=body.domain)
    return _after(service, event)


@router.post("/adapters/promote")
def promote(service: ServiceDep, request: Request, body: PromoteRequest) -> dict:
    event = _call(_registry(service).promote, body.version, by=_by(request, body.by), domain=body.domain)
    return _after(service, event)


def _registry(service):
    if service.registry is None:
        raise APIError(
            503,
            "no adapter registry is configured: set MLFLOW_TRACKING_URI (or run the trainer with "
            "this server's --data-dir) and restart",
            code="no_registry",
        )
    return service.registry


def _call(function, *args, **kwargs):
    from registry.client import RegistryError, RegistryUnavailable

    try:
        return function(*args, **kwargs)
    except RegistryUnavailable as exc:
        raise APIError(503, str(exc), code="registry_unavailable") from None
    except RegistryError as exc:
        missing = "has no version" in str(exc)
        raise APIError(404 if missing else 409, str(exc), code="unknown_version" if missing else "conflict") from None


def _by(request: Request, who: str | None) -> str:
    host = request.client.host if request.client else "unknown"
    return f"admin-api:{(who or 'token')[:64]}@{host}"


def _after(service, event: dict) -> dict:
    if service.watcher is not None and event.get("changed", True):
        service.watcher.wake(event)
    return {
        "event": event,
        "served_version": service.engine.adapter_version,
        "served_versions": _served_versions(service),
    }


def _served_versions(service) -> dict[str, str]:
    """What the engine's slots hold, keyed by the alias each follows: {"champion": "3", "champion-sql": "5"}
    (an alias, not a bare domain, so a domain named "general" can never collide with the general adapter)."""
    held = service.engine.adapters.versions()
    return {champion_alias(domain): held[domain] for domain in sorted(held, key=lambda d: d or "")}
