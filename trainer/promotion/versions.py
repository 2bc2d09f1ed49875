"""The trainer's version directories: every adapter it promotes or adopts is `adapters_dir/vNNNN`.

    versions = VersionDirs(data_dir / "adapters")       # versions.next: 1 + the highest number in use
    promoted = versions.promote(trainer.save, token_ids, candidate=..., champion=..., ...)  # -> AdapterVersion
    path = versions.install(versions.take(), downloaded, registry_version="7")       # an adoption
    versions.find(sha256)       # 4: the local number of a version whose weights hash to sha256

A version directory is what a server loads (adapters.AdapterDir): PEFT's adapter_config.json and
adapter_model.safetensors, draft_ngrams.json (the n-gram index of the lineage's recent outputs, when
given), checksum.sha256 (sha256sum format, `sha256sum -c` checks the weights and the index),
draft_vocab.json, and adaptive_spec_adapter.json with DraftTrainer's metadata plus what the online
trainer adds (`version`, `parent_version`, `parent_sha256`, `parent_registry_version`,
`base_version`, `gate`, `loss`, `domain_mix`, `adapter_sha256`, `ngrams_sha256`; `registry_version`
and `adopted_*` for a version adopted from the registry). Each is written as `.vNNNN.tmp`, then
renamed, and a rename never replaces a directory that exists, so a crash leaves no half-written
version and no number is reused.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from adaptive_spec.contracts import version_dir_name
from adaptive_spec.formats.adapters import AdapterDir, trainer_versions
from trainer.evaluation.gate import GateFigures


@dataclass(frozen=True)
class AdapterVersion:
    """A promoted adapter, as handed to `on_promote` (e.g. to register it in MLflow)."""

    version: int
    path: Path  # adapters_dir / "vNNNN"
    candidate: GateFigures  # this adapter on the held-out set
    champion: GateFigures  # the adapter it replaced (or the base draft) on the same positions
    loss: float  # mean training loss over its last round
    sha256: str  # of adapter_model.safetensors
    domain_mix: dict[str, int]  # distinct records of its last round, by domain
    parent_version: int | None  # None: trained from the base draft
    parent_sha256: str | None = None  # the weights it was trained from (None: the base draft)

    @property
    def name(self) -> str:
        return self.path.name


class VersionDirs:
    def __init__(self, adapters_dir: Path, next_number: int = 1) -> None:
        self.root = Path(adapters_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.next = max(next_number, max(trainer_versions(self.root), default=0) + 1)  # never reuse a directory

    def take(self) -> int:
        """The number of the next version; numbers are never given twice."""
        number, self.next = self.next, self.next + 1
        return number

    def path(self, number: int) -> Path:
        return self.root / version_dir_name(number)

    def find(self, sha256: str) -> int | None:
        """The number of the version whose weights hash to sha256 (one promoted or adopted before), or None."""
        for number, version in trainer_versions(self.root).items():
            if version.metadata().adapter_sha256 == sha256:
                return number
        return None

    def write(
        self, number: int, save: Callable[[Path], object], vocab: list[int], ngrams: dict | None = None, **metadata
    ) -> tuple[Path, str]:
        """`save(directory)` writes the adapter (PEFT's, or an EAGLE-3 head's checkpoint); then `vocab` (not for an
        EAGLE-3 head: its checkpoint's d2t is its draft vocabulary) and the n-gram index (when given) are written and
        it is all sealed with `metadata` (the checksum covers the weights, the vocabulary and the index). Returns
        (the version's path, the weights' sha256)."""
        staged = self._staging(number)
        save(staged)
        adapter = AdapterDir(staged)
        if not adapter.standard:
            adapter.write_vocab(vocab)
        if ngrams:
            adapter.write_ngrams(ngrams)
        digest = adapter.seal(**metadata)
        return self._publish(staged, number), digest

    def promote(
        self,
        save: Callable[[Path], object],
        vocab: list[int],
        *,
        candidate: GateFigures,
        champion: GateFigures,
        loss: float,
        domain_mix: dict[str, int],
        parent_version: int | None,
        parent_sha256: str | None,
        gate: dict,
        ngrams: dict | None = None,
        **metadata,
    ) -> AdapterVersion:
        """The next version, with the gate's figures (`gate` adds the reason and the thresholds) and
        the n-gram index of its lineage's recent outputs (`ngrams`, None: it ships none)."""
        number = self.take()
        figures = {"candidate": candidate.as_dict(), "champion": champion.as_dict(), **gate}
        path, sha256 = self.write(
            number,
            save,
            vocab,
            ngrams,
            version=number,
            parent_version=parent_version,
            parent_sha256=parent_sha256,
            loss=loss,
            domain_mix=domain_mix,
            gate=figures,
            **metadata,
        )
        return AdapterVersion(
            number, path, candidate, champion, loss, sha256, domain_mix, parent_version, parent_sha256
        )

    def install(self, number: int, downloaded: Path, **metadata) -> Path:
        """A copy of a downloaded version, with `metadata` added to its own."""
        staged = self._staging(number)
        shutil.copytree(downloaded, staged)
        AdapterDir(staged).update_metadata(**metadata)
        return self._publish(staged, number)

    def _staging(self, number: int) -> Path:
        staged = self.root / f".{version_dir_name(number)}.tmp"
        shutil.rmtree(staged, ignore_errors=True)
        return staged

    def _publish(self, staged: Path, number: int) -> Path:
        final = self.path(number)
        os.rename(staged, final)  # fails rather than overwrite an existing version
        return final
