"""Generate the prompt sets shipped in ``adaptive_spec/data/``.

Run from the repository root with::

    .venv/bin/python scripts/make_prompts.py

which (re)writes these JSON Lines files, one
``{"messages": [{"role": "user", "content": "..."}], "domain": "<tag>"}`` object a line:

* ``chat.jsonl`` -- 24 hand-written general chat prompts (domain ``chat``), used by
  ``adaptive-spec bench``.
* ``json_extraction.jsonl``, ``sql.jsonl``, ``python.jsonl``, ``casual_chat.jsonl`` --
  400 prompts each for the drift benchmark, built from templates x slot values so
  that answers are structurally alike within a domain while their contents differ.
* ``json_schema.jsonl`` -- the prompts of ``json_extraction.jsonl``, in the same order, each with
  a ``response_format`` whose JSON schema requires exactly the keys the prompt asks for (domain
  ``json_extraction``): structured outputs for ``adaptive-spec bench``.

An optional argument names a different output directory
(``.venv/bin/python scripts/make_prompts.py OUT_DIR``).

The output is deterministic: every domain draws from its own fixed seed and the
only primitive used is ``random.Random.random()``, whose sequence for a given
integer seed Python guarantees to keep stable across versions (``choice`` /
``randint`` / ``shuffle`` are not guaranteed). ``tests/adaptive_spec/test_prompt_sets.py``
checks that the shipped files are exactly what this script produces, so edit the
script and re-run it rather than editing the data files by hand. Standard library only.
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
DEFAULT_OUT_DIR = Path(__file__).resolve().parent.parent / "adaptive_spec" / "data"


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


# --------------------------------------------------------------------------- slot pools

FIRST_NAMES = [
    "Alice",
    "Bilal",
    "Chen",
    "Daniela",
    "Emeka",
    "Fatima",
    "Gustavo",
    "Hana",
    "Ivan",
    "Julia",
    "Kwame",
    "Leila",
    "Mateo",
    "Nadia",
    "Oscar",
    "Priya",
    "Quentin",
    "Rosa",
    "Sven",
    "Tamar",
    "Umar",
    "Valentina",
    "Wei",
    "Ximena",
    "Yusuf",
    "Zoe",
    "Arjun",
    "Beatriz",
    "Connor",
    "Dmitri",
    "Elif",
    "Farah",
    "Georgia",
    "Hiroshi",
    "Ingrid",
    "Jonas",
]
LAST_NAMES = [
    "Nguyen",
    "Okafor",
    "Schmidt",
    "Rossi",
    "Kowalski",
    "Haddad",
    "Tanaka",
    "Silva",
    "Johansson",
    "Patel",
    "Moreau",
    "Garcia",
    "O'Brien",
    "Kim",
    "Novak",
    "Mensah",
    "Fischer",
    "Lopez",
    "Andersen",
    "Ivanova",
    "Costa",
    "Yilmaz",
    "Murphy",
    "Chowdhury",
]
CITIES = [
    "Lisbon",
    "Toronto",
    "Nairobi",
    "Osaka",
    "Denver",
    "Krakow",
    "Melbourne",
    "Bogota",
    "Edinburgh",
    "Seoul",
    "Austin",
    "Marseille",
    "Cape Town",
    "Vancouver",
    "Istanbul",
    "Lyon",
    "Portland",
    "Valencia",
    "Hamburg",
    "Chicago",
    "Dublin",
    "Porto",
    "Helsinki",
    "Montreal",
    "Mumbai",
    "Oslo",
    "Kyoto",
    "Buenos Aires",
]
COMPANIES = [
    "Brightwave Labs",
    "Northwind Traders",
    "Bluefin Analytics",
    "Cedar & Stone",
    "Orbital Foods",
    "Pinecrest Health",
    "Quartz Logistics",
    "Redleaf Studio",
    "Silverline Bank",
    "Tidewater Energy",
    "Upland Software",
    "Verdant Gardens",
    "Helix Robotics",
    "Lumen Optics",
    "Kestrel Airlines",
    "Juniper Books",
]
PRODUCTS = [
    ("wireless mouse", 24.99),
    ("mechanical keyboard", 89.00),
    ("USB-C hub", 39.50),
    ("27-inch monitor", 219.00),
    ("noise-cancelling headphones", 149.99),
    ("standing desk mat", 45.00),
    ("ceramic coffee mug", 12.50),
    ("yoga mat", 29.95),
    ("stainless water bottle", 18.00),
    ("LED desk lamp", 34.75),
    ("hiking backpack", 79.90),
    ("bluetooth speaker", 59.00),
    ("cast iron skillet", 42.00),
    ("running shoes", 110.00),
    ("phone case", 15.99),
    ("laptop stand", 49.00),
    ("electric kettle", 38.25),
    ("wool scarf", 27.00),
    ("board game", 34.99),
    ("smartwatch band", 19.50),
]
JOB_TITLES = [
    "Data Analyst",
    "Backend Engineer",
    "Product Designer",
    "Marketing Coordinator",
    "Registered Nurse",
    "Warehouse Supervisor",
    "Customer Success Manager",
    "Junior Accountant",
    "DevOps Engineer",
    "Content Writer",
    "Lab Technician",
    "Sales Associate",
    "Machine Learning Engineer",
    "Office Manager",
]
EVENT_NAMES = [
    "Spring Food Festival",
    "Community Cleanup Day",
    "Jazz in the Park",
    "Startup Pitch Night",
    "Charity 5K Run",
    "Open-Source Hackathon",
    "Book Swap Meetup",
    "Farmers Market Opening",
    "Photography Workshop",
    "Board Game Marathon",
    "Winter Craft Fair",
    "Outdoor Movie Night",
    "Coding Bootcamp Info Session",
]
VENUES = [
    "the Central Library",
    "Riverside Park",
    "the Town Hall",
    "Pier 7",
    "the Old Brewery",
    "Greenfield Community Center",
    "the University Auditorium",
    "Harbor Hall",
    "the Botanical Garden",
]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
EMAIL_DOMAINS = ["example.com", "mail.example.org", "example.net", "corp.example.com"]
CARRIERS = ["DHL", "UPS", "FedEx", "Royal Mail", "PostNL", "Canada Post"]
HOTELS = [
    "Hotel Aurora",
    "The Grand Harbour",
    "Parkside Inn",
    "Casa Verde",
    "The Lantern Hotel",
    "Blue Door Suites",
    "Hotel Miramar",
    "The Foundry Lodge",
]
ROOM_TYPES = ["single room", "double room", "twin room", "junior suite", "family room"]


def _date(rng: Rng) -> str:
    day, month, year = rng.randint(1, 28), rng.below(12), rng.randint(2023, 2026)
    style = rng.below(3)
    if style == 0:
        return f"{MONTHS[month]} {day}, {year}"
    if style == 1:
        return f"{year}-{month + 1:02d}-{day:02d}"
    return f"{day} {MONTHS[month]} {year}"


def _time(rng: Rng) -> str:
    hour, minute = rng.randint(7, 21), rng.choice([0, 15, 30, 45])
    if rng.chance(0.5):
        return f"{hour:02d}:{minute:02d}"
    suffix = "am" if hour < 12 else "pm"
    return f"{(hour - 1) % 12 + 1}:{minute:02d} {suffix}"


def _person(rng: Rng) -> tuple[str, str]:
    return rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)


def _email(first: str, last: str, rng: Rng) -> str:
    local = rng.choice([f"{first}.{last}", f"{first[0]}{last}", f"{first}{rng.randint(1, 99)}"])
    local = "".join(c for c in local.lower() if c.isalnum() or c == ".")
    return f"{local}@{rng.choice(EMAIL_DOMAINS)}"


def _phone(rng: Rng) -> str:
    return f"+1-{rng.randint(200, 989)}-{rng.randint(200, 989)}-{rng.randint(1000, 9999)}"


def _money(rng: Rng, lo: int, hi: int) -> str:
    return f"{rng.randint(lo, hi)}.{rng.choice(['00', '50', '99', '25', '75'])}"


# --------------------------------------------------------------------------- chat (hand-written)

CHAT_PROMPTS = [
    "Explain how a rainbow forms, in simple terms a ten-year-old could follow.",
    "What is the difference between weather and climate? Give a couple of examples.",
    "How do vaccines help the body fight infections?",
    "Explain what a computer's RAM does and why having more of it can make a computer faster.",
    "Why do we have seasons on Earth?",
    "How does compound interest work? Walk me through a simple example.",
    "Give me step-by-step instructions for making a simple vegetable soup.",
    "How do I change a flat tire on a car? List the steps in order.",
    "What are some good tips for writing a clear and friendly email to a coworker?",
    "How can I start learning to play the guitar as a complete beginner?",
    "Explain how to plant tomato seeds and care for the seedlings.",
    "What are the main steps to prepare for a job interview?",
    "Write a short story about a robot who learns to paint.",
    "Write a short bedtime story about a sleepy dragon and a brave little mouse.",
    "Write a short story set in a lighthouse during a storm.",
    "Tell a short story about a girl who finds a mysterious map in her grandmother's attic.",
    "Write a short poem about the ocean at sunrise, then explain the images you used.",
    "I have trouble falling asleep at night. What are some habits that could help?",
    "How can I stay focused while studying at home?",
    "I want to start exercising but I have never been to a gym. Where should I begin?",
    "What are some practical ways to save money on groceries each month?",
    "My friend is feeling sad after losing her job. How can I support her?",
    "Describe the water cycle and explain why it is important for life on Earth.",
    "What are the pros and cons of working from home?",
]


# --------------------------------------------------------------------------- json_extraction


def _json_order(rng: Rng):
    first, last = _person(rng)
    product, price = rng.choice(PRODUCTS)
    qty = rng.randint(1, 9)
    order_id = f"{rng.choice(['A', 'B', 'K', 'T', 'X'])}{rng.randint(10000, 99999)}"
    date, city = _date(rng), rng.choice(CITIES)
    text = rng.choice(
        [
            f"Order #{order_id} was placed by {first} {last} on {date}: {qty} x {product} "
            f"at ${price:.2f} each, to be shipped to {city}.",
            f"Hi, this is {first} {last}. I'd like to confirm my order {order_id} from {date} "
            f"for {qty} x {product}, ${price:.2f} per unit. Please deliver to my address in {city}.",
            f"New order received. Customer: {first} {last}. Item: {product}. Quantity: {qty}. "
            f"Unit price: ${price:.2f}. Ship to: {city}. Order number: {order_id}. Date: {date}.",
        ]
    )
    fields = ["order_id", "customer_name", "product", "quantity", "unit_price", "city", "order_date"]
    return "order confirmation", text, fields


def _json_contact(rng: Rng):
    first, last = _person(rng)
    title, company = rng.choice(JOB_TITLES), rng.choice(COMPANIES)
    email, phone, city = _email(first, last, rng), _phone(rng), rng.choice(CITIES)
    text = rng.choice(
        [
            f"{first} {last}\n{title}, {company}\n{city}\nEmail: {email}\nPhone: {phone}",
            f"Nice meeting you at the conference! I'm {first} {last}, {title} at {company} in "
            f"{city}. You can reach me at {email} or call {phone}.",
            f"Contact: {last}, {first} | {company} ({city}) | role: {title} | {phone} | {email}",
        ]
    )
    fields = ["first_name", "last_name", "job_title", "company", "city", "email", "phone"]
    return "contact card", text, fields


def _json_event(rng: Rng):
    event, venue, city = rng.choice(EVENT_NAMES), rng.choice(VENUES), rng.choice(CITIES)
    date, start = _date(rng), _time(rng)
    price = "free" if rng.chance(0.3) else f"${rng.randint(5, 60)}"
    first, last = _person(rng)
    capacity = rng.choice([40, 60, 80, 100, 150, 200, 250, 500])
    text = rng.choice(
        [
            f"Join us for the {event} at {venue}, {city}, on {date} starting at {start}. "
            f"Tickets: {price}. Only {capacity} spots available. Organized by {first} {last}.",
            f"ANNOUNCEMENT: {event}\nWhere: {venue}, {city}\nWhen: {date}, {start}\n"
            f"Entry: {price}\nCapacity: {capacity} people\nQuestions? Ask {first} {last}.",
            f"{first} {last} is hosting the {event} this year! It takes place on {date} at {start} "
            f"in {venue} ({city}). Admission is {price} and there is room for {capacity} guests.",
        ]
    )
    fields = ["event_name", "venue", "city", "date", "start_time", "ticket_price", "capacity", "organizer"]
    return "event notice", text, fields


def _json_job(rng: Rng):
    title, company, city = rng.choice(JOB_TITLES), rng.choice(COMPANIES), rng.choice(CITIES)
    lo = rng.randint(35, 120) * 1000
    hi = lo + rng.randint(5, 40) * 1000
    years = rng.randint(0, 8)
    mode = rng.choice(["remote", "hybrid", "on-site"])
    deadline = _date(rng)
    text = rng.choice(
        [
            f"{company} is hiring a {title} in {city} ({mode}). Salary range ${lo:,}-${hi:,} per "
            f"year. At least {years} years of experience required. Apply by {deadline}.",
            f"JOB OPENING - {title}\nCompany: {company}\nLocation: {city}, {mode}\n"
            f"Pay: ${lo:,} to ${hi:,}\nExperience: {years}+ years\nDeadline: {deadline}",
            f"We're looking for a {title} to join our team at {company}! This {mode} role is based "
            f"in {city} and pays between ${lo:,} and ${hi:,}. You should have {years}+ years of "
            f"experience. Applications close {deadline}.",
        ]
    )
    fields = [
        "job_title",
        "company",
        "city",
        "work_mode",
        "salary_min",
        "salary_max",
        "years_experience",
        "application_deadline",
    ]
    return "job ad", text, fields


def _json_hotel(rng: Rng):
    first, last = _person(rng)
    hotel, room, city = rng.choice(HOTELS), rng.choice(ROOM_TYPES), rng.choice(CITIES)
    nights, guests = rng.randint(1, 10), rng.randint(1, 4)
    checkin, rate = _date(rng), _money(rng, 60, 390)
    conf = f"HB-{rng.randint(100000, 999999)}"
    text = rng.choice(
        [
            f"Dear {first} {last}, your booking {conf} at {hotel}, {city} is confirmed: {room} for "
            f"{guests} guest(s), {nights} night(s) from {checkin}, at ${rate} per night.",
            f"Reservation {conf}\nGuest: {first} {last}\nHotel: {hotel} ({city})\nCheck-in: {checkin}\n"
            f"Nights: {nights}\nRoom: {room}\nGuests: {guests}\nRate: ${rate}/night",
        ]
    )
    fields = [
        "confirmation_number",
        "guest_name",
        "hotel",
        "city",
        "check_in",
        "nights",
        "room_type",
        "guests",
        "nightly_rate",
    ]
    return "hotel booking", text, fields


def _json_shipment(rng: Rng):
    first, last = _person(rng)
    carrier, city = rng.choice(CARRIERS), rng.choice(CITIES)
    tracking = f"{rng.choice(['1Z', 'JD', 'RR', 'CP'])}{rng.randint(10**8, 10**9 - 1)}"
    weight = f"{rng.randint(1, 25)}.{rng.randint(0, 9)}"
    date = _date(rng)
    status = rng.choice(["in transit", "out for delivery", "delayed", "delivered", "at the depot"])
    text = rng.choice(
        [
            f"Your {carrier} parcel {tracking} for {first} {last} ({weight} kg) is {status}. "
            f"Destination: {city}. Expected delivery: {date}.",
            f"Shipment update - carrier: {carrier}; tracking no. {tracking}; recipient {first} {last}, "
            f"{city}; weight {weight} kg; status: {status}; estimated arrival {date}.",
        ]
    )
    fields = ["carrier", "tracking_number", "recipient", "weight_kg", "status", "destination_city", "expected_delivery"]
    return "shipping notification", text, fields


def _json_review(rng: Rng):
    first, last = _person(rng)
    product, _ = rng.choice(PRODUCTS)
    stars = rng.randint(1, 5)
    good = rng.choice(["sturdy", "easy to set up", "great value", "looks nice", "fast shipping"])
    bad = rng.choice(["a bit loud", "the manual is confusing", "runs small", "scratches easily", "the color is off"])
    days = rng.randint(2, 120)
    text = rng.choice(
        [
            f"{stars}/5 stars from {first} {last[0]}. \"I've used this {product} for {days} days. "
            f"It's {good}, but {bad}.\" Would recommend: {'yes' if stars >= 3 else 'no'}.",
            f"Review by {first} {last[0]}. ({stars} stars): Bought the {product} {days} days ago. Pros: "
            f"{good}. Cons: {bad}. {'I would buy it again.' if stars >= 3 else 'Not buying again.'}",
        ]
    )
    fields = ["reviewer", "product", "rating", "days_used", "pros", "cons", "recommends"]
    return "product review", text, fields


def _json_invoice(rng: Rng):
    company, client = rng.sample(COMPANIES, 2)
    number = f"INV-{rng.randint(2023, 2026)}-{rng.randint(100, 999)}"
    amount, tax = _money(rng, 150, 9800), rng.choice([0, 5, 7, 10, 19, 20, 21])
    issued, due = _date(rng), rng.choice([14, 30, 45, 60])
    currency = rng.choice(["USD", "EUR", "GBP", "CAD"])
    text = rng.choice(
        [
            f"Invoice {number} from {company} to {client}, issued {issued}. Amount: {amount} "
            f"{currency} plus {tax}% tax. Payment due within {due} days.",
            f"{company}\nINVOICE {number}\nBill to: {client}\nDate: {issued}\nSubtotal: {currency} "
            f"{amount}\nTax rate: {tax}%\nTerms: net {due}",
        ]
    )
    fields = [
        "invoice_number",
        "vendor",
        "client",
        "issue_date",
        "subtotal",
        "currency",
        "tax_rate_percent",
        "payment_terms_days",
    ]
    return "invoice", text, fields


JSON_KINDS = [
    _json_order,
    _json_contact,
    _json_event,
    _json_job,
    _json_hotel,
    _json_shipment,
    _json_review,
    _json_invoice,
]

JSON_FRAMES = [
    "Extract the following fields from the text below and return them as a JSON object: "
    "{fields}.\n\nText: {text}\n\nAnswer with only the JSON object.",
    "Read this {label} and output a JSON object with the keys {fields}. Respond with JSON "
    "only, no explanation.\n\n{text}",
    "{text}\n\nConvert the information above into JSON with exactly these keys: {fields}. Output only the JSON.",
    "From the following {label}, extract {fields} as a JSON object. Use numbers for numeric "
    'values. Reply with only the JSON.\n\n"""\n{text}\n"""',
    "Return a JSON object with the fields {fields} filled in from this {label}. Use null for "
    "anything missing. Do not add any other text.\n\n{text}",
]


def _json_prompt_and_fields(index: int, rng: Rng) -> tuple[str, list[str]]:
    label, text, fields = JSON_KINDS[index % len(JSON_KINDS)](rng)
    fields = rng.subset_in_order(fields, 4)
    quote = rng.choice(['"{}"', "{}"])
    field_list = ", ".join(quote.format(f) for f in fields)
    return rng.choice(JSON_FRAMES).format(fields=field_list, text=text, label=label), fields


def _json_prompt(index: int, rng: Rng) -> str:
    return _json_prompt_and_fields(index, rng)[0]


# A value as the prompts allow it: text, a number, true/false, null ("Use null for anything
# missing") or a list of strings (a review's pros and cons).
JSON_VALUE = {
    "anyOf": [{"type": ["string", "number", "boolean", "null"]}, {"type": "array", "items": {"type": "string"}}]
}


def json_schema_format(fields: list[str]) -> dict:
    """OpenAI's response_format asking for an object with exactly `fields`."""
    schema = {
        "type": "object",
        "properties": {field: JSON_VALUE for field in fields},
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


# --------------------------------------------------------------------------- sql

# Each schema: candidate table names, column definitions, question templates.
# Question templates use {table} plus slot names resolved by SQL_SLOTS.
SQL_SCHEMAS = [
    (
        ["employees", "staff"],
        ["id INTEGER PRIMARY KEY", "name TEXT", "department TEXT", "salary INTEGER", "hire_date DATE", "city TEXT"],
        [
            "List the names of employees in the {dept} department earning more than {salary}.",
            "What is the average salary per department for employees based in {city}?",
            "How many employees were hired after {iso_date}?",
            "Show the {n} highest-paid employees in {city}, with their salaries.",
            "Which departments have more than {n} employees?",
            "Find the employee in the {dept} department who was hired most recently.",
        ],
    ),
    (
        ["orders", "purchases"],
        [
            "order_id INTEGER PRIMARY KEY",
            "customer_name TEXT",
            "product TEXT",
            "quantity INTEGER",
            "unit_price REAL",
            "order_date DATE",
        ],
        [
            "What is the total revenue (quantity times unit_price) for orders of '{product}'?",
            "List all orders placed by {full_name}, newest first.",
            "How many orders were placed between {iso_date} and {iso_date2}?",
            "Which {n} products sold the most units overall?",
            "Find customers who ordered more than {n} items in total.",
            "Show the average order value for each product, highest first.",
        ],
    ),
    (
        ["products", "inventory"],
        ["sku TEXT PRIMARY KEY", "name TEXT", "category TEXT", "price REAL", "stock INTEGER", "supplier TEXT"],
        [
            "List products in the {category} category that cost less than {price}.",
            "Which products have fewer than {n} items in stock?",
            "What is the total stock value (price times stock) per supplier?",
            "Find the most expensive product supplied by {company}.",
            "How many distinct categories are there, and how many products are in each?",
            "Show the {n} cheapest products in the {category} category.",
        ],
    ),
    (
        ["students", "pupils"],
        [
            "student_id INTEGER PRIMARY KEY",
            "name TEXT",
            "grade_level INTEGER",
            "gpa REAL",
            "enrolled_on DATE",
            "hometown TEXT",
        ],
        [
            "List the names of students in grade {grade} with a GPA above {gpa}.",
            "What is the average GPA for each grade level?",
            "How many students come from {city}?",
            "Show the {n} students with the highest GPA.",
            "Find students who enrolled before {iso_date}, ordered by name.",
            "Which hometowns have more than {n} students?",
        ],
    ),
    (
        ["books", "library_books"],
        [
            "isbn TEXT PRIMARY KEY",
            "title TEXT",
            "author TEXT",
            "genre TEXT",
            "published_year INTEGER",
            "copies_available INTEGER",
        ],
        [
            "List all {genre} books published after {year}.",
            "Which author has written the most books in the table?",
            "How many books have no copies available?",
            "Show the titles of books by {full_name}, oldest first.",
            "What is the total number of available copies per genre?",
            "Find the {n} most recently published {genre} books.",
        ],
    ),
    (
        ["flights", "departures"],
        [
            "flight_no TEXT PRIMARY KEY",
            "origin TEXT",
            "destination TEXT",
            "departure_time TIMESTAMP",
            "seats_sold INTEGER",
            "capacity INTEGER",
        ],
        [
            "List all flights from {city} to {city2}.",
            "Which flights are more than {pct}% full?",
            "How many flights depart from {city} each day?",
            "What is the average number of seats sold per destination?",
            "Find flights leaving after {iso_date} with fewer than {n} seats sold.",
            "Show the {n} most popular destinations by total seats sold.",
        ],
    ),
    (
        ["patients", "appointments"],
        ["id INTEGER PRIMARY KEY", "patient_name TEXT", "doctor TEXT", "visit_date DATE", "reason TEXT", "fee REAL"],
        [
            "How many visits did Dr. {last_name} have in {year}?",
            "List patients who visited for '{reason}' after {iso_date}.",
            "What is the total fee collected per doctor?",
            "Find the doctor with the highest average fee.",
            "Show all visits for {full_name}, newest first.",
            "Which reasons for visit appear more than {n} times?",
        ],
    ),
    (
        ["movies", "films"],
        [
            "movie_id INTEGER PRIMARY KEY",
            "title TEXT",
            "director TEXT",
            "release_year INTEGER",
            "rating REAL",
            "box_office INTEGER",
        ],
        [
            "List movies released in {year} with a rating of at least {rating}.",
            "Which director has the highest average rating?",
            "What is the total box office per release year since {year}?",
            "Show the {n} highest-grossing movies directed by {full_name}.",
            "How many movies have a rating below {rating}?",
            "Find the best-rated movie from each year.",
        ],
    ),
    (
        ["rentals", "bike_rentals"],
        [
            "rental_id INTEGER PRIMARY KEY",
            "member_id INTEGER",
            "station TEXT",
            "start_time TIMESTAMP",
            "minutes INTEGER",
            "price REAL",
        ],
        [
            "What is the average rental duration in minutes at the {station} station?",
            "Which {n} stations have the most rentals?",
            "How much revenue did rentals longer than {minutes} minutes generate?",
            "List members who rented more than {n} times.",
            "Show rentals that started on {iso_date}, longest first.",
            "Find the total minutes ridden per member, highest first.",
        ],
    ),
    (
        ["sensor_readings", "measurements"],
        [
            "reading_id INTEGER PRIMARY KEY",
            "sensor_id TEXT",
            "location TEXT",
            "recorded_at TIMESTAMP",
            "temperature REAL",
            "humidity REAL",
        ],
        [
            "What is the average temperature per location?",
            "List readings from {city} where the temperature exceeded {temp} degrees.",
            "Which sensors recorded humidity above {pct} percent?",
            "Find the highest temperature recorded on {iso_date}.",
            "How many readings does each sensor have, most first?",
            "Show the {n} most recent readings from sensor {sensor}.",
        ],
    ),
]

SQL_SLOTS: dict[str, Callable[[Rng], str]] = {
    "dept": lambda r: r.choice(["Sales", "Engineering", "Marketing", "Finance", "Support", "HR", "Legal"]),
    "salary": lambda r: str(r.randint(4, 15) * 10000),
    "city": lambda r: r.choice(CITIES),
    "city2": lambda r: r.choice(CITIES),
    "n": lambda r: str(r.randint(2, 12)),
    "iso_date": lambda r: f"{r.randint(2019, 2025)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
    "iso_date2": lambda r: f"2026-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
    "product": lambda r: r.choice(PRODUCTS)[0],
    "full_name": lambda r: " ".join(_person(r)),
    "last_name": lambda r: r.choice(LAST_NAMES),
    "category": lambda r: r.choice(["Electronics", "Kitchen", "Garden", "Toys", "Office", "Sports", "Books"]),
    "price": lambda r: str(r.choice([5, 10, 15, 20, 25, 50, 75, 100, 250])),
    "company": lambda r: r.choice(COMPANIES),
    "grade": lambda r: str(r.randint(6, 12)),
    "gpa": lambda r: r.choice(["2.5", "3.0", "3.2", "3.5", "3.7", "3.8"]),
    "genre": lambda r: r.choice(["fantasy", "mystery", "science fiction", "history", "romance", "poetry"]),
    "year": lambda r: str(r.randint(1985, 2024)),
    "pct": lambda r: str(r.choice([50, 60, 70, 75, 80, 85, 90, 95])),
    "reason": lambda r: r.choice(["checkup", "flu", "back pain", "vaccination", "follow-up", "allergy"]),
    "rating": lambda r: r.choice(["5.5", "6.0", "6.5", "7.0", "7.5", "8.0", "8.5"]),
    "station": lambda r: r.choice(["Central", "Harbor", "University", "Riverside", "Old Town", "Airport"]),
    "minutes": lambda r: str(r.choice([15, 20, 30, 45, 60, 90, 120])),
    "temp": lambda r: str(r.randint(20, 38)),
    "sensor": lambda r: f"S-{r.randint(1, 60):02d}",
}

SQL_FRAMES = [
    "Given this table:\n\n{schema}\n\n{question} Answer with a single SQL query.",
    "{schema}\n\nWrite one SQL query that answers: {question} Return only the SQL.",
    "Schema:\n{schema}\n\nQuestion: {question}\nRespond with a single SQL query and nothing else.",
    "Using the table defined below, write a SQL query for this request: {question}\n\n{schema}\n\n"
    "Output just the query.",
]


def _fill(template: str, rng: Rng, slots: dict[str, Callable[[Rng], str]]) -> str:
    """Fill every ``{slot}`` of ``template``; slots sharing a pool (``city``/``city2``) differ."""
    values: dict[str, str] = {}
    for _, name, _, _ in string.Formatter().parse(template):
        if name is None or name in values:
            continue
        value = slots[name](rng)
        base = name.rstrip("0123456789")
        for _ in range(50):
            taken = [v for k, v in values.items() if k.rstrip("0123456789") == base]
            if value not in taken:
                break
            value = slots[name](rng)
        values[name] = value
    return template.format(**values)


def _sql_prompt(index: int, rng: Rng) -> str:
    tables, columns, questions = SQL_SCHEMAS[index % len(SQL_SCHEMAS)]
    table = rng.choice(tables)
    schema = f"CREATE TABLE {table} (\n    " + ",\n    ".join(columns) + "\n);"
    question = _fill(rng.choice(questions), rng, SQL_SLOTS)
    if rng.chance(0.25):
        question += rng.choice([" Use standard SQL.", " Use SQLite syntax.", " Use PostgreSQL syntax."])
    return rng.choice(SQL_FRAMES).format(schema=schema, question=question)


# --------------------------------------------------------------------------- python

# (function name, parameters, behaviour); behaviours may contain slots from PY_SLOTS.
PY_SPECS = [
    ("count_vowels", "text", "counts how many vowels appear in a string, ignoring case"),
    (
        "is_palindrome",
        "text",
        "returns True if a string reads the same forwards and backwards, ignoring spaces and case",
    ),
    ("sum_divisible", "numbers", "returns the sum of the integers in a list that are divisible by {k}"),
    ("filter_above", "values", "returns a new list with only the numbers greater than {threshold}"),
    ("celsius_to_fahrenheit", "celsius", "converts a temperature from Celsius to Fahrenheit, rounded to {places}"),
    ("fahrenheit_to_celsius", "fahrenheit", "converts a temperature from Fahrenheit to Celsius, rounded to {places}"),
    ("km_to_miles", "km", "converts a distance in kilometres to miles, rounded to {places}"),
    (
        "chunk_list",
        "items, size",
        "splits a list into consecutive chunks of length size (the last chunk may be shorter)",
    ),
    ("word_frequencies", "text", "returns a dictionary mapping each lowercase word in a string to how often it occurs"),
    ("fibonacci", "n", "returns a list of the first n Fibonacci numbers"),
    ("factorial", "n", "returns n! computed iteratively, raising ValueError for negative n"),
    ("is_prime", "n", "returns True if an integer is a prime number"),
    ("primes_below", "limit", "returns a list of all prime numbers smaller than limit"),
    ("reverse_words", "sentence", "reverses the order of the words in a sentence"),
    ("capitalize_words", "sentence", "capitalizes the first letter of every word in a sentence"),
    ("remove_duplicates", "items", "removes duplicates from a list while keeping the original order"),
    ("flatten", "nested", "flattens a list of lists into a single list"),
    ("max_gap", "numbers", "returns the largest difference between two consecutive numbers in a list"),
    (
        "moving_average",
        "values, window",
        "returns the moving averages of a list of numbers over a window of the given size",
    ),
    ("clamp", "value, low, high", "limits a number to the range between low and high"),
    ("merge_dicts", "first, second", "merges two dictionaries, with values from second winning on conflicts"),
    ("invert_dict", "mapping", "swaps the keys and values of a dictionary"),
    ("count_words", "text", "returns the number of words in a string"),
    ("longest_word", "sentence", "returns the longest word in a sentence (the first one if there is a tie)"),
    ("truncate", "text", "shortens a string to at most {length} characters, ending with '...' if it was cut"),
    ("pad_left", "text, width", "pads a string on the left with '{char}' characters until it is width long"),
    ("average", "numbers", "returns the arithmetic mean of a list of numbers, or 0.0 for an empty list"),
    ("median", "numbers", "returns the median of a non-empty list of numbers"),
    ("second_largest", "numbers", "returns the second largest distinct number in a list, or None if there is none"),
    ("running_total", "numbers", "returns a list of running totals of the input numbers"),
    ("apply_discount", "price", "returns the price after a {percent}% discount, rounded to 2 decimal places"),
    ("add_tax", "amount", "returns the amount plus {percent}% sales tax, rounded to 2 decimal places"),
    (
        "is_valid_email",
        "address",
        "does a simple check that a string looks like an email address (one '@' and a dot after it)",
    ),
    ("normalize_whitespace", "text", "collapses runs of whitespace in a string into single spaces and strips the ends"),
    ("char_histogram", "text", "returns a dictionary counting each character in a string, ignoring spaces"),
    ("gcd", "a, b", "returns the greatest common divisor of two positive integers using Euclid's algorithm"),
    ("lcm", "a, b", "returns the least common multiple of two positive integers"),
    ("digit_sum", "n", "returns the sum of the decimal digits of a non-negative integer"),
    ("to_binary", "n", "returns the binary representation of a non-negative integer as a string, without using bin()"),
    ("rotate_list", "items", "rotates a list to the right by {k} positions"),
    ("every_nth", "items", "returns every {k}th element of a list, starting with the first"),
    ("count_longer_than", "words", "counts how many strings in a list are longer than {length} characters"),
    ("seconds_to_hms", "seconds", "converts a number of seconds into an 'H:MM:SS' string"),
    (
        "grade_letter",
        "score",
        "maps a score from 0 to 100 to a letter grade A-F, with {cutoff} as the lowest passing score",
    ),
    ("group_by_length", "words", "groups a list of words into a dictionary keyed by word length"),
    ("title_case_names", "names", "returns a list of names with each name in title case, sorted alphabetically"),
    ("safe_divide", "a, b", "divides a by b and returns {fallback} instead of raising when b is zero"),
    ("repeat_string", "text", "returns the string repeated {k} times, separated by '{sep}'"),
    ("split_csv_line", "line", "splits a line of comma-separated values into a list of stripped strings"),
    ("count_in_range", "numbers", "counts how many numbers in a list lie between {low} and {high} inclusive"),
    ("bmi", "weight_kg, height_m", "computes the body mass index from weight and height, rounded to {places}"),
    (
        "compound_interest",
        "principal, rate, years",
        "returns the balance after compounding annual interest, rounded to 2 decimal places",
    ),
    ("initials", "full_name", "returns the uppercase initials of a full name, such as 'A.B.' for '{sample_name}'"),
]

PY_SLOTS: dict[str, Callable[[Rng], str]] = {
    "k": lambda r: str(r.randint(2, 9)),
    "threshold": lambda r: str(r.choice([0, 1, 5, 10, 18, 42, 50, 100, 250, 1000])),
    "places": lambda r: r.choice(["1 decimal place", "2 decimal places", "3 decimal places"]),
    "length": lambda r: str(r.choice([5, 8, 10, 12, 20, 30, 40, 80])),
    "char": lambda r: r.choice(["0", "*", "-", "#", "."]),
    "percent": lambda r: str(r.choice([5, 8, 10, 12, 15, 20, 25, 30, 40])),
    "cutoff": lambda r: str(r.choice([50, 55, 60, 65, 70])),
    "fallback": lambda r: r.choice(["None", "0", "0.0", "float('inf')"]),
    "sep": lambda r: r.choice(["-", ", ", " | ", "/", " "]),
    "low": lambda r: str(r.randint(-10, 10)),
    "high": lambda r: str(r.randint(20, 100)),
    "sample_name": lambda r: " ".join(_person(r)),
}

PY_FRAMES = [
    "Write a Python function named `{name}` that {behaviour}. Include a docstring.",
    "Implement `def {name}({params}):` in Python. It {behaviour}. Add a short docstring explaining "
    "the arguments and the return value.",
    "Please write a short Python function `{name}({params})` with a docstring. Behaviour: it {behaviour}.",
    "Create a Python function called {name} that takes `{params}` and {behaviour}. Give it a clear "
    "docstring and keep it short.",
    "I need a small Python helper, `{name}({params})`, which {behaviour}. Write it with a docstring "
    "and return only the code.",
]
PY_EXTRAS = [
    "",
    "",
    " Use type hints.",
    " Do not import any modules.",
    " Put one usage example in the docstring.",
    " Keep it under 15 lines.",
    " Use type hints and avoid external libraries.",
]


def _python_prompt(index: int, rng: Rng) -> str:
    name, params, behaviour = PY_SPECS[index % len(PY_SPECS)]
    behaviour = _fill(behaviour, rng, PY_SLOTS)
    text = rng.choice(PY_FRAMES).format(name=name, params=params, behaviour=behaviour)
    return text + rng.choice(PY_EXTRAS)


# --------------------------------------------------------------------------- casual_chat

CASUAL_TEMPLATES = [
    "I'm finally visiting {city} for {days} days next {month}. What should I not miss?",
    "My {relation} {name} loves {hobby}. Any fun birthday gift ideas under ${budget}?",
    "I just adopted {pet_age}-year-old {pet} named {pet_name}. Any tips for the first week?",
    "It's been raining in {city} all week and I'm so bored. What can I do indoors this weekend?",
    "I want to get into {hobby} but I only have about {minutes} minutes a day. How should I start?",
    "What's an easy {meal} I can make with {ingredient}, {ingredient2} and {ingredient3}?",
    "I have a job interview at {company} on {weekday} and I'm really nervous. Any advice?",
    "My friend {name} and I keep arguing about whether {debate}. What do you think?",
    "Can you recommend a few {book_genre} books for a long train ride?",
    "I'm trying to wake up at {wake_time} every day. How do I actually stick to it?",
    "We're having {guests} friends over for {occasion} on {weekday}. Any easy snack ideas?",
    "I've been learning {language} for {months} months and I feel stuck. How can I stay motivated?",
    "I just moved to {city} and don't know anyone yet. How can I meet people?",
    "My {pet} keeps {pet_behaviour}. Is that normal, and what can I do about it?",
    "I've got a free {weekday} afternoon. Should I go {activity} or {activity2}?",
    "How do I politely tell my roommate {name} that {roommate_issue}?",
    "I signed up for my first {race} and it's in {weeks} weeks. Any tips for getting ready?",
    "Can you give me a little pep talk? I have {task} today and I'm dreading it.",
    "What are some fun things to do in {season} with kids aged {kid_age} and {kid_age2}?",
    "I want to start a small balcony garden in {city}. What should I plant first?",
    "Tell me something interesting about {topic}. I'm bored at work.",
    "I keep putting off {task}. Any tricks to stop procrastinating?",
    "I'm planning a picnic with {name} this {weekday}. What should I bring?",
    "I just finished a {film_genre} movie and loved it. What should I watch next?",
    "My {relation} {name} is coming to stay with me for {days} days. How can I make them feel welcome?",
    "I'm saving up ${budget} for a trip to {city}. Any tips for stretching my budget?",
    "What's a good way to unwind after a long {weekday} at work?",
    "I'm thinking of learning to {skill}. Is it hard to pick up as an adult?",
]

CASUAL_SLOTS: dict[str, Callable[[Rng], str]] = {
    "city": lambda r: r.choice(CITIES),
    "days": lambda r: str(r.randint(2, 14)),
    "month": lambda r: r.choice(MONTHS),
    "relation": lambda r: r.choice(
        ["sister", "brother", "best friend", "dad", "mom", "cousin", "grandma", "coworker", "partner", "uncle"]
    ),
    "name": lambda r: r.choice(FIRST_NAMES),
    "hobby": lambda r: r.choice(
        [
            "baking",
            "rock climbing",
            "photography",
            "gardening",
            "chess",
            "knitting",
            "birdwatching",
            "cycling",
            "pottery",
            "painting",
            "astronomy",
            "running",
            "board games",
            "journaling",
        ]
    ),
    "budget": lambda r: str(r.choice([20, 25, 30, 40, 50, 75, 100, 150, 300, 500, 800, 1200])),
    # with its article: "a 2-year-old", "an 8-year-old", "an 11-year-old"
    "pet_age": lambda r: (lambda n: ("an " if n in (8, 11) else "a ") + str(n))(r.randint(1, 12)),
    "pet": lambda r: r.choice(
        ["cat", "dog", "rabbit", "parrot", "guinea pig", "beagle", "tabby cat", "golden retriever", "hamster"]
    ),
    "pet_name": lambda r: r.choice(
        ["Biscuit", "Luna", "Pepper", "Milo", "Nala", "Mochi", "Rocky", "Olive", "Ziggy", "Pumpkin", "Scout", "Hazel"]
    ),
    "minutes": lambda r: str(r.choice([10, 15, 20, 30, 45])),
    "meal": lambda r: r.choice(["dinner", "lunch", "breakfast", "snack", "dessert"]),
    "ingredient": lambda r: r.choice(
        [
            "rice",
            "eggs",
            "spinach",
            "chickpeas",
            "pasta",
            "tomatoes",
            "potatoes",
            "cheese",
            "chicken",
            "tofu",
            "bell peppers",
            "mushrooms",
            "oats",
            "bananas",
            "lentils",
            "onions",
        ]
    ),
    "ingredient2": lambda r: CASUAL_SLOTS["ingredient"](r),
    "ingredient3": lambda r: CASUAL_SLOTS["ingredient"](r),
    "company": lambda r: r.choice(
        [
            "a small startup",
            "a big bank",
            "a bakery",
            "a hospital",
            "a school",
            "a tech company",
            "a bookstore",
            "a museum",
            "a law firm",
            "a design agency",
        ]
    ),
    "weekday": lambda r: r.choice(WEEKDAYS),
    "debate": lambda r: r.choice(
        [
            "pineapple belongs on pizza",
            "cats are better than dogs",
            "it's better to be early or on time",
            "books are better than their movies",
            "breakfast is the most important meal",
            "summer beats winter",
            "you should make your bed every day",
            "hot dogs count as sandwiches",
        ]
    ),
    "book_genre": lambda r: r.choice(
        [
            "mystery",
            "fantasy",
            "science fiction",
            "funny",
            "historical fiction",
            "feel-good",
            "adventure",
            "short story",
        ]
    ),
    "wake_time": lambda r: r.choice(["5:30", "6:00", "6:30", "7:00"]) + " am",
    "guests": lambda r: str(r.randint(3, 12)),
    "occasion": lambda r: r.choice(
        ["a game night", "a movie night", "a birthday", "a barbecue", "a housewarming", "a watch party"]
    ),
    "language": lambda r: r.choice(
        ["Spanish", "Japanese", "French", "German", "Korean", "Italian", "Portuguese", "Arabic"]
    ),
    "months": lambda r: str(r.randint(2, 18)),
    "pet_behaviour": lambda r: r.choice(
        [
            "waking me up at 4 am",
            "chewing on my shoes",
            "knocking things off the table",
            "barking at the mailman",
            "hiding under the bed",
            "scratching the couch",
        ]
    ),
    "activity": lambda r: r.choice(
        [
            "hiking",
            "to a museum",
            "to the beach",
            "to a cafe with a book",
            "thrift shopping",
            "to the cinema",
            "for a bike ride",
            "to a farmers market",
        ]
    ),
    "activity2": lambda r: CASUAL_SLOTS["activity"](r),
    "roommate_issue": lambda r: r.choice(
        [
            "the dishes keep piling up",
            "the music is too loud at night",
            "they keep eating my food",
            "the bathroom needs cleaning",
            "guests stay over too often",
        ]
    ),
    "race": lambda r: r.choice(["5K", "10K", "half marathon", "triathlon", "charity walk"]),
    "weeks": lambda r: str(r.randint(3, 16)),
    "task": lambda r: r.choice(
        [
            "a big presentation",
            "my taxes",
            "a dentist appointment",
            "cleaning the garage",
            "a difficult exam",
            "writing my thesis",
            "a long shift",
            "a tough conversation with my boss",
        ]
    ),
    "season": lambda r: r.choice(["spring", "summer", "autumn", "winter"]),
    "kid_age": lambda r: str(r.randint(3, 12)),
    "kid_age2": lambda r: str(r.randint(3, 12)),
    "topic": lambda r: r.choice(
        [
            "octopuses",
            "the Moon",
            "honeybees",
            "volcanoes",
            "the Roman Empire",
            "coffee",
            "penguins",
            "lightning",
            "ancient Egypt",
            "the deep sea",
            "sloths",
            "the Northern Lights",
        ]
    ),
    "film_genre": lambda r: r.choice(
        ["sci-fi", "heist", "romantic comedy", "horror", "animated", "detective", "sports", "space"]
    ),
    "skill": lambda r: r.choice(
        ["swim", "play the piano", "draw", "dance salsa", "code", "juggle", "sew", "skateboard", "ski"]
    ),
}

CASUAL_OPENERS = [
    "",
    "",
    "Hey! ",
    "Hi there, ",
    "Quick question: ",
    "Okay so ",
    "Hello! ",
    "Hey, hope you're well. ",
    "Random question, but ",
]
CASUAL_CLOSERS = ["", "", "", " Thanks!", " :)", " Thanks in advance!", " Any ideas welcome."]


def _casual_prompt(index: int, rng: Rng) -> str:
    template = CASUAL_TEMPLATES[index % len(CASUAL_TEMPLATES)]
    body = _fill(template, rng, CASUAL_SLOTS)
    opener = rng.choice(CASUAL_OPENERS)
    # After an opener that continues the sentence ("Okay so ", "Hi there, "), lower-case the
    # first word -- except the pronoun "I".
    continues = opener and not opener.endswith(("! ", ". "))
    if continues and not body.startswith(("I ", "I'")):
        body = body[0].lower() + body[1:]
    return opener + body + rng.choice(CASUAL_CLOSERS)


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
    """Write all prompt files into ``out_dir`` (default ``adaptive_spec/data``); return counts."""
    out = Path(out_dir) if out_dir is not None else DEFAULT_OUT_DIR
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}

    _write(out / "chat.jsonl", CHAT_PROMPTS, "chat")
    counts["chat.jsonl"] = len(CHAT_PROMPTS)

    for stem, (domain, builder, offset) in DOMAIN_BUILDERS.items():
        prompts = build_domain(builder, SEED + offset)
        _write(out / f"{stem}.jsonl", prompts, domain)
        counts[f"{stem}.jsonl"] = len(prompts)

    rows = build_json_schema_rows(SEED + DOMAIN_BUILDERS["json_extraction"][2])
    _write(out / "json_schema.jsonl", [text for text, _ in rows], "json_extraction", [f for _, f in rows])
    counts["json_schema.jsonl"] = len(rows)
    return counts


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else None
    for name, n in main(target).items():
        print(f"{name}: {n}")
