"""One rule for domain names (issue 30, item 8), at the API: a tag the registry's aliases cannot carry is a 400
(before: `sql.v2` passed and was trained into the general adapter); one they can is served, and the trainer
gives it an adapter of its own (adaptive_spec/contracts.py `check_domain`, `is_alias_domain`).

OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/service/test_domain_rule.py -q
"""

from __future__ import annotations

import httpx
import pytest

from adaptive_spec.contracts import champion_alias, is_alias_domain

NAMES = ["sql", "sql-v2", "json_extraction", "A1", "x" * 64, "sql.v2", "a b", "-x", "x-", "sql--v2", "x" * 65, "é"]


def test_the_api_takes_exactly_the_domains_an_alias_can_carry(live_server, tiny_engine):
    with live_server(tiny_engine) as server:
        body = {"model": tiny_engine.target_id, "prompt": [5, 6, 7], "max_tokens": 2}
        for name in NAMES:
            answer = httpx.post(server.url + "/v1/completions", json={**body, "adaptive_spec": {"domain": name}})
            assert answer.status_code == (200 if is_alias_domain(name) else 400), (name, answer.text)
            if answer.status_code == 400:
                assert answer.json()["error"]["param"] == "adaptive_spec.domain", answer.text
            else:
                assert champion_alias(name) == f"champion-{name}"
    assert [n for n in NAMES if is_alias_domain(n)] == ["sql", "sql-v2", "json_extraction", "A1", "x" * 64]


@pytest.mark.parametrize("name", ["sql.v2", "a b"])
def test_a_name_no_alias_can_carry_names_no_alias(name):
    with pytest.raises(ValueError, match="letters, digits"):
        champion_alias(name)
