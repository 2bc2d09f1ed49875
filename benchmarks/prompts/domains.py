"""The ``sql``, ``python`` and ``casual_chat`` sets: a frame of the domain around a template with its slots
filled (templates/sql.json, python.json, casual_chat.json)."""

from __future__ import annotations

from benchmarks.prompts.draw import Rng, fill_slots, load_template

SQL = load_template("sql")
PYTHON = load_template("python")
CASUAL = load_template("casual_chat")


def sql_prompt(index: int, rng: Rng) -> str:
    schema = SQL["schemas"][index % len(SQL["schemas"])]
    table = rng.choice(schema["tables"])
    create = f"CREATE TABLE {table} (\n    " + ",\n    ".join(schema["columns"]) + "\n);"
    question = fill_slots(rng.choice(schema["questions"]), rng, SQL["slots"])
    if rng.chance(0.25):
        question += rng.choice(SQL["dialects"])
    return rng.choice(SQL["frames"]).format(schema=create, question=question)


def python_prompt(index: int, rng: Rng) -> str:
    spec = PYTHON["specs"][index % len(PYTHON["specs"])]
    behaviour = fill_slots(spec["behaviour"], rng, PYTHON["slots"])
    text = rng.choice(PYTHON["frames"]).format(name=spec["name"], params=spec["params"], behaviour=behaviour)
    return text + rng.choice(PYTHON["extras"])


def casual_prompt(index: int, rng: Rng) -> str:
    template = CASUAL["templates"][index % len(CASUAL["templates"])]
    body = fill_slots(template, rng, CASUAL["slots"])
    opener = rng.choice(CASUAL["openers"])
    # After an opener that continues the sentence ("Okay so ", "Hi there, "), lower-case the
    # first word -- except the pronoun "I".
    continues = opener and not opener.endswith(("! ", ". "))
    if continues and not body.startswith(("I ", "I'")):
        body = body[0].lower() + body[1:]
    return opener + body + rng.choice(CASUAL["closers"])
