"""Structured outputs: a JSON grammar per sequence, as a mask over the next token (llguidance).

    grammars = Grammars(tokenizer, vocab_size=49152, eos_ids={2})
    grammar = grammars.compile({"type": "json_schema", "json_schema": {"schema": {...}}})  # GrammarError: 400
    matcher = grammar.new_matcher()       # one per sequence (a copy of the compiled template, ~2 us)
    allowed = matcher.mask()              # bool [vocab]: True = the grammar allows this next token
    matcher.accept(token)                 # False, and no change, when the grammar forbids it
    matcher.rollback(n)                   # undo the last n accepted tokens

Why llguidance (measured on this CPU against xgrammar and outlines-core, README "Structured
outputs"): it refuses a schema it cannot enforce with a one-line message (`Unimplemented keys:
["not"]`), where the other two compiled some keywords and then ignored them; it compiles a
schema in 1-3 ms; a mask costs 14-43 us and an accepted token 2 us, well under 1% of a 31 ms
target step; and it rolls back, which speculative decoding needs. It has no torch dependency.

Two llguidance behaviours this module hides:

- consuming a forbidden token puts a matcher in a permanent error state, so `accept` tries the
  token first (`try_consume_tokens`), which refuses without changing the state;
- an EOS consumed after the document is complete is not recorded, so rolling it back would
  undo the closing brace instead. EOS never goes to llguidance: it is allowed exactly when the
  matcher is in an accepting state, and tracked here.

Whitespace between JSON elements follows a policy (`WHITESPACE`), `compact` by default, as OpenAI's
structured outputs write it: at most one space where JSON allows whitespace, so
`{"name": "Ada", "tags": ["x", "y"]}` and `{"name":"Ada"}` both pass but no newline or run of
spaces does. Each whitespace position would otherwise let a small model spend its budget there: the
default model answered a three-field schema with `\n\n,\n\n` between fields and ran out of a
96-token budget inside a string. `pretty` allows up to 8 spaces or newlines (indented output); any
policy is bounded, since unbounded whitespace allows ~160 tokens at each position and a small
model can loop on them.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np
import torch

WHITESPACE = {"compact": r"\x20?", "pretty": r"[\x20\x0A]{0,8}"}  # the JSON whitespace policies
MAX_SCHEMA_BYTES = 64 * 1024


class GrammarError(ValueError):
    """A response_format that cannot be enforced; the message is meant for the client."""


class Grammars:
    """Everything tied to one tokenizer and vocabulary, built once per engine (~0.5 s), with a
    cache of compiled grammars keyed by their schema."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, cache_size: int = 128, whitespace: str = "compact"):
        import llguidance
        import llguidance.hf  # not llguidance.torch: it compiles kernels at import (~3.5 s)

        if whitespace not in WHITESPACE:
            raise ValueError(f"JSON whitespace policy must be one of {', '.join(WHITESPACE)}, not {whitespace!r}")
        self.whitespace = WHITESPACE[whitespace]

        self._llg = llguidance
        eos = sorted({eos_ids} if isinstance(eos_ids, int) else set(eos_ids))
        if not eos:
            raise GrammarError("structured outputs need a model with an end-of-sequence token")
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos)
        self.words = (vocab_size + 31) // 32
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        space = self.tokenizer.tokenize_bytes(b" ")
        self.space = space[0] if len(space) == 1 else None  # a lone space's token (Matcher.forced guesses it)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, response_format) -> Grammar | None:
        """An OpenAI `response_format`, or a Lark grammar (`{"type": "grammar", "syntax": "lark",
        "definition": ...}`, what forced tool calls use: adaptive_spec/outputs/tools) -> a Grammar, or None when
        the output is free text."""
        lark = lark_of(response_format)
        schema = None if lark is not None else schema_of(response_format)
        if lark is None and schema is None:
            return None
        key = "lark:" + lark if lark is not None else json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
        if len(key.encode()) > MAX_SCHEMA_BYTES:
            raise GrammarError(f"response_format: the schema is over {MAX_SCHEMA_BYTES} bytes")
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            if lark is not None:
                spec = lark  # its %json schemas carry their own whitespace (tools/forcing.py)
            else:
                spec = self._llg.LLMatcher.grammar_from_json_schema(
                    key, overrides={"whitespace_pattern": self.whitespace}
                )
        except ValueError as exc:
            raise GrammarError(f"response_format: {exc}") from None
        template = self._llg.LLMatcher(self.tokenizer, spec, log_level=0)
        if template.is_error():
            raise GrammarError("response_format: the schema cannot be enforced: " + _first_line(template.get_error()))
        grammar = Grammar(self, template)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar


class Grammar:
    """A compiled response_format: immutable, shared by every sequence that uses it."""

    def __init__(self, grammars: Grammars, template):
        self.grammars = grammars
        self._template = template

    def new_matcher(self) -> Matcher:
        return Matcher(self.grammars, self._template.deep_copy())


