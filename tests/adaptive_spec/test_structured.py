"""Structured outputs (`adaptive_spec.outputs.grammar`, llguidance) on the default model and its tokenizer.

Run alone with: ./run tests -m real_model -k structured   (fp32 CPU, a few minutes)

What must hold:

- the matcher: masks allow exactly what the grammar allows, EOS only once the document may end,
  a forbidden token is refused without harm, and rollback restores the state (what speculative
  decoding leans on);
- a schema that cannot be enforced is an InputError with the library's message;
- on 24 schemas with a prompt each, greedy output under the schema is identical with and without
  speculation (early exit and head drafts, batched), and every output parses and validates.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from adaptive_spec import Engine, InputError
from adaptive_spec.outputs.grammar import GrammarError, Grammars

pytestmark = pytest.mark.real_model


def obj(required: dict, **extra) -> dict:
    return {
        "type": "object",
        "properties": required,
        "required": list(required),
        "additionalProperties": False,
        **extra,
    }


NAME = {"type": "string", "maxLength": 20}
# 24 schemas: flat, nested, arrays, enums, numbers with bounds, patterns, anyOf and $ref.
SCHEMAS = [
    (obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}), "Maria Lopez is 34 years old."),
    (obj({"city": NAME, "country": NAME}), "I live in Lyon, France."),
    (obj({"title": NAME, "year": {"type": "integer"}}), "The film Alien came out in 1979."),
    (obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}}), "I loved this restaurant!"),
    (obj({"is_question": {"type": "boolean"}}), "Is the sky blue?"),
    (obj({"items": {"type": "array", "items": NAME, "maxItems": 3}}), "Buy milk, eggs and bread."),
    (obj({"total": {"type": "number"}, "currency": {"enum": ["USD", "EUR", "GBP"]}}), "The bill was 42.50 euros."),
    (obj({"user": obj({"name": NAME, "email": {"type": "string", "maxLength": 40}})}), "Contact Bob at bob@x.org."),
    (obj({"language": {"enum": ["python", "sql", "javascript", "other"]}}), "SELECT * FROM users;"),
    (obj({"steps": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}), "How do I boil an egg?"),
    (obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}), "Give an order code like ABC-123."),
    (
        obj({"temperature": {"type": "integer", "minimum": -50, "maximum": 60}, "unit": {"enum": ["C", "F"]}}),
        "It is 21 degrees Celsius outside.",
    ),
    (obj({"answer": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 20}]}}), "What is 6 times 7?"),
    (
        obj(
            {"point": {"$ref": "#/$defs/point"}},
            **{"$defs": {"point": obj({"x": {"type": "integer"}, "y": {"type": "integer"}})}},
        ),
        "The point is at x=3, y=4.",
    ),
    (
        obj({"tags": {"type": "array", "items": {"enum": ["urgent", "billing", "bug", "feature"]}, "maxItems": 2}}),
        "The invoice is wrong and I need it fixed now.",
    ),
    (obj({"first": NAME, "last": NAME, "middle": {"type": ["string", "null"], "maxLength": 20}}), "John Smith"),
    (obj({"rating": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": NAME}), "Great phone, 5 stars."),
    (
        obj({"from": NAME, "to": NAME, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
        "Flight from Paris to Rome on 2024-05-01.",
    ),
    (
        obj(
            {
                "ingredients": {
                    "type": "array",
                    "items": obj({"name": NAME, "grams": {"type": "integer"}}),
                    "maxItems": 2,
                }
            }
        ),
        "Pancakes need 200 g flour and 50 g sugar.",
    ),
    (obj({"ok": {"type": "boolean"}, "reason": NAME}), "Can I park here? No, it is a fire lane."),
    (
        obj({"keywords": {"type": "array", "items": {"type": "string", "maxLength": 15}, "maxItems": 3}}),
        "Summarise: machine learning on small devices.",
    ),
    (
        obj({"function": NAME, "args": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}}),
        "Call add with 2 and 3.",
    ),
    (
        {"type": "object", "properties": {"status": {"enum": ["open", "closed"]}}, "required": ["status"]},
        "The ticket was resolved yesterday.",
    ),
    (obj({"count": {"type": "integer", "minimum": 0}}), "How many legs does a spider have?"),
]
MAX_NEW = 160  # enough for every bounded field, even spelt out in multi-token characters


def request_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def messages(text: str) -> list[dict]:
    return [{"role": "user", "content": f"Answer in JSON. {text}"}]


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(draft="early-exit:4", device="cpu", dtype="fp32")


@pytest.fixture(scope="module")
def grammars(engine) -> Grammars:
    return Grammars(engine.tokenizer, engine.vocab_size, engine.eos_ids)


def test_a_matcher_allows_the_document_then_only_eos_and_rolls_back(engine, grammars):
    schema = SCHEMAS[0][0]
    document = '{"name": "Maria", "age": 34}'
    ids = engine.tokenizer.encode(document)
    matcher = grammars.compile(request_format(schema)).new_matcher()
    eos = next(iter(grammars.eos_ids))
    masks = []
    for token in ids:
        mask = matcher.mask()
        masks.append(mask)
        assert mask[token] and not mask[eos]
        forbidden = int((~mask).nonzero()[0])
        assert not matcher.accept(forbidden) and torch.equal(matcher.mask(), mask)  # refused, no harm
        assert matcher.accept(token)
    assert matcher.mask().nonzero().flatten().tolist() == [eos]  # complete: only EOS
    assert matcher.accept(eos) and not matcher.mask().any()
    matcher.rollback(4)  # EOS and the last three tokens
    for token, mask in zip(ids[-3:], masks[-3:], strict=True):
        assert torch.equal(matcher.mask(), mask) and matcher.accept(token)


@pytest.mark.parametrize(
    ("response_format", "phrase"),
    [
        (request_format({"type": "objekt"}), "Invalid type"),
        (request_format({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}), "not"),
        (request_format({"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}), "does not exist"),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
        ({"type": "yaml"}, "response_format.type"),
    ],
)
def test_a_schema_that_cannot_be_enforced_is_a_clear_input_error(engine, grammars, response_format, phrase):
    with pytest.raises(GrammarError, match=phrase):
        grammars.compile(response_format)
    with pytest.raises(InputError, match=phrase):
        engine.request(messages("hi"), response_format=response_format)


@pytest.fixture(scope="module")
def alone(engine) -> list[list[int]]:
    """The target alone under each schema, one request at a time."""
    return [
        engine.generate(messages(text), MAX_NEW, speculative=False, response_format=request_format(schema)).token_ids
        for schema, text in SCHEMAS
    ]


# Fixed k, so every row drafts under its mask at every step; at dynamic k an untrained draft mostly
# leaves the rows to plain decoding, and what they verify is the bytes their grammar forces (row.py
# `Row.forced_tail`), in the tokenization the grammar library picks, which the target may refuse.
@pytest.mark.parametrize(("draft", "k"), [("early-exit:4", 3), ("head", 3), ("early-exit:4", None)])
def test_constrained_greedy_equals_the_target_alone_and_every_output_validates(engine, alone, draft, k):
    speculative = engine if draft == "early-exit:4" else Engine(engine.target, draft, engine.tokenizer)
    requests = [
        speculative.request(messages(text), MAX_NEW, k=k, response_format=request_format(schema))
        for schema, text in SCHEMAS
    ]
    batch, outputs, index = speculative.new_batch(6), [None] * len(requests), {}
    waiting = list(range(len(requests)))
    while waiting or len(batch):
        while waiting and not batch.full:
            i = waiting.pop(0)
            index[batch.add(requests[i])] = i
        for row, chunk in batch.step():
            if chunk.output is not None:
                outputs[index.pop(row)] = chunk.output
    for i, (out, (schema, text)) in enumerate(zip(outputs, SCHEMAS, strict=True)):
        assert out.token_ids == alone[i], (draft, k, text)
        assert out.finish_reason == "stop", (text, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert sum(out.stats.drafted for out in outputs) > 0


# Schemas of the kind apps send, none of them from the shipped prompt sets: each must come back as
# complete, valid JSON within 96 tokens. With whitespace allowed up to 8 spaces or newlines at every
# gap ("pretty"), the recipe ran out of budget inside a string.
UNSEEN = [
    ("File a support ticket: my laptop screen flickers after the last update.",
     obj({"title": {"type": "string"}, "priority": {"type": "string", "enum": ["low", "medium", "high"]},
          "component": {"type": "string"}})),
    ("Give me a simple pancake recipe.",
     obj({"name": {"type": "string"}, "servings": {"type": "integer"},
          "ingredients": {"type": "array", "items": {"type": "string"}, "maxItems": 6}})),
    ("Extract the event: Team offsite in Lisbon on 12 March, 25 people.",
     obj({"city": {"type": "string"}, "date": {"type": "string"}, "attendees": {"type": "integer"},
          "kind": {"type": "string", "enum": ["meeting", "offsite", "conference"]}})),
    ("Summarize this review: The headphones sound great but the band broke in a week.",
     obj({"sentiment": {"type": "string", "enum": ["positive", "negative", "mixed"]},
          "pros": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
          "cons": {"type": "array", "items": {"type": "string"}, "maxItems": 3}})),
]  # fmt: skip  # one schema per entry reads better than the formatter's one key per line


def test_compact_json_on_schemas_nobody_here_wrote_parses_within_96_tokens(engine):
    assert engine.json_whitespace == "compact"  # the default policy
    for text, schema in UNSEEN:
        out = engine.generate([{"role": "user", "content": text}], 96, response_format=request_format(schema))
        document = json.loads(out.text)  # complete: not cut inside a string
        jsonschema.validate(document, schema)
        assert "\n" not in out.text and "  " not in out.text, out.text
