"""What every generated prompt set draws with: the version-stable `Rng`, the word pools and templates of
``templates/``, the slots of a template filled (picked from a pool or computed, `COMPUTED`), and
`build_domain`, which draws a domain's distinct prompts."""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from pathlib import Path

DOMAIN_SIZE = 400
TEMPLATES = Path(__file__).resolve().parent / "templates"


def load_template(name: str) -> dict:
    return json.loads((TEMPLATES / f"{name}.json").read_text(encoding="utf-8"))


POOLS = load_template("pools")


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


def pick(rng: Rng, pool: str):
    return rng.choice(POOLS[pool])


def person(rng: Rng) -> tuple[str, str]:
    return pick(rng, "first_names"), pick(rng, "last_names")


def email_address(first: str, last: str, rng: Rng) -> str:
    local = rng.choice([f"{first}.{last}", f"{first[0]}{last}", f"{first}{rng.randint(1, 99)}"])
    local = "".join(c for c in local.lower() if c.isalnum() or c == ".")
    return f"{local}@{pick(rng, 'email_domains')}"


# --------------------------------------------------------------------------- slots

# The slots whose value is computed rather than picked (templates/*.json name the others).
COMPUTED: dict[str, Callable[[Rng], str]] = {
    "salary": lambda r: str(r.randint(4, 15) * 10000),
    "iso_date": lambda r: f"{r.randint(2019, 2025)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
    "iso_date2": lambda r: f"2026-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
    "product": lambda r: pick(r, "products")[0],
    "full_name": lambda r: " ".join(person(r)),
    "sample_name": lambda r: " ".join(person(r)),
    "sensor": lambda r: f"S-{r.randint(1, 60):02d}",
    "pet_age": lambda r: (lambda n: ("an " if n in (8, 11) else "a ") + str(n))(r.randint(1, 12)),
    "wake_time": lambda r: r.choice(["5:30", "6:00", "6:30", "7:00"]) + " am",
    "hhmm": lambda r: f"{r.randint(8, 19):02d}:{r.choice(['00', '15', '30', '45'])}",
    "email": lambda r: email_address(*person(r), r),
    "order_id": lambda r: f"{r.choice(['A', 'B', 'K', 'T', 'X'])}{r.randint(10000, 99999)}",
}


def _slot(name: str, rng: Rng, slots: dict) -> str:
    spec = slots.get(name)
    if spec is None:
        return COMPUTED[name](rng)
    if isinstance(spec, list):
        return rng.choice(spec)
    if "pool" in spec:
        return pick(rng, spec["pool"])
    if "randint" in spec:
        return str(rng.randint(*spec["randint"]))
    return _slot(spec["like"], rng, slots)


def fill_slots(template: str, rng: Rng, slots: dict) -> str:
    """Fill every ``{slot}`` of ``template``; slots sharing a pool (``city``/``city2``) differ."""
    return filled_slots(template, rng, slots)[0]


def filled_slots(template: str, rng: Rng, slots: dict) -> tuple[str, dict[str, str]]:
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


# --------------------------------------------------------------------------- a domain's prompts


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