class Matcher:
    """The grammar state of one sequence. Not thread-safe; distinct matchers are independent."""

    def __init__(self, grammars: Grammars, ll):
        self.grammars = grammars
        self.ll = ll
        self.ended = False  # an EOS was accepted (kept out of llguidance, see the module docstring)
        self.consumed = 0  # tokens accepted, EOS included: bounds a rollback
        self._bits = torch.empty(grammars.words, dtype=torch.int32)

    def mask(self) -> torch.Tensor:
        """The next-token mask, bool [vocab] (True = allowed); nothing once an EOS was accepted."""
        g = self.grammars
        if self.ended:
            return torch.zeros(g.vocab_size, dtype=torch.bool)
        self.ll.unsafe_compute_mask_ptr(self._bits.data_ptr(), g.words * 4)
        self._check()
        bits = np.unpackbits(self._bits.numpy().view(np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits.view(np.bool_)[: g.vocab_size].copy())
        allowed[list(g.eos_ids)] = self.ll.is_accepting()  # EOS exactly when the document may end
        return allowed

    def accept(self, token: int) -> bool:
        """Advance by one token; False, with the state unchanged, if the grammar forbids it."""
        if self.ended:
            return False
        if token in self.grammars.eos_ids:
            if not self.ll.is_accepting():
                return False
            self.ended = True
        elif self.ll.try_consume_tokens([token]) != 1:
            self._check()
            return False
        self.consumed += 1
        return True

    def forced(self, limit: int, guess_space: bool = True) -> list[int]:
        """At most `limit` tokens the grammar forces next: the bytes every allowed continuation starts
        with, in their usual tokenization (llguidance's fast-forward tokens); [] where the next token is
        a choice, or the document may end. Another tokenization of the same bytes stays allowed, so
        these are a guess, never tokens to emit unchecked (a good guess: the default model took them at
        all 321 such positions of 900 in its greedy tool calls, docs/benchmarks.md "What the grammar
        forces"). Example: in a forced tool call, once the function is named, `", "arguments": ` is
        forced; with a schema's required keys in order, each key. The matcher is left as it was.

        `guess_space`: where the forced bytes end at a space the whitespace policy leaves optional, go on
        as if the space were written (models write `": "`, `", "`, often `{ "` and `" }`): the bytes
        forced after it, with it, tokenized as usual; not before a `:` or `,`, which a space seldom
        precedes. The compact policy makes every space in JSON optional, so the forced bytes stopped at
        each one: after `{"city":` the guess is ` "`, after `"Porto",` it is ` "unit"` when that key must
        come next. Only a guess, like the rest, for the target to verify. Replayed along the default
        model's greedy outputs on the 24 held-out `tool_calls` prompts (up to 8 tokens at each position),
        the forced tokens that matched the output (summed over positions) went from 1015 to 1322, and those
        that did not from 24 to 145."""
        if self.ended or limit <= 0 or self.ll.is_accepting():
            return []
        fast = self.ll.compute_ff_tokens()[:limit]
        tokens = self._taken(fast)
        if guess_space and len(tokens) == len(fast) < limit and not self.ll.is_accepting():
            tokens += self._taken(self._after_space()[: limit - len(tokens)])
        self.rollback(len(tokens))
        return tokens

    def _taken(self, tokens: list[int]) -> list[int]:
        """The leading `tokens` the matcher accepts in turn, accepted (forced() rolls them back). Each is
        checked, though expected to pass: a refusal costs about 2 us."""
        taken = []
        for token in tokens:
            if token in self.grammars.eos_ids or not self.accept(token):
                break
            taken.append(token)
        return taken

    def _after_space(self) -> list[int]:
        """A space and the bytes the grammar forces after it, in their usual tokenization; [] where no space
        may come next, or nothing is forced after one (the matcher is left as it was)."""
        space = self.grammars.space
        if space is None or not self.accept(space):
            return []
        after = self.ll.compute_ff_bytes()
        self.rollback(1)
        if not after or after.startswith((b":", b",")):
            return []
        return self.grammars.tokenizer.tokenize_bytes(b" " + after)

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (an accepted EOS counts as one)."""
        if not 0 <= n <= self.consumed:
            raise ValueError(f"cannot roll back {n} tokens: {self.consumed} were accepted")
        if n == 0:
            return
        self.consumed -= n
        if self.ended:
            self.ended = False
            n -= 1
        if n and not self.ll.rollback(n):
            raise RuntimeError("grammar rollback failed: " + _first_line(self.ll.get_error()))

    def _check(self) -> None:
        if self.ll.is_error():  # not expected: only tokens tried first are consumed
            raise RuntimeError("grammar matcher failed: " + _first_line(self.ll.get_error()))


def schema_of(response_format) -> dict | None:
    """The JSON schema an OpenAI response_format asks for; None for free text."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise GrammarError("response_format must be an object")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise GrammarError('response_format.json_schema must be an object with a "schema" object')
        return spec["schema"]
    raise GrammarError(f"response_format.type must be text, json_object or json_schema, not {kind!r}")


def lark_of(response_format) -> str | None:
    """The Lark grammar of `{"type": "grammar", "syntax": "lark", "definition": "start: ..."}` (the shape
    of OpenAI's grammar-constrained custom tools); None for any other response_format."""
    if not isinstance(response_format, dict) or response_format.get("type") != "grammar":
        return None
    if response_format.get("syntax") != "lark" or not isinstance(response_format.get("definition"), str):
        raise GrammarError('a grammar response_format needs "syntax": "lark" and a "definition" string')
    return response_format["definition"]


def _first_line(message: str) -> str:
    return message.split("\n<state>", 1)[0].strip()
