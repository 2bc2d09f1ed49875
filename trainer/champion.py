"""The trainer's view of the registry's champion (OnlineTrainer's `champion_source`).

source = RegistryChampion(registry, pending)
source.served()                        # ServedChampion("4", "9f2c...", "cli:alice@host"), or None
source.download("4", Path("/tmp/x"))   # the version's adapter directory
source.version_of("9f2c...")           # "4": the version holding these weights (for the log)
"""

from __future__ import annotations

from pathlib import Path

from trainer.pending import PendingRegistrations
from trainer.registry import AdapterRegistry, ServedChampion


class RegistryChampion:
    """What the registry serves, for the trainer (`OnlineTrainer(champion_source=...)`).

        source = RegistryChampion(registry, pending)
        source.served()      # ServedChampion("4", "9f2c...", "cli:alice@host"), or None while pending is not empty
        source.download("4", Path("/tmp/x"))   # the version's adapter directory
        source.version_of("9f2c...")           # "4": the version holding these weights (for the log)

    While some of the trainer's own promotions still wait in `pending`, the registry lags behind the
    trainer and says nothing about operators: `served()` answers None and the trainer keeps its
    champion. Once the queue is empty, a champion other than the trainer's is someone else's doing
    (or a registration that could not promote) and the trainer adopts it. Raises RegistryUnavailable
    when MLflow is down.
    """

    def __init__(self, registry: AdapterRegistry, pending: PendingRegistrations | None = None) -> None:
        self.registry = registry
        self.pending = pending

    def served(self) -> ServedChampion | None:
        if self.pending is not None and self.pending.pending():
            return None
        return self.registry.served()

    def download(self, version: str, destination: Path) -> Path:
        return self.registry.download(version, destination)

    def version_of(self, sha256: str) -> str | None:
        """The oldest version holding these weights, or None."""
        return self.registry.version_of(sha256)
