"""Generate the prompt sets shipped in ``benchmarks/prompts/`` from the templates in ``templates/``.

Run from the repository root with::

    .venv/bin/python -m benchmarks.prompts.make            # rewrites benchmarks/prompts/*.jsonl
    .venv/bin/python -m benchmarks.prompts.make OUT_DIR    # writes them elsewhere

which writes these JSON Lines files, one
``{"messages": [{"role": "user", "content": "..."}], "domain": "<tag>"}`` object a line:

* ``chat.jsonl`` -- 24 hand-written general chat prompts (domain ``chat``), used by
  ``adaptive-spec bench``.
* ``json_extraction.jsonl``, ``sql.jsonl``, ``python.jsonl``, ``casual_chat.jsonl`` --
  400 prompts each for the drift benchmark, built from templates x slot values so
  that answers are structurally alike within a domain while their contents differ.
* ``json_schema.jsonl`` -- the prompts of ``json_extraction.jsonl``, in the same order, each with
  a ``response_format`` whose JSON schema requires exactly the keys the prompt asks for (domain
  ``json_extraction``): structured outputs for ``adaptive-spec bench``.
* ``tool_calls.jsonl`` -- 400 agent requests (domain ``tool_calls``): each offers 2-4 of 8 tools
  (weather, flights, calendar, email, currency, products, reminders, orders) in OpenAI's ``tools``
  with a ``tool_choice``; 60% ask for one call (``required``, a quarter of them naming the
  function), 25% carry a finished call and its result and ask for a second call, 15% carry a call
  and its result and let the model answer (``auto``).

The words are data, in ``templates/``: ``pools.json`` (names, cities, products, ...), one file per
domain with its frames, templates and slots, and ``chat.json``. A slot in a domain file is a list
(one of its strings), ``{"pool": NAME}`` (one of a pool's), ``{"randint": [LOW, HIGH]}`` (a number
in that range) or ``{"like": SLOT}`` (drawn as SLOT is, but different from it); the few slots that
compute their value (dates, names, "an 8"-year-old) are `COMPUTED` below.

The output is deterministic: each domain has its own fixed seed, and the only primitive used is
``random.Random.random()``, whose sequence Python keeps stable across versions (``choice`` and
``randint`` are not). tests/benchmarks/test_prompt_sets.py checks that the shipped files are exactly
what this produces: edit the templates and re-run it, never the data files. Standard library only.
"""

from __future__ import annotations

import json
import random
import string
import sys
from collections.abc import Callable
from pathlib import Path

SEED = 20240611
DOMAIN_SIZE = 400
MAX_CHARS = 600
DEFAULT_OUT_DIR = Path(__file__).resolve().parent
TEMPLATES = DEFAULT_OUT_DIR / "templates"


def _load(name: str) -> dict:
    return json.loads((TEMPLATES / f"{name}.json").read_text(encoding="utf-8"))


POOLS = _load("pools")
CHAT = _load("chat")
JSON_EXTRACTION = _load("json_extraction")
SQL = _load("sql")
PYTHON = _load("python")
CASUAL = _load("casual_chat")
TOOLS = _load("tool_calls")


class Rng:
    """Small RNG wrapper built only on ``random.Random.random()`` (version-stable)."""

    def __init__(self, seed: int) -> None:
        self._r = random.Random(seed)

    def below(self, n: int) -> int:
        if n <= 0:
            raise ValueError("n must be positive")
        return min(int(self._r.random() * n), n - 1)

    def choice(self, seq):
        return seq[self.below(len(seq))]

    def randint(self, lo: int, hi: int) -> int:
        return lo + self.below(hi - lo + 1)

    def chance(self, p: float) -> bool:
        return self._r.random() < p

    def sample(self, seq, k: int) -> list:
        pool = list(seq)
        out = []
        for _ in range(k):
            out.append(pool.pop(self.below(len(pool))))
        return out

    def subset_in_order(self, seq, k_min: int) -> list:
        """A random subset of ``seq`` (keeping its order) with at least ``k_min`` items."""
        k = self.randint(k_min, len(seq))
        chosen = set(self.sample(range(len(seq)), k))
        return [x for i, x in enumerate(seq) if i in chosen]


# --------------------------------------------------------------------------- values drawn from the pools


def _pick(rng: Rng, pool: str):
    return rng.choice(POOLS[pool])


def _date(rng: Rng) -> str:
    day, month, year = rng.randint(1, 28), rng.below(12), rng.randint(2023, 2026)
    style, months = rng.below(3), POOLS["months"]
    if style == 0:
        return f"{months[month]} {day}, {year}"
    if style == 1:
        return f"{year}-{month + 1:02d}-{day:02d}"
    return f"{day} {months[month]} {year}"


