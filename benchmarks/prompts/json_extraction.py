"""The ``json_extraction`` set (a record of eight kinds, and which of its fields to extract) and, from the same
draws, ``json_schema``'s response formats."""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.prompts.draw import POOLS, Rng, build_domain, email_address, load_template, person, pick

JSON_EXTRACTION = load_template("json_extraction")


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


def _phone(rng: Rng) -> str:
    return f"+1-{rng.randint(200, 989)}-{rng.randint(200, 989)}-{rng.randint(1000, 9999)}"


def _money(rng: Rng, lo: int, hi: int) -> str:
    return f"{rng.randint(lo, hi)}.{rng.choice(['00', '50', '99', '25', '75'])}"


# Each kind draws its values (in a fixed order: the sequence of draws is what makes the files), then
# one of its texts in templates/json_extraction.json is filled with them.


def _order(rng: Rng) -> dict:
    first, last = person(rng)
    product, price = pick(rng, "products")
    qty = rng.randint(1, 9)
    order_id = f"{rng.choice(['A', 'B', 'K', 'T', 'X'])}{rng.randint(10000, 99999)}"
    date, city = _date(rng), pick(rng, "cities")
    return dict(first=first, last=last, product=product, price=price, qty=qty, order_id=order_id, date=date, city=city)


def _contact(rng: Rng) -> dict:
    first, last = person(rng)
    title, company = pick(rng, "job_titles"), pick(rng, "companies")
    email, phone, city = email_address(first, last, rng), _phone(rng), pick(rng, "cities")
    return dict(first=first, last=last, title=title, company=company, email=email, phone=phone, city=city)


def _event(rng: Rng) -> dict:
    event, venue, city = pick(rng, "event_names"), pick(rng, "venues"), pick(rng, "cities")
    date, start = _date(rng), _time(rng)
    price = "free" if rng.chance(0.3) else f"${rng.randint(5, 60)}"
    first, last = person(rng)
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
    title, company, city = pick(rng, "job_titles"), pick(rng, "companies"), pick(rng, "cities")
    lo = rng.randint(35, 120) * 1000
    hi = lo + rng.randint(5, 40) * 1000
    years = rng.randint(0, 8)
    mode = rng.choice(["remote", "hybrid", "on-site"])
    deadline = _date(rng)
    return dict(title=title, company=company, city=city, lo=lo, hi=hi, years=years, mode=mode, deadline=deadline)


def _hotel(rng: Rng) -> dict:
    first, last = person(rng)
    hotel, room, city = pick(rng, "hotels"), pick(rng, "room_types"), pick(rng, "cities")
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
    first, last = person(rng)
    carrier, city = pick(rng, "carriers"), pick(rng, "cities")
    tracking = f"{rng.choice(['1Z', 'JD', 'RR', 'CP'])}{rng.randint(10**8, 10**9 - 1)}"
    weight = f"{rng.randint(1, 25)}.{rng.randint(0, 9)}"
    date = _date(rng)
    status = rng.choice(JSON_EXTRACTION["shipment_status"])
    return dict(
        first=first, last=last, carrier=carrier, city=city, tracking=tracking, weight=weight, date=date, status=status
    )


def _review(rng: Rng) -> dict:
    first, last = person(rng)
    product, _ = pick(rng, "products")
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


def json_prompt(index: int, rng: Rng) -> str:
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
