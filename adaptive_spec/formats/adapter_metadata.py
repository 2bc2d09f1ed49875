"""An adapter version's metadata, adaptive_spec_adapter.json: who trained it, from what, and the gate's figures.

    metadata = AdapterMetadata.read(version_dir)     # an empty record for a plain PEFT directory
    metadata.gate["candidate"]["greedy_match"]       # 0.63: the candidate's held-out match at promotion
    metadata.updated(registry_version="7").write(version_dir)   # every other key kept as it was

One record, one reader (`read`, `from_json`) and one writer (`write`, `to_json`) for a file that
crosses processes (STYLE.md §20): the trainer writes it (`TrainedWeights._save`, then
`AdapterDir.seal` and the version directories of trainer/promotion/versions.py), MLflow stores it
with the weights, the registry turns it into a run's params, metrics and tags (registry/records.py),
and servers read the gate's figures from it when they load a version (engine, dashboard).

The keys are a contract: the JSON holds exactly the keys it held before this type existed. Each
named field is a key the trainer writes; a key this type does not name (a hand-made adapter's, a
newer trainer's) is kept in `extra`, and a key written as null is kept as null (`nulls`), so a
round trip writes the same object back:

    AdapterMetadata.from_json(text).to_json() == text   # for any text `to_json` wrote

Values are kept as the file holds them, unconverted: the annotations say what the trainer writes,
and a hand-made file whose "version" is "7" reads as the string "7", as it did when readers held a
dict. A key the file does not hold reads as None.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptive_spec.contracts import METADATA_FILE


class MetadataError(ValueError):
    """adaptive_spec_adapter.json does not parse, or is not a JSON object. `AdapterDir.metadata` turns it into
    an `AdapterError` with reason "corrupt", the reason a server and the trainer refuse such a version for."""


@dataclass(frozen=True)
class AdapterMetadata:
    # What it was trained for and how (TrainedWeights._save, trainer/learning/distill.py).
    format: int | None = None  # 1
    created_at: float | None = None  # unix time of the save
    target_id: str | None = None  # "smollm2-135m-instruct"; a server refuses another target's adapter
    draft_id: str | None = None  # "head", "early-exit:4"
    draft_config: dict[str, Any] | None = None  # the draft's shape: model_type, num_hidden_layers, ...
    settings: dict[str, Any] | None = None  # the LoraSettings (or HeadSettings) it trained with
    init_adapter: str | None = None  # the directory it started from (None: the base draft)
    steps: int | None = None  # optimiser steps, over its whole lineage in this trainer
    records_used: int | None = None  # distinct records trained on
    tokens_used: int | None = None  # their output positions
    positions_trained: int | None = None  # with repeats
    target_state_forwards: int | None = None  # a head's: target passes run for its states
    # Where it sits in the lineage and why it was promoted (VersionDirs.promote, trainer/loop/rounds.py).
    version: int | None = None  # the trainer's number: v0003 -> 3
    parent_version: int | None = None  # the trainer's number of the champion it was trained from
    parent_sha256: str | None = None  # that champion's weights (None: the base draft)
    parent_registry_version: str | None = None  # that champion's registry version, when it had one
    base_version: str | int | None = None  # an opaque label of what the lineage started from
    domain: str | None = None  # the domain it serves ("sql"); None: the general adapter
    round: int | None = None  # the training round that made it
    round_steps: int | None = None  # optimiser steps of that round
    loss: float | None = None  # mean training loss over that round
    first_loss: float | None = None
    last_loss: float | None = None
    gate: dict[str, Any] | None = None  # {"candidate": GateFigures, "champion": GateFigures, "reason", "margin", ...}
    domain_mix: dict[str, int] | None = None  # distinct records of its last round, by domain
    records_consumed: int | None = None  # records the trainer had read from the stream
    tokens_consumed: int | None = None
    # What the files hash to (AdapterDir.seal; contracts.SHA_TAG, NGRAMS_SHA_KEY, VOCAB_SHA_KEY).
    adapter_sha256: str | None = None  # adapter_model.safetensors
    ngrams_sha256: str | None = None  # draft_ngrams.json, when it ships one
    vocab_sha256: str | None = None  # draft_vocab.json, when it ships one (versions sealed before: none)
    # A version adopted from the registry (the champion moved there; trainer/promotion/champion.py).
    registry_version: str | None = None
    adopted_at: float | None = None
    adopted_by: str | None = None
    adopted_as: int | None = None
    # Keys this type does not name, kept as written; and the named keys written as null.
    extra: dict[str, Any] = field(default_factory=dict)
    nulls: frozenset[str] = frozenset()

    # ---------------------------------------------------------------- reading

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AdapterMetadata:
        named = {key: value for key, value in data.items() if key in _NAMED}
        extra = {key: value for key, value in data.items() if key not in _NAMED}
        nulls = frozenset(key for key, value in named.items() if value is None)
        return cls(**named, extra=extra, nulls=nulls)

    @classmethod
    def from_json(cls, text: str) -> AdapterMetadata:
        """MetadataError if `text` is not a JSON object."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MetadataError(f"unreadable {METADATA_FILE}: {exc}") from None
        if not isinstance(data, dict):
            raise MetadataError(f"{METADATA_FILE} is not a JSON object")
        return cls.from_dict(data)

    @classmethod
    def read(cls, adapter_dir: str | Path) -> AdapterMetadata:
        """The directory's adaptive_spec_adapter.json, or an empty record when it has none (a plain PEFT
        directory). MetadataError, naming the directory, when it is there and does not parse."""
        file = Path(adapter_dir) / METADATA_FILE
        if not file.is_file():
            return cls()
        try:
            return cls.from_json(file.read_text())
        except (OSError, UnicodeDecodeError) as exc:
            raise MetadataError(f"{adapter_dir}: unreadable {METADATA_FILE}: {exc}") from None
        except MetadataError as exc:
            raise MetadataError(f"{adapter_dir}: {exc}") from None

    @property
    def empty(self) -> bool:
        """No key at all: no file, or `{}`."""
        return not self.to_dict()

    @property
    def gated_greedy_match(self) -> float | None:
        """The candidate's held-out greedy match when the gate promoted it: where a server's dynamic k
        starts for this version (None: no gate figures)."""
        return ((self.gate or {}).get("candidate") or {}).get("greedy_match")

    def describe(self) -> dict[str, Any]:
        """What an operator looks at for a version: the gate's figures, the loss, the lineage, the traffic."""
        return {
            "gate": self.gate or {},
            "loss": self.loss,
            "parent_version": self.parent_version,
            "domain_mix": self.domain_mix,
            "records_consumed": self.records_consumed,
        }

    # ---------------------------------------------------------------- writing

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: every named key that has a value or was written as null, then `extra`."""
        named = {key: getattr(self, key) for key in _NAMED if getattr(self, key) is not None or key in self.nulls}
        return {**named, **self.extra}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def updated(self, **fields: Any) -> AdapterMetadata:
        """This record with `fields` set (a None value is written as null); any key, named or not."""
        return AdapterMetadata.from_dict({**self.to_dict(), **fields})

    def write(self, adapter_dir: str | Path) -> None:
        (Path(adapter_dir) / METADATA_FILE).write_text(self.to_json())


_NAMED = frozenset(f.name for f in dataclasses.fields(AdapterMetadata)) - {"extra", "nulls"}