def _time(rng: Rng) -> str:
    hour, minute = rng.randint(7, 21), rng.choice([0, 15, 30, 45])
    if rng.chance(0.5):
        return f"{hour:02d}:{minute:02d}"
    suffix = "am" if hour < 12 else "pm"
    return f"{(hour - 1) % 12 + 1}:{minute:02d} {suffix}"


def _person(rng: Rng) -> tuple[str, str]:
    return _pick(rng, "first_names"), _pick(rng, "last_names")


def _email(first: str, last: str, rng: Rng) -> str:
    local = rng.choice([f"{first}.{last}", f"{first[0]}{last}", f"{first}{rng.randint(1, 99)}"])
    local = "".join(c for c in local.lower() if c.isalnum() or c == ".")
    return f"{local}@{_pick(rng, 'email_domains')}"


def _phone(rng: Rng) -> str:
    return f"+1-{rng.randint(200, 989)}-{rng.randint(200, 989)}-{rng.randint(1000, 9999)}"


def _money(rng: Rng, lo: int, hi: int) -> str:
    return f"{rng.randint(lo, hi)}.{rng.choice(['00', '50', '99', '25', '75'])}"


# --------------------------------------------------------------------------- json_extraction
# Each kind draws its values (in a fixed order: the sequence of draws is what makes the files), then
# one of its texts in templates/json_extraction.json is filled with them.


def _order(rng: Rng) -> dict:
    first, last = _person(rng)
    product, price = _pick(rng, "products")
    qty = rng.randint(1, 9)
    order_id = f"{rng.choice(['A', 'B', 'K', 'T', 'X'])}{rng.randint(10000, 99999)}"
    date, city = _date(rng), _pick(rng, "cities")
    return dict(first=first, last=last, product=product, price=price, qty=qty, order_id=order_id, date=date, city=city)


def _contact(rng: Rng) -> dict:
    first, last = _person(rng)
    title, company = _pick(rng, "job_titles"), _pick(rng, "companies")
    email, phone, city = _email(first, last, rng), _phone(rng), _pick(rng, "cities")
    return dict(first=first, last=last, title=title, company=company, email=email, phone=phone, city=city)


def _event(rng: Rng) -> dict:
    event, venue, city = _pick(rng, "event_names"), _pick(rng, "venues"), _pick(rng, "cities")
    date, start = _date(rng), _time(rng)
    price = "free" if rng.chance(0.3) else f"${rng.randint(5, 60)}"
    first, last = _person(rng)
    capacity = rng.choice([40, 60, 80, 100, 150, 200, 250, 500])
    return dict(
        event=event,
        venue=venue,
        city=city,
        date=date,
        start=start,
        price=price,
        first=first,
        last=last,
        capacity=capacity,
    )


def _job(rng: Rng) -> dict:
    title, company, city = _pick(rng, "job_titles"), _pick(rng, "companies"), _pick(rng, "cities")
    lo = rng.randint(35, 120) * 1000
    hi = lo + rng.randint(5, 40) * 1000
    years = rng.randint(0, 8)
    mode = rng.choice(["remote", "hybrid", "on-site"])
    deadline = _date(rng)
    return dict(title=title, company=company, city=city, lo=lo, hi=hi, years=years, mode=mode, deadline=deadline)


def _hotel(rng: Rng) -> dict:
    first, last = _person(rng)
    hotel, room, city = _pick(rng, "hotels"), _pick(rng, "room_types"), _pick(rng, "cities")
    nights, guests = rng.randint(1, 10), rng.randint(1, 4)
    checkin, rate = _date(rng), _money(rng, 60, 390)
    conf = f"HB-{rng.randint(100000, 999999)}"
    return dict(
        first=first,
        last=last,
        hotel=hotel,
        room=room,
        city=city,
        nights=nights,
        guests=guests,
        checkin=checkin,
        rate=rate,
        conf=conf,
    )


def _shipment(rng: Rng) -> dict:
    first, last = _person(rng)
    carrier, city = _pick(rng, "carriers"), _pick(rng, "cities")
    tracking = f"{rng.choice(['1Z', 'JD', 'RR', 'CP'])}{rng.randint(10**8, 10**9 - 1)}"
    weight = f"{rng.randint(1, 25)}.{rng.randint(0, 9)}"
    date = _date(rng)
    status = rng.choice(JSON_EXTRACTION["shipment_status"])
    return dict(
        first=first, last=last, carrier=carrier, city=city, tracking=tracking, weight=weight, date=date, status=status
    )


