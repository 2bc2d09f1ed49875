"""The adapter metadata record (adaptive_spec/formats/adapter_metadata.py): adaptive_spec_adapter.json round-trips
exactly, unknown keys and nulls included; what `AdapterDir.seal` and `update_metadata` write parses back; a
malformed file is refused as it was before the record existed (AdapterError, reason "corrupt").

    .venv/bin/python -m pytest tests/adaptive_spec/test_adapter_metadata.py -q

The trainer's own writers (DraftTrainer, HeadTrainer, the version directories) are checked in
tests/trainer/test_metadata_writers.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from adapter_files import make_adapter
from tiny import tiny_target

from adaptive_spec.contracts import METADATA_FILE, NGRAMS_SHA_KEY, SHA_TAG, VOCAB_SHA_KEY
from adaptive_spec.formats.adapter_metadata import AdapterMetadata, MetadataError
from adaptive_spec.formats.adapters import AdapterDir, AdapterError, sha256_file

# As the online trainer writes a version (trainer/loop/rounds.py), plus two keys no trainer writes.
WRITTEN = {
    "format": 1,
    "target_id": "tiny-llama",
    "draft_id": "early-exit:1",
    "settings": {"r": 4, "alpha": 8, "lr": 0.001, "target_modules": ["q_proj", "v_proj"], "loss": "kl_topm"},
    "init_adapter": None,
    "version": 3,
    "parent_version": None,  # a null is kept as a null: the key stays in the file
    "domain": None,
    "loss": 1.25,
    "gate": {
        "candidate": {"greedy_match": 0.61, "expected_acceptance": 0.42, "positions": 432},
        "champion": {"greedy_match": 0.05, "expected_acceptance": 0.04, "positions": 432},
        "reason": "greedy match 0.61 beats 0.05",
    },
    "domain_mix": {"sql": 12, "untagged": 3},
    "note": "added by hand",  # not a field: kept in `extra`
    "review": {"by": "ops", "checks": [1, 2]},
}


def test_a_round_trip_keeps_every_key_unknown_ones_and_nulls_included():
    metadata = AdapterMetadata.from_dict(WRITTEN)
    assert metadata.to_dict() == WRITTEN
    assert metadata.extra == {"note": "added by hand", "review": {"by": "ops", "checks": [1, 2]}}
    text = metadata.to_json()
    assert json.loads(text) == WRITTEN and AdapterMetadata.from_json(text).to_json() == text
    assert AdapterMetadata.from_json(text) == metadata
    # Typed reads: a key the file holds, a null, and a key it does not hold (None, and not written).
    assert metadata.version == 3 and metadata.gated_greedy_match == 0.61 and metadata.settings["r"] == 4
    assert metadata.parent_version is None and metadata.steps is None and "steps" not in metadata.to_dict()
    assert metadata.describe() == {
        "gate": WRITTEN["gate"],
        "loss": 1.25,
        "parent_version": None,
        "domain_mix": {"sql": 12, "untagged": 3},
        "records_consumed": None,
    }


def test_updated_sets_keys_named_or_not_and_keeps_the_rest():
    metadata = AdapterMetadata.from_dict(WRITTEN)
    updated = metadata.updated(registry_version="7", adopted_by=None, note="changed", extra_key=[1])
    assert updated.to_dict() == {
        **WRITTEN,
        "registry_version": "7",
        "adopted_by": None,
        "note": "changed",
        "extra_key": [1],
    }
    assert metadata.to_dict() == WRITTEN, "a record is frozen: updated returns a new one"


def test_the_checksum_keys_of_the_contracts_are_fields():
    fields = {f.name for f in dataclasses.fields(AdapterMetadata)}
    assert {SHA_TAG, NGRAMS_SHA_KEY, VOCAB_SHA_KEY} <= fields


def test_what_seal_and_update_metadata_write_parses_back(tmp_path):
    path = tmp_path / "v0003"
    make_adapter(tiny_target(0), 1, path, seed=1)
    adapter = AdapterDir(path)
    adapter.write_vocab([1, 2, 3])
    digest = adapter.seal(**WRITTEN)
    file = path / METADATA_FILE
    read = AdapterMetadata.read(path)
    assert read.to_dict() == {**WRITTEN, SHA_TAG: digest, VOCAB_SHA_KEY: sha256_file(adapter.vocab_file)}
    assert read.to_json() == file.read_text() and read.adapter_sha256 == digest
    assert adapter.metadata() == read and adapter.verify() == digest

    adapter.update_metadata(registry_version="1", adopted_as=4)
    again = AdapterMetadata.read(path)
    assert again.to_dict() == {**read.to_dict(), "registry_version": "1", "adopted_as": 4}
    assert again.to_json() == file.read_text() and adapter.verify() == digest


def test_a_directory_without_metadata_reads_as_an_empty_record(tmp_path):
    assert AdapterMetadata.read(tmp_path).empty and AdapterDir(tmp_path).metadata() == AdapterMetadata()
    (tmp_path / METADATA_FILE).write_text("{}\n")
    assert AdapterMetadata.read(tmp_path).empty


@pytest.mark.parametrize(
    "content, message",
    [
        (b"{bad", "unreadable adaptive_spec_adapter.json: Expecting property name enclosed in double quotes"),
        (b"[1, 2]", "adaptive_spec_adapter.json is not a JSON object"),
        (b"\xff\xfe", "unreadable adaptive_spec_adapter.json: 'utf-8' codec can't decode byte 0xff"),
    ],
)
def test_a_malformed_file_is_refused_as_corrupt_naming_the_directory(tmp_path, content, message):
    (tmp_path / METADATA_FILE).write_bytes(content)
    with pytest.raises(MetadataError) as malformed:
        AdapterMetadata.read(tmp_path)
    assert str(malformed.value).startswith(f"{tmp_path}: {message}")
    with pytest.raises(AdapterError) as refused:  # what a server or the trainer sees, as before the record
        AdapterDir(tmp_path).metadata()
    assert refused.value.reason == "corrupt" and str(refused.value) == str(malformed.value)
