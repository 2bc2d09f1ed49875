"""LoRA adapters on the draft: one version on disk (`AdapterDir`), checked, merged into a fresh
slot, swapped between steps.

    version = AdapterDir(data_dir / "adapters" / "v0003")
    version.seal(version=3, gate=...)   # the trainer: checksum.sha256 and the metadata's adapter_sha256
    version.verify(expected_sha256=sha)  # a server or the trainer, before trusting downloaded files
    version.metadata().gate             # who trained it, from what, and the gate's figures (adapter_metadata.py)
    engine.load_adapter(version.path)   # read_adapter -> lora_pairs -> check -> merge_into_slot

An adapter version is a standard PEFT directory (`adapter_config.json`, `adapter_model.safetensors`), or for
an EAGLE-3 head (`--draft eagle3`) a speculators checkpoint (`config.json`, `model.safetensors`, formats/eagle3.py:
what vLLM and SGLang load as it is), plus `adaptive_spec_adapter.json` (metadata), `checksum.sha256` (sha256sum format), and optionally
`draft_vocab.json`: the tokens recent traffic used, to which the draft's LM head is restricted
while this adapter is served (`DraftVocab.restrict`), and `draft_ngrams.json`: the
n-gram index of the lineage's recent outputs that free drafts copy from (drafters/ngram_index.py,
`AdapterSlot.ngrams`). Both are checked like the weights: `seal` lists them in checksum.sha256 and
the metadata (`ngrams_sha256`, `vocab_sha256`), and `verify` refuses a file that does not hash to
them, and one they list that is gone. A sealed directory holding an index it does not list is
refused too; a vocabulary it does not list is accepted, because versions sealed before vocabularies
were covered wrote theirs after the seal (a vocabulary only narrows what the draft may propose:
whatever it says, the target verifies every token). The file names are
contracts (adaptive_spec/contracts.py): the trainer writes these directories, MLflow stores them as
a run's artifacts, and servers download and load them. Every check of such a directory is here, so
a trainer adopting a version and a server swapping to it refuse the same files for the same reasons.

Loading never touches the layers being served:

1. check the files, the checksum, and that every LoRA weight fits a module of the draft with
   the right shape (`check`); any failure raises `AdapterError` and nothing changes;
2. build a new slot: a copy of the draft's *base* layers with `W += scaling * B @ A` merged in
   (`merge_into_slot`), so an adapted draft step costs exactly what a base step costs;
3. swap: under the engine's step lock, point the draft at the new slot and clear the draft's
   KV cache (it was computed with the old weights; the next step re-feeds the context). The
   lock is held for a pointer exchange, so the pause between two decoding steps is tiny;
4. drop the old slot.

The target is never modified: early-exit drafts own private copies of their layers, and the
shared embedding, norm and LM head carry no LoRA weights (a check refuses adapters that do).
Outputs stay lossless whatever the draft's weights, because the target verifies every token.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from pathlib import Path

import torch

from adaptive_spec.contracts import (
    CHECKSUM_FILE,
    CONFIG_FILE,
    EAGLE3_CONFIG_FILE,
    EAGLE3_WEIGHTS_FILE,
    METADATA_FILE,
    NGRAMS_FILE,
    NGRAMS_SHA_KEY,
    SHA_TAG,
    SIGNATURE_FILE,
    VOCAB_FILE,
    VOCAB_SHA_KEY,
    WEIGHTS_FILE,
)
from adaptive_spec.formats.adapter_metadata import AdapterMetadata, MetadataError

_VERSION_DIR = re.compile(r"v(\d+)")

REASONS = ("missing", "checksum", "corrupt", "incompatible", "signature")
SIGNATURE_SCHEME = "hmac-sha256"  # why an adapter is refused (a metric label)


class AdapterError(ValueError):
    """An adapter that cannot be served: missing, corrupt, or not shaped for this draft.

    `reason` is one of REASONS: "missing" (files not there), "checksum" (the weights are not what
    was recorded), "corrupt" (a file does not parse), "incompatible" (another model's adapter) or
    "signature" (unsigned, or not signed with this deployment's key: `check_signature`).
    """

    def __init__(self, message: str, reason: str = "incompatible") -> None:
        super().__init__(message)
        self.reason = reason


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class AdapterDir:
    """One adapter version on disk: the trainer writes it, the registry stores it, servers load it.

    It carries many public methods because each file of a version has its writer, its reader and its
    check here (STYLE.md §20), so the trainer and a server refuse the same directory for the same reason."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"AdapterDir({str(self.path)!r})"

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def standard(self) -> bool:
        """Whether this is an EAGLE-3 head version: a speculators checkpoint's config.json and model.safetensors in
        place of PEFT's adapter_config.json and adapter_model.safetensors; every other file, and every check, the
        same."""
        return not (self.path / CONFIG_FILE).is_file() and (self.path / EAGLE3_CONFIG_FILE).is_file()

    @property
    def weights(self) -> Path:
        return self.path / (EAGLE3_WEIGHTS_FILE if self.standard else WEIGHTS_FILE)

    @property
    def config(self) -> Path:
        return self.path / (EAGLE3_CONFIG_FILE if self.standard else CONFIG_FILE)

    @property
    def ngrams_file(self) -> Path:
        return self.path / NGRAMS_FILE

    @property
    def vocab_file(self) -> Path:
        return self.path / VOCAB_FILE

    # ---------------------------------------------------------------- writing

    def seal(self, **fields) -> str:
        """After PEFT's save_pretrained (and write_ngrams and write_vocab, for a version that ships an
        index or a vocabulary): write checksum.sha256, one line per file it covers, and the metadata
        (with `fields` merged in, adapter_sha256, ngrams_sha256 and vocab_sha256 set). Returns the
        weights' sha256."""
        digests = {self.weights.name: sha256_file(self.weights)}
        shipped = {}
        for file, key in ((self.ngrams_file, NGRAMS_SHA_KEY), (self.vocab_file, VOCAB_SHA_KEY)):
            if file.is_file():
                digests[file.name] = shipped[key] = sha256_file(file)
        (self.path / CHECKSUM_FILE).write_text("".join(f"{digest}  {name}\n" for name, digest in digests.items()))
        self.update_metadata(**{**fields, SHA_TAG: digests[self.weights.name], **shipped})
        return digests[self.weights.name]

    def update_metadata(self, **fields) -> AdapterMetadata:
        """The metadata with `fields` set, written back; every other key kept as it was."""
        metadata = self.metadata().updated(**fields)
        metadata.write(self.path)
        return metadata

    def write_vocab(self, token_ids: list[int]) -> None:
        (self.path / VOCAB_FILE).write_text(json.dumps({"token_ids": token_ids}) + "\n")

    def write_ngrams(self, index: dict[tuple[int, ...], list[int]]) -> None:
        """The n-gram index (drafters/ngram_index.py) as {"ngrams": [[n-gram, continuation], ...]};
        before `seal`, which covers it."""
        pairs = [[list(ngram), list(continuation)] for ngram, continuation in index.items()]
        self.ngrams_file.write_text(json.dumps({"ngrams": pairs}, separators=(",", ":")) + "\n")

    # ---------------------------------------------------------------- reading and checking

    def metadata(self) -> AdapterMetadata:
        """adaptive_spec_adapter.json (adapter_metadata.py), empty when there is none (a plain PEFT
        directory); AdapterError with reason "corrupt" when it does not parse."""
        try:
            return AdapterMetadata.read(self.path)
        except MetadataError as exc:
            raise AdapterError(str(exc), "corrupt") from None

    def verify(self, expected_sha256: str | None = None, *, require_checksum: bool = True) -> str:
        """The files are there and the weights hash to what checksum.sha256, the metadata's
        adapter_sha256 and `expected_sha256` (e.g. the registry's tag) say; so does the n-gram index,
        and the vocabulary, when there are, to their own lines (`_verify_shipped`). Returns the
        weights' sha256.

        Example: weights hashing to 9f2c... with a checksum.sha256 of 9f2c... and metadata naming
        41aa... fail with reason "checksum": one of the three was changed after the trainer sealed it.
        Without `require_checksum` a directory with no checksum.sha256 passes (a hand-made adapter).
        Last, every weight must be a finite number (`_check_finite`, reason "corrupt").
        """
        missing = AdapterError(
            f"{self.path}: not an adapter directory (needs {CONFIG_FILE} and {WEIGHTS_FILE}, or an EAGLE-3 head's "
            f"{EAGLE3_CONFIG_FILE} and {EAGLE3_WEIGHTS_FILE})",
            "missing",
        )
        if not self.weights.is_file():
            raise missing
        sealed = (self.path / CHECKSUM_FILE).is_file()
        if require_checksum and not sealed:
            raise AdapterError(f"{self.path}: no {CHECKSUM_FILE}", "missing")
        listed, metadata = self.checksums(), self.metadata()
        actual = sha256_file(self.weights)
        claims = {
            CHECKSUM_FILE: listed.get(self.weights.name, "") if sealed else None,
            METADATA_FILE: metadata.adapter_sha256,
            "the registry": expected_sha256,
        }
        check_claims(self.weights, actual, claims)
        if not self.config.is_file():  # after the checksum: corrupt weights say more than a lost config
            raise missing
        self._verify_shipped(self.ngrams_file, metadata.ngrams_sha256, listed, must_be_listed=sealed)
        self._verify_shipped(self.vocab_file, metadata.vocab_sha256, listed, must_be_listed=False)
        self._check_finite()
        return actual

    def _check_finite(self) -> None:
        """Every floating-point weight is finite. A checksum says the file is what its writer wrote, not
        that the writer was sane: a version with one NaN or Inf weight (a hand promotion, any MLflow
        writer) passed every other check, and its draft's probabilities were NaN, so torch.multinomial
        failed every sampled row of each batch step it drafted for."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.weights), framework="pt") as weights:
                bad = [name for name in weights.keys() if not _finite(weights.get_tensor(name))]  # noqa: SIM118 (safe_open is not iterable)
        except (SafetensorError, OSError) as exc:
            raise AdapterError(f"{self.path}: unreadable adapter: {exc}", "corrupt") from None
        if bad:
            raise AdapterError(f"{self.path}: {', '.join(bad[:3])} hold NaN or Inf weights", "corrupt")

    def _verify_shipped(
        self, file: Path, recorded: str | None, listed: dict[str, str], *, must_be_listed: bool
    ) -> None:
        """A file the version ships beside its weights hashes to its line of checksum.sha256 and to
        what the metadata `recorded` for it; one they list that is gone is missing. With
        `must_be_listed` (an n-gram index in a sealed directory) a file they do not list was added
        after sealing and is refused like changed weights.
        """
        claims = {CHECKSUM_FILE: listed.get(file.name), METADATA_FILE: recorded}
        if not file.is_file():
            if any(claims.values()):
                raise AdapterError(f"{self.path}: {file.name} is listed but missing", "missing")
            return
        if must_be_listed and claims[CHECKSUM_FILE] is None:
            raise AdapterError(f"{self.path}: {file.name} is not in {CHECKSUM_FILE}: added after sealing", "checksum")
        check_claims(file, sha256_file(file), claims)

    # ---------------------------------------------------------------- signing (ADAPTIVE_SPEC_SIGNING_KEY)

    def signed_manifest(self) -> bytes:
        """What a signature covers: checksum.sha256 (the weights, the n-gram index, the vocabulary), the
        sha256 of adapter_config.json (an EAGLE-3 head's config.json), and the metadata's target, draft and domain. Whoever can write to
        MLflow can rewrite all of them and the checksums with them; only the key's holder can sign the result.

        Example (one line each): "adaptive-spec adapter manifest 1", "9f2c...  adapter_model.safetensors",
        "config 41aa...", "target_id smollm2-135m-instruct", "draft_id head", "domain sql" (or "domain ")."""
        metadata = self.metadata()
        signed = (("target_id", metadata.target_id), ("draft_id", metadata.draft_id), ("domain", metadata.domain))
        checksum = self.path / CHECKSUM_FILE
        config = self.config
        lines = [
            "adaptive-spec adapter manifest 1",
            checksum.read_text(errors="replace").rstrip("\n") if checksum.is_file() else "",
            f"config {sha256_file(config) if config.is_file() else ''}",
            *(f"{key} {value or ''}" for key, value in signed),
        ]
        return ("\n".join(lines) + "\n").encode()

    def sign(self, key: str) -> None:
        """After `seal`: write signature.hmac, an HMAC-SHA256 with `key` over `signed_manifest()`."""
        digest = hmac.new(key.encode(), self.signed_manifest(), hashlib.sha256).hexdigest()
        (self.path / SIGNATURE_FILE).write_text(f"{SIGNATURE_SCHEME} {digest}\n")

    def check_signature(self, key: str) -> None:
        """After `verify` (so the checksums hold): signature.hmac is there and is this key's over the manifest;
        AdapterError with reason "signature" otherwise. Compared in constant time."""
        file = self.path / SIGNATURE_FILE
        if not file.is_file():
            raise AdapterError(
                f"{self.path}: unsigned ({SIGNATURE_FILE} missing), and this deployment signs every version",
                "signature",
            )
        scheme, _, given = file.read_text(errors="replace").strip().partition(" ")
        expected = hmac.new(key.encode(), self.signed_manifest(), hashlib.sha256).hexdigest()
        if scheme != SIGNATURE_SCHEME or not hmac.compare_digest(given.strip().encode(), expected.encode()):
            raise AdapterError(
                f"{self.path}: {SIGNATURE_FILE} is not this deployment's signature: forged or changed", "signature"
            )

    def checksums(self) -> dict[str, str]:
        """checksum.sha256 as {file name: sha256}, {} without one. A line without a file name is the
        weights' (hand-made adapters write the bare digest)."""
        file = self.path / CHECKSUM_FILE
        if not file.is_file():
            return {}
        listed = {}
        for line in file.read_text(errors="replace").splitlines():
            digest, _, name = line.strip().partition(" ")
            if digest:
                listed[name.strip().lstrip("*") or self.weights.name] = digest
        return listed

    def check_models(self, target_id: str, draft_id: str) -> None:
        """The metadata, when it names them, names this target and draft."""
        metadata = self.metadata()
        check_models(
            {"target_id": metadata.target_id, "draft_id": metadata.draft_id}, target_id, draft_id, str(self.path)
        )

    def read(self) -> tuple[dict, dict[str, torch.Tensor], AdapterMetadata]:
        """(adapter_config, LoRA tensors, metadata), or an EAGLE-3 head's (config.json, its tensors, metadata),
        verified (checksum.sha256 optional)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        self.verify(require_checksum=False)
        try:
            config = json.loads(self.config.read_text())
            tensors = load_file(str(self.weights))
        except (json.JSONDecodeError, SafetensorError, OSError, UnicodeDecodeError) as exc:
            raise AdapterError(f"{self.path}: unreadable adapter: {exc}", "corrupt") from None
        return config, tensors, self.metadata()

    def vocab(self, vocab_size: int) -> list[int] | None:
        """The draft vocabulary this version ships, or None when it ships none."""
        file = self.vocab_file
        if not file.is_file():
            return None
        try:
            ids = json.loads(file.read_text())["token_ids"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise AdapterError(f"{file}: unreadable draft vocabulary: {exc}", "corrupt") from None
        if not ids or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
            raise AdapterError(f"{file}: token_ids must be a non-empty list of ids in [0, {vocab_size})")
        return ids

    def ngrams(self, vocab_size: int) -> dict[tuple[int, ...], list[int]] | None:
        """The n-gram index this version ships (`AdapterSlot.ngrams`), or None when it ships none.
        Read after `verify`: this checks the shape, the checksum was checked there."""
        if not self.ngrams_file.is_file():
            return None
        try:
            pairs = json.loads(self.ngrams_file.read_text())["ngrams"]
            index = {tuple(ngram): list(continuation) for ngram, continuation in pairs}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
            raise AdapterError(f"{self.ngrams_file}: unreadable n-gram index: {exc}", "corrupt") from None
        if not all(_token_ids(ngram, vocab_size) and _token_ids(follow, vocab_size) for ngram, follow in index.items()):
            raise AdapterError(
                f"{self.ngrams_file}: n-grams and continuations must be non-empty lists of ids in [0, {vocab_size})"
            )
        return index


def check_claims(file: Path, actual: str, claims: dict[str, str | None]) -> None:
    """Every sha256 claimed for `file` (by checksum.sha256, the metadata, the registry; None: no
    claim) is `actual`; AdapterError with reason "checksum" names the first that is not."""
    for source, claimed in claims.items():
        if claimed is not None and claimed != actual:
            raise AdapterError(
                f"{file.parent}: checksum mismatch: {file.name} hashes to {actual[:12]}..., {source} "
                f"says {str(claimed)[:12]}...; the file is corrupt or was changed",
                "checksum",
            )


def _finite(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() or bool(torch.isfinite(tensor).all())


def _token_ids(ids, vocab_size: int) -> bool:
    """A non-empty sequence of token ids in [0, vocab_size)."""
    return bool(ids) and all(isinstance(t, int) and 0 <= t < vocab_size for t in ids)


def trainer_versions(adapters_dir: str | Path) -> dict[int, AdapterDir]:
    """The trainer's version directories (v0001, v0002, ...) by number; {} when there are none."""
    found = {}
    for path in Path(adapters_dir).glob("v*"):
        match = _VERSION_DIR.fullmatch(path.name)
        if match and path.is_dir():
            found[int(match[1])] = AdapterDir(path)
    return dict(sorted(found.items()))


def read_adapter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor], AdapterMetadata]:
    """(adapter_config, LoRA tensors, metadata) from a directory, with the checksum verified."""
    return AdapterDir(path).read()


def read_vocab(path: str | Path, vocab_size: int) -> list[int] | None:
    """The adapter's draft vocabulary, or None when it ships none."""
    return AdapterDir(path).vocab(vocab_size)


def read_ngrams(path: str | Path, vocab_size: int) -> dict[tuple[int, ...], list[int]] | None:
    """The adapter's n-gram index of recent outputs, or None when it ships none."""
    return AdapterDir(path).ngrams(vocab_size)


def check_models(fields: dict, target_id: str, draft_id: str, what: str) -> None:
    """`fields` (an adapter's metadata, or a registry version's tags), when they name a target and a
    draft, name these; AdapterError says which differs. `what` names the adapter in the message."""
    for key, ours in (("target_id", target_id), ("draft_id", draft_id)):
        if fields.get(key) not in (None, ours):
            raise AdapterError(f"{what} was trained for {key} {fields[key]!r}, not {ours!r}")