def _review(rng: Rng) -> dict:
    first, last = _person(rng)
    product, _ = _pick(rng, "products")
    stars = rng.randint(1, 5)
    good = rng.choice(JSON_EXTRACTION["review_words"]["good"])
    bad = rng.choice(JSON_EXTRACTION["review_words"]["bad"])
    days = rng.randint(2, 120)
    recommend = "yes" if stars >= 3 else "no"
    again = "I would buy it again." if stars >= 3 else "Not buying again."
    return dict(
        first=first,
        last=last,
        product=product,
        stars=stars,
        good=good,
        bad=bad,
        days=days,
        recommend=recommend,
        again=again,
    )


def _invoice(rng: Rng) -> dict:
    company, client = rng.sample(POOLS["companies"], 2)
    number = f"INV-{rng.randint(2023, 2026)}-{rng.randint(100, 999)}"
    amount, tax = _money(rng, 150, 9800), rng.choice([0, 5, 7, 10, 19, 20, 21])
    issued, due = _date(rng), rng.choice([14, 30, 45, 60])
    currency = rng.choice(["USD", "EUR", "GBP", "CAD"])
    return dict(
        company=company, client=client, number=number, amount=amount, tax=tax, issued=issued, due=due, currency=currency
    )


JSON_KINDS: list[tuple[str, Callable[[Rng], dict]]] = [
    ("order", _order),
    ("contact", _contact),
    ("event", _event),
    ("job", _job),
    ("hotel", _hotel),
    ("shipment", _shipment),
    ("review", _review),
    ("invoice", _invoice),
]


def _json_prompt_and_fields(index: int, rng: Rng) -> tuple[str, list[str]]:
    name, values_of = JSON_KINDS[index % len(JSON_KINDS)]
    kind = JSON_EXTRACTION["kinds"][name]
    values = values_of(rng)
    text = rng.choice(kind["texts"]).format(**values)
    fields = rng.subset_in_order(kind["fields"], 4)
    quote = rng.choice(['"{}"', "{}"])
    field_list = ", ".join(quote.format(f) for f in fields)
    return rng.choice(JSON_EXTRACTION["frames"]).format(fields=field_list, text=text, label=kind["label"]), fields


def _json_prompt(index: int, rng: Rng) -> str:
    return _json_prompt_and_fields(index, rng)[0]


