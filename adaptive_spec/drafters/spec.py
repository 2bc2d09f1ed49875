"""Draft specs: the one parser of the strings `--draft` and `Engine.from_pretrained(draft=...)` take.

    parse_draft_spec("early-exit:4")   # DraftSpec(kind="early-exit", layers=4)
    parse_draft_spec("ngram")          # DraftSpec(kind="ngram", max_ngram=3)
    parse_draft_spec("ngram:2")        # DraftSpec(kind="ngram", max_ngram=2)
    parse_draft_spec("head")           # DraftSpec(kind="head"): one layer over the target's hidden state
    parse_draft_spec("eagle3")         # DraftSpec(kind="eagle3"): a head in the standard EAGLE-3 layout
    parse_draft_spec("ngram+head")     # DraftSpec(kind="head", free_first=True): prompt lookup first
    parse_draft_spec("./my-draft")     # DraftSpec(kind="model", source="./my-draft"), loaded by name

The engine, the trainer and every benchmark read specs through here, so a spec means the same
thing everywhere and a bad one fails with the same message.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_NGRAM = 3  # the longest n-gram prompt lookup tries when the spec gives none


class DraftSpecError(ValueError):
    """A draft spec that cannot be parsed or does not fit the target."""


@dataclass(frozen=True)
class DraftSpec:
    kind: str  # "early-exit", "head", "eagle3", "ngram" or "model"
    layers: int = 0  # early-exit: how many of the target's layers
    max_ngram: int = 0  # ngram: the longest n-gram looked up
    source: str = ""  # model: a Hugging Face id, a local directory or a .gguf file
    free_first: bool = False  # ngram+<model draft>: prompt lookup first, the model otherwise

    @property
    def trainable(self) -> bool:
        """Whether the draft has weights an adapter can train (everything but prompt lookup)."""
        return self.kind != "ngram"

    def __str__(self) -> str:
        if self.free_first:
            return f"ngram+{DraftSpec(self.kind, self.layers, 0, self.source)}"
        if self.kind == "early-exit":
            return f"early-exit:{self.layers}"
        if self.kind == "ngram":
            return "ngram" if self.max_ngram == DEFAULT_NGRAM else f"ngram:{self.max_ngram}"
        if self.kind in ("head", "eagle3"):
            return self.kind
        return self.source


def parse_draft_spec(spec: str) -> DraftSpec:
    """Parse a draft spec; anything that is not a built-in kind names a separate draft model."""
    if not isinstance(spec, str) or not spec.strip():
        raise DraftSpecError(f"a draft spec must be a non-empty string, got {spec!r}")
    if spec.startswith("ngram+"):
        inner = parse_draft_spec(spec.removeprefix("ngram+"))
        if inner.kind == "ngram" or inner.free_first:
            raise DraftSpecError(f"ngram+ needs a model draft after it (ngram+head, ngram+early-exit:4); got {spec!r}")
        return DraftSpec(inner.kind, inner.layers, DEFAULT_NGRAM, inner.source, free_first=True)
    kind, sep, arg = spec.partition(":")
    if kind == "early-exit":
        if not arg.isdigit():  # the range (1 <= N < the target's layers) is checked against the target
            raise DraftSpecError(f"early-exit needs a layer count, e.g. early-exit:4; got {spec!r}")
        return DraftSpec("early-exit", layers=int(arg))
    if spec in ("head", "eagle3"):
        return DraftSpec(spec)
    if kind == "ngram":
        if sep and not (arg.isdigit() and int(arg) >= 1):
            raise DraftSpecError(f"ngram:N needs N >= 1, the longest n-gram to look up; got {spec!r}")
        return DraftSpec("ngram", max_ngram=int(arg) if sep else DEFAULT_NGRAM)
    return DraftSpec("model", source=spec)
