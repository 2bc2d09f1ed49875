"""Promotion, rollback and reading the aliases: the half of `AdapterRegistry` that moves and reads what is served.

Promotion and rollback move aliases and leave an audit trail (registry/records.py: audit_tags and
event_tag): tags on the version (`adaptive_spec.last_action`, `..._by`, `..._at`, `..._alias`), the
event (with its `domain`) as the domain's registered-model tag, and the event published on
`adaptive_spec:adapters` (registry/events.py).

Every move holds the alias lock (registry/lock.py: a file lock beside a sqlite store, a Redis key for an
`mlflow server`), so promotions and rollbacks from the trainer, the CLI and the admin API of any replica
happen one after the other, never interleaved; a caller's condition (`promote(..., unless=...)`, the
trainer's queue asking whether its parent is still the champion) is checked under it too. Each move reads
the aliases back and returns them in its event (`"aliases"`), so a command says what is there afterwards.

A rollback without `to` sets `champion` to `previous` and removes `previous` (per domain alike): nothing
is known about the version before it, and a second plain rollback must not bring back the version just
rolled away from. `rollback(to=V)` and `promote(V)` go anywhere and set `previous` to the old champion."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator

from adaptive_spec.contracts import OUTSIDE, SHA_TAG
from registry.connection import RegistryConnection, RegistryError, RegistryUnavailable, mlflow_error_code
from registry.lock import LockUnavailable
from registry.records import ServedChampion, audit_tags, champions_of, domain_aliases, event_record, event_tag

log = logging.getLogger(__name__)


class RegistryAliases(RegistryConnection):
    """Promote, roll back and read the champion and previous aliases (the general adapter's and each domain's)."""

    def promote(
        self,
        version: str | int,
        *,
        by: str,
        action: str = "promote",
        domain: str | None = None,
        unless: Callable[[], str | None] | None = None,
    ) -> dict:
        """champion <- version, previous <- the old champion (of `domain`); returns the event it published.

        Under the alias lock (registry/lock.py): `unless()`, when given, is asked first, and a reason it
        returns leaves the aliases alone (the event then says `"changed": false` and `"refused": reason`).
        The aliases are read back after the move: the event's `"aliases"` is what they hold then."""
        version = str(version)
        champion, previous = alias_pair(domain)
        with self._mlflow(action), self._moving(action):
            self._get_version(version)
            old = self.aliases().get(champion)
            refused = unless() if unless is not None else None
            if refused is not None or old == version:  # nothing moves, nothing to record
                event = event_record(action, self.model_name, domain, version, old, by, time.time())
                return event | {"changed": False, "refused": refused, "aliases": self._read_back(domain)}
            at = self._audit(version, action, by, champion)  # before the alias moves: a watcher reads them with it
            if old is not None:
                self.client.set_registered_model_alias(self.model_name, previous, old)
            self.client.set_registered_model_alias(self.model_name, champion, version)
            return self._record(action, version, old, by, at, domain)

    def rollback(self, to: str | int | None = None, *, by: str, domain: str | None = None) -> dict:
        """champion <- `to`, or <- previous (and previous removed) when `to` is None (of `domain`); under
        the alias lock, read back like `promote`."""
        if to is not None:
            return self.promote(to, by=by, action="rollback", domain=domain)
        champion, previous = alias_pair(domain)
        with self._mlflow("rollback"), self._moving("rollback"):
            aliases = self.aliases()
            target, old = aliases.get(previous), aliases.get(champion)
            if target is None:
                flag = "" if domain is None else f" --domain {domain}"
                raise RegistryError(
                    f"{self.model_name} has no '{previous}' version to roll back to; "
                    f"name one with --to VERSION{flag} (see `adaptive-spec adapters list{flag}`)"
                )
            at = self._audit(target, "rollback", by, champion)
            self.client.set_registered_model_alias(self.model_name, champion, target)
            self.client.delete_registered_model_alias(self.model_name, previous)
            return self._record("rollback", target, old, by, at, domain)

    def aliases(self) -> dict[str, str]:
        """alias -> version, as str (a server sends str, sqlite int); {} before the first registration."""
        with self._mlflow("read aliases"):
            try:
                model = self.client.get_registered_model(self.model_name)
            except Exception as exc:
                if mlflow_error_code(exc) == "RESOURCE_DOES_NOT_EXIST":
                    return {}
                raise
            return {alias: str(version) for alias, version in (model.aliases or {}).items()}

    def champion(self, domain: str | None = None) -> str | None:
        """The served version (of `domain`), or None (no registered model, or no such alias)."""
        return self.aliases().get(alias_pair(domain)[0])

    def champions(self) -> dict[str | None, str]:
        """Every champion alias by domain: {None: "3", "sql": "5"} for `champion` and `champion-sql`."""
        return champions_of(self.aliases())

    def served(self, domain: str | None = None) -> ServedChampion:
        """The champion (of `domain`), its weights' sha256 and who moved it there: one or two MLflow calls."""
        champion = alias_pair(domain)[0]
        with self._mlflow("read champion"):
            try:
                model = self.client.get_registered_model(self.model_name)
            except Exception as exc:
                if mlflow_error_code(exc) == "RESOURCE_DOES_NOT_EXIST":
                    return ServedChampion(None, None, None)
                raise
            version = (model.aliases or {}).get(champion)
            version = None if version is None else str(version)
            if version is not None and version not in self._sha_of:
                sha = (self._get_version(version).tags or {}).get(SHA_TAG)
                if sha:
                    self._sha_of[version] = sha
            raw = (model.tags or {}).get(event_tag(domain))
        event = json.loads(raw) if raw else {}
        sha = self._sha_of.get(version) if version is not None else None
        if event.get("version") == version and event.get("domain") == domain:
            return ServedChampion(version, sha, event.get("by"), event.get("from"))
        return ServedChampion(version, sha, OUTSIDE)

    def last_event(self, domain: str | None = None) -> dict | None:
        """The last promote or rollback of `domain`'s aliases (None: the general adapter's)."""
        with self._mlflow("read event"):
            raw = self.client.get_registered_model(self.model_name).tags.get(event_tag(domain))
        return json.loads(raw) if raw else None

    @contextlib.contextmanager
    def _moving(self, what: str) -> Iterator[None]:
        """The alias lock for one move (registry/lock.py); RegistryUnavailable when it cannot be had."""
        try:
            with self.lock.held(what):
                yield
        except LockUnavailable as exc:
            raise RegistryUnavailable(f"{what}: {exc}") from None

    def _read_back(self, domain: str | None) -> dict[str, str | None]:
        """What the domain's two aliases hold now: {"champion": "4", "previous": None}."""
        aliases = self.aliases()
        return {alias: aliases.get(alias) for alias in alias_pair(domain)}

    def _audit(self, version: str, action: str, by: str, alias: str) -> float:
        """Tags on the version saying what was done to it, by whom, when, to which alias; returns when."""
        at = time.time()
        for key, value in audit_tags(action, by, alias, at).items():
            self.client.set_model_version_tag(self.model_name, version, key, value)
        return at

    def _record(self, action: str, version: str, old: str | None, by: str, at: float, domain: str | None) -> dict:
        """The event: as the domain's tag on the registered model, then on pub/sub (best effort). The aliases
        are read back first: anything but what this move wrote was written by a hand outside the lock."""
        after = self._read_back(domain)
        tags = self.client.get_registered_model(self.model_name).tags
        pair = {"target_id": tags.get("target_id"), "draft_id": tags.get("draft_id")}
        event = {
            **event_record(action, self.model_name, domain, version, old, by, at),
            "changed": True,
            "aliases": after,
            **pair,
        }
        self.client.set_registered_model_tag(self.model_name, event_tag(domain), json.dumps(event))
        champion = alias_pair(domain)[0]
        log.info("%s: %s %s %s -> %s by %s", self.model_name, action, champion, old, version, by)
        if after[champion] != version:
            log.warning(
                "%s: %s now names %s, not %s: moved meanwhile outside adaptive-spec",
                self.model_name,
                champion,
                after[champion],
                version,
            )
        self.events.publish(event)  # best effort: watchers also poll the aliases
        return event


def alias_pair(domain: str | None) -> tuple[str, str]:
    """(champion, previous) alias of `domain`; a name no alias can carry is a RegistryError."""
    try:
        return domain_aliases(domain)
    except ValueError as exc:
        raise RegistryError(str(exc)) from None