def json_schema_format(fields: list[str]) -> dict:
    """OpenAI's response_format asking for an object with exactly `fields`; a value as the prompts allow
    it: text, a number, true/false, null ("Use null for anything missing") or a list of strings."""
    schema = {
        "type": "object",
        "properties": {field: JSON_EXTRACTION["value_schema"] for field in fields},
        "required": fields,
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": "extraction", "schema": schema}}


def build_json_schema_rows(seed: int) -> list[tuple[str, dict]]:
    """The json_extraction prompts (same seed, same order), each with its response_format."""
    fields_of: dict[str, list[str]] = {}

    def builder(index: int, rng: Rng) -> str:
        text, fields = _json_prompt_and_fields(index, rng)
        fields_of[text] = fields
        return text

    return [(text, json_schema_format(fields_of[text])) for text in build_domain(builder, seed)]


# --------------------------------------------------------------------------- slots

# The slots whose value is computed rather than picked (templates/*.json name the others).
COMPUTED: dict[str, Callable[[Rng], str]] = {
    "salary": lambda r: str(r.randint(4, 15) * 10000),
    "iso_date": lambda r: f"{r.randint(2019, 2025)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
    "iso_date2": lambda r: f"2026-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
    "product": lambda r: _pick(r, "products")[0],
    "full_name": lambda r: " ".join(_person(r)),
    "sample_name": lambda r: " ".join(_person(r)),
    "sensor": lambda r: f"S-{r.randint(1, 60):02d}",
    "pet_age": lambda r: (lambda n: ("an " if n in (8, 11) else "a ") + str(n))(r.randint(1, 12)),
    "wake_time": lambda r: r.choice(["5:30", "6:00", "6:30", "7:00"]) + " am",
    "hhmm": lambda r: f"{r.randint(8, 19):02d}:{r.choice(['00', '15', '30', '45'])}",
    "email": lambda r: _email(*_person(r), r),
    "order_id": lambda r: f"{r.choice(['A', 'B', 'K', 'T', 'X'])}{r.randint(10000, 99999)}",
}


def _slot(name: str, rng: Rng, slots: dict) -> str:
    spec = slots.get(name)
    if spec is None:
        return COMPUTED[name](rng)
    if isinstance(spec, list):
        return rng.choice(spec)
    if "pool" in spec:
        return _pick(rng, spec["pool"])
    if "randint" in spec:
        return str(rng.randint(*spec["randint"]))
    return _slot(spec["like"], rng, slots)


def _fill(template: str, rng: Rng, slots: dict) -> str:
    """Fill every ``{slot}`` of ``template``; slots sharing a pool (``city``/``city2``) differ."""
    return _filled(template, rng, slots)[0]


def _filled(template: str, rng: Rng, slots: dict) -> tuple[str, dict[str, str]]:
    """``template`` filled, and the value of each slot."""
    values: dict[str, str] = {}
    for _, name, _, _ in string.Formatter().parse(template):
        if name is None or name in values:
            continue
        value = _slot(name, rng, slots)
        base = name.rstrip("0123456789")
        for _ in range(50):
            taken = [v for k, v in values.items() if k.rstrip("0123456789") == base]
            if value not in taken:
                break
            value = _slot(name, rng, slots)
        values[name] = value
    return template.format(**values), values


# --------------------------------------------------------------------------- sql, python, casual_chat


def _sql_prompt(index: int, rng: Rng) -> str:
    schema = SQL["schemas"][index % len(SQL["schemas"])]
    table = rng.choice(schema["tables"])
    create = f"CREATE TABLE {table} (\n    " + ",\n    ".join(schema["columns"]) + "\n);"
    question = _fill(rng.choice(schema["questions"]), rng, SQL["slots"])
    if rng.chance(0.25):
        question += rng.choice(SQL["dialects"])
    return rng.choice(SQL["frames"]).format(schema=create, question=question)


def _python_prompt(index: int, rng: Rng) -> str:
    spec = PYTHON["specs"][index % len(PYTHON["specs"])]
    behaviour = _fill(spec["behaviour"], rng, PYTHON["slots"])
    text = rng.choice(PYTHON["frames"]).format(name=spec["name"], params=spec["params"], behaviour=behaviour)
    return text + rng.choice(PYTHON["extras"])


def _casual_prompt(index: int, rng: Rng) -> str:
    template = CASUAL["templates"][index % len(CASUAL["templates"])]
    body = _fill(template, rng, CASUAL["slots"])
    opener = rng.choice(CASUAL["openers"])
    # After an opener that continues the sentence ("Okay so ", "Hi there, "), lower-case the
    # first word -- except the pronoun "I".
    continues = opener and not opener.endswith(("! ", ". "))
    if continues and not body.startswith(("I ", "I'")):
        body = body[0].lower() + body[1:]
    return opener + body + rng.choice(CASUAL["closers"])


# --------------------------------------------------------------------------- tool_calls


def _tool(name: str) -> dict:
    spec = TOOLS["tools"][name]
    return {
        "type": "function",
        "function": {"name": name, "description": spec["description"], "parameters": spec["parameters"]},
    }


def _request(name: str, rng: Rng) -> tuple[str, dict]:
    """A user's request for tool `name`, and the arguments a correct call of it takes."""
    text, values = _filled(rng.choice(TOOLS["requests"][name]), rng, TOOLS["slots"])
    properties = TOOLS["tools"][name]["parameters"]["properties"]
    arguments: dict = {}
    for argument, slot in TOOLS["arguments"][name].items():
        if isinstance(slot, list):
            if any(s in values for s in slot):
                arguments[argument] = [values[s] for s in slot if s in values]
        elif slot in values:
            kind = properties[argument].get("type")
            arguments[argument] = int(values[slot]) if kind in ("integer", "number") else values[slot]
    return text, arguments


def _result(name: str, arguments: dict, rng: Rng) -> str:
    """What the tool answered, as JSON text."""
    fill = {**arguments, "n": rng.randint(10, 99), "small": rng.randint(1, 9)}
    fill |= {
        "sky": rng.choice(TOOLS["skies"]),
        "status": rng.choice(TOOLS["statuses"]),
        "product": arguments.get("query", ""),
    }
    return TOOLS["results"][name].format(**fill)


def _offered(names: list[str], rng: Rng) -> list[dict]:
    """The tools a line offers: `names` and 0-2 others, in a random order."""
    others = [n for n in TOOLS["tools"] if n not in names]
    chosen = names + rng.sample(others, rng.randint(0, 2))
    return [_tool(n) for n in rng.sample(chosen, len(chosen))]


def _tool_line(index: int, rng: Rng) -> dict:
    names = list(TOOLS["tools"])
    first = names[index % len(names)]
    text, arguments = _request(first, rng)
    kind = rng.below(20)
    if kind < 12:  # one call, required (a quarter of them naming the function)
        named = rng.chance(0.25)
        choice = {"type": "function", "function": {"name": first}} if named else "required"
        return {"messages": [{"role": "user", "content": text}], "tools": _offered([first], rng), "tool_choice": choice}
    call_id = f"call_{index:04d}"
    call = {"id": call_id, "type": "function", "function": {"name": first, "arguments": json.dumps(arguments)}}
    history = [
        {"role": "user", "content": text},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": _result(first, arguments, rng)},
    ]
    if kind < 17:  # a second request after the first call's result
        second = rng.choice([n for n in names if n != first])
        follow_up, _ = _request(second, rng)
        messages = [*history, {"role": "user", "content": follow_up}]
        return {"messages": messages, "tools": _offered([first, second], rng), "tool_choice": "required"}
    messages = [*history, {"role": "user", "content": rng.choice(TOOLS["follow_ups"])}]
    return {"messages": messages, "tools": _offered([first], rng), "tool_choice": "auto"}


def build_tool_lines(seed: int, count: int = DOMAIN_SIZE) -> list[dict]:
    """``count`` distinct tool-calling lines; the first tool rotates so any prefix is balanced."""
    rng, lines, seen, index = Rng(seed), [], set(), 0
    while len(lines) < count:
        line = _tool_line(index, rng)
        key = json.dumps(line["messages"])
        if key not in seen:
            seen.add(key)
            lines.append({**line, "domain": "tool_calls"})
            index += 1
    return lines


# --------------------------------------------------------------------------- writing
DOMAIN_BUILDERS: dict[str, tuple[str, Callable[[int, Rng], str], int]] = {
    # file stem: (domain tag, builder, per-domain seed offset)
    "json_extraction": ("json_extraction", _json_prompt, 1),
    "sql": ("sql", _sql_prompt, 2),
    "python": ("python", _python_prompt, 3),
    "casual_chat": ("casual_chat", _casual_prompt, 4),
}


def build_domain(builder: Callable[[int, Rng], str], seed: int, count: int = DOMAIN_SIZE) -> list[str]:
    """Draw ``count`` distinct prompts; template kinds rotate so any prefix is balanced."""
    rng = Rng(seed)
    prompts: list[str] = []
    seen: set[str] = set()
    index = attempts = 0
    while len(prompts) < count:
        attempts += 1
        if attempts > count * 50:
            raise RuntimeError(f"could not draw {count} distinct prompts (got {len(prompts)})")
        text = builder(index, rng)
        if text in seen:
            continue
        seen.add(text)
        prompts.append(text)
        index += 1
    return prompts


def _record(content: str, domain: str, response_format: dict | None = None) -> str:
    obj = {"messages": [{"role": "user", "content": content}], "domain": domain}
    if response_format is not None:
        obj["response_format"] = response_format
    return json.dumps(obj, ensure_ascii=False)


def _write(path: Path, prompts: list[str], domain: str, formats: list[dict] | None = None) -> None:
    assert len(set(prompts)) == len(prompts), f"{path.name}: duplicate prompts"
    for p in prompts:
        assert p.strip(), f"{path.name}: empty prompt"
        assert len(p) <= MAX_CHARS, f"{path.name}: prompt over {MAX_CHARS} chars: {p[:80]!r}"
    formats = formats or [None] * len(prompts)
    data = "".join(_record(p, domain, f) + "\n" for p, f in zip(prompts, formats, strict=True))
    path.write_bytes(data.encode("utf-8"))


def main(out_dir: str | Path | None = None) -> dict[str, int]:
    """Write all prompt files into ``out_dir`` (default ``benchmarks/prompts``); return counts."""
    out = Path(out_dir) if out_dir is not None else DEFAULT_OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}

    _write(out / "chat.jsonl", CHAT["prompts"], "chat")
    counts["chat.jsonl"] = len(CHAT["prompts"])

    for stem, (domain, builder, offset) in DOMAIN_BUILDERS.items():
        prompts = build_domain(builder, SEED + offset)
        _write(out / f"{stem}.jsonl", prompts, domain)
        counts[f"{stem}.jsonl"] = len(prompts)

    rows = build_json_schema_rows(SEED + DOMAIN_BUILDERS["json_extraction"][2])
    _write(out / "json_schema.jsonl", [text for text, _ in rows], "json_extraction", [f for _, f in rows])
    counts["json_schema.jsonl"] = len(rows)

    lines = build_tool_lines(SEED + 5)
    (out / "tool_calls.jsonl").write_bytes(
        "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode()
    )
    counts["tool_calls.jsonl"] = len(lines)
    return counts


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else None
    for name, n in main(target).items():
        print(f"{name}: {n}")
