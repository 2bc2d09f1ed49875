"""The ``tool_calls`` set: agent requests offering 2-4 of 8 tools, with the calls made so far and their
results (templates/tool_calls.json)."""

from __future__ import annotations

import json

from benchmarks.prompts.draw import DOMAIN_SIZE, Rng, filled_slots, load_template

TOOLS = load_template("tool_calls")


def _tool(name: str) -> dict:
    spec = TOOLS["tools"][name]
    return {
        "type": "function",
        "function": {"name": name, "description": spec["description"], "parameters": spec["parameters"]},
    }


def _request(name: str, rng: Rng) -> tuple[str, dict]:
    """A user's request for tool `name`, and the arguments a correct call of it takes."""
    text, values = filled_slots(rng.choice(TOOLS["requests"][name]), rng, TOOLS["slots"])
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
