"""The admin routes: /admin/adapters (list), /admin/adapters/rollback, /admin/adapters/promote.

Run: .venv/bin/python -m pytest tests/service/test_admin.py -q   (tiny engine, real MLflow on sqlite, ~15 s)

What must hold:

- without a token, with a wrong one, or with another scheme: 401 in OpenAI's error shape, and nothing
  moves; with no token configured on the server: 403 for every route, whatever is sent;
- with the token: the list shows versions, aliases and the served version; a rollback or promote
  moves the aliases, is recorded with `by` = admin-api:<who>@<address>, and this server swaps at
  once (its poll is a minute long: the route wakes the watcher);
- bad requests are 4xx: unknown version 404, nothing to roll back to 409, a bad body 400 (a domain name
  no alias can carry too); no registry configured 503;
- a body's `domain` moves that domain's aliases only; the server loads the version into that domain's slot
  and the list shows it in `served_versions` under the alias it follows.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from polling import wait_for
from registry_support import write_adapter
from tiny import tiny_target

from adaptive_spec import Engine
from registry.client import AdapterRegistry

pytestmark = pytest.mark.usefixtures("one_thread")

TOKEN = "s3cret-admin-token"


@pytest.fixture(scope="module")
def target():
    return tiny_target(0)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, target) -> Path:
    """A data dir whose default mlflow.db holds versions 1..3 of three adapters, champion 3, previous 2."""
    root = tmp_path_factory.mktemp("admin")
    registry = AdapterRegistry(f"sqlite:///{root / 'mlflow.db'}", data_dir=root)
    for i in (1, 2, 3):
        registry.register(write_adapter(target, 1, root / "adapters" / f"v{i:04d}", seed=i, version=i), by="trainer")
    return root


@pytest.fixture(scope="module")
def server(live_server, target, data_dir):
    """Finds the registry as `serve` does: the default mlflow.db in its data dir."""
    with live_server(
        Engine(target, "early-exit:1", k=3), data_dir=data_dir, admin_token=TOKEN, adapter_poll_s=60.0
    ) as server:
        wait_for(lambda: server.service.engine.adapter_version == "3", 10, "the initial champion")
        yield server


def auth(token: str = TOKEN) -> dict:
    return {"Authorization": f"Bearer {token}"}


def assert_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    return error


ROUTES = [
    ("GET", "/admin/adapters", None),
    ("POST", "/admin/adapters/rollback", None),
    ("POST", "/admin/adapters/rollback", {"to": "1"}),
    ("POST", "/admin/adapters/promote", {"version": "1"}),
]


@pytest.mark.parametrize("method,path,body", ROUTES)
@pytest.mark.parametrize(
    "headers",
    [{}, auth("wrong-token"), auth(TOKEN + "x"), {"Authorization": f"Basic {TOKEN}"}, {"Authorization": "Bearer"}],
    ids=["none", "wrong", "longer", "basic", "empty"],
)
def test_refused_without_the_right_token_and_nothing_moves(server, method, path, body, headers):
    registry = server.service.registry
    before = registry.aliases()
    response = httpx.request(method, server.url + path, json=body, headers=headers)
    error = assert_error(response, 401, "invalid_admin_token")
    assert error["type"] == "authentication_error" and response.headers["www-authenticate"] == "Bearer"
    assert registry.aliases() == before


def test_no_token_configured_refuses_everything(live_server, target, data_dir):
    with live_server(Engine(target, "early-exit:1", k=3), data_dir=data_dir, adapter_poll_s=0) as server:
        for method, path, body in ROUTES:
            for headers in ({}, auth(), auth("anything")):
                error = assert_error(
                    httpx.request(method, server.url + path, json=body, headers=headers), 403, "admin_disabled"
                )
                assert error["type"] == "permission_error"


def test_list_rollback_and_promote_with_the_token(server):
    listed = httpx.get(server.url + "/admin/adapters", headers=auth())
    assert listed.status_code == 200, listed.text
    body = listed.json()
    assert body["served_version"] == "3" and body["aliases"] == {"champion": "3", "previous": "2"}
    assert [(v["version"], v["aliases"]) for v in body["data"]] == [("1", []), ("2", ["previous"]), ("3", ["champion"])]
    assert all(v["candidate_greedy_match"] is not None and v["created_at"] > 0 for v in body["data"])

    engine = server.service.engine
    response = httpx.post(server.url + "/admin/adapters/rollback", headers=auth(), json={"by": "oncall"})
    assert response.status_code == 200, response.text
    event = response.json()["event"]
    assert (event["event"], event["version"], event["from"]) == ("rollback", "2", "3")
    assert event["by"] == "admin-api:oncall@127.0.0.1"
    swaps = server.service.watcher.swaps
    wait_for(lambda: swaps[-1][1] == "2", 5, "the swap after the rollback (woken, not polled)")
    assert swaps[-1][:2] == ("rollback", "2") and engine.adapter_version == "2"
    assert server.service.registry.get("2").tags["adaptive_spec.last_action_by"] == "admin-api:oncall@127.0.0.1"

    assert_error(httpx.post(server.url + "/admin/adapters/rollback", headers=auth()), 409, "conflict")

    response = httpx.post(server.url + "/admin/adapters/rollback", headers=auth(), json={"to": 1})
    assert response.status_code == 200 and response.json()["event"]["version"] == "1"
    wait_for(lambda: swaps[-1][1] == "1", 5, "the swap after rollback --to 1")

    response = httpx.post(server.url + "/admin/adapters/promote", headers=auth(), json={"version": "3"})
    assert response.status_code == 200, response.text
    assert response.json()["event"]["by"] == "admin-api:token@127.0.0.1"
    wait_for(lambda: swaps[-1][1] == "3", 5, "the swap after the promote")
    assert server.service.registry.aliases() == {"champion": "3", "previous": "1"}
    assert [swap.kind for swap in server.service.watcher.swaps[-3:]] == ["rollback", "rollback", "swap"]


@pytest.mark.parametrize(
    "path,body,status,code",
    [
        ("/admin/adapters/promote", {"version": "99"}, 404, "unknown_version"),
        ("/admin/adapters/rollback", {"to": "99"}, 404, "unknown_version"),
        ("/admin/adapters/promote", {}, 400, "missing_field"),
        ("/admin/adapters/promote", {"version": "1", "extra": 1}, 400, None),
        ("/admin/adapters/rollback", {"to": [1]}, 400, None),
        ("/admin/adapters/promote", {"version": 10**30}, 400, None),  # was a 503: sqlite cannot hold it (fuzzer)
        ("/admin/adapters/rollback", {"to": "v2"}, 400, None),
        ("/admin/adapters/promote", {"version": "1", "domain": "no way"}, 400, None),
        ("/admin/adapters/promote", {"version": "1", "domain": 7}, 400, None),
        ("/admin/adapters/rollback", {"domain": "a.b"}, 400, None),
        ("/admin/adapters/rollback", {"domain": "x" * 65}, 400, None),
    ],
)
def test_bad_admin_requests_are_4xx(server, path, body, status, code):
    before = server.service.registry.aliases()
    assert_error(httpx.post(server.url + path, headers=auth(), json=body), status, code)
    assert server.service.registry.aliases() == before


def test_a_domain_moves_its_own_aliases_and_slot(server):
    registry, engine = server.service.registry, server.service.engine
    general, before = engine.adapter_version, registry.aliases()
    response = httpx.post(
        server.url + "/admin/adapters/promote", headers=auth(), json={"version": "1", "domain": "sql"}
    )
    assert response.status_code == 200, response.text
    assert (response.json()["event"]["domain"], response.json()["event"]["version"]) == ("sql", "1")
    wait_for(lambda: engine.adapters.versions().get("sql") == "1", 5, "the sql slot (woken, not polled)")
    body = httpx.get(server.url + "/admin/adapters", headers=auth()).json()
    assert body["served_version"] == general and body["aliases"] == {**before, "champion-sql": "1"}
    assert body["served_versions"] == {"champion": general, "champion-sql": "1"} and body["refused"] == {}

    assert_error(
        httpx.post(server.url + "/admin/adapters/rollback", headers=auth(), json={"domain": "sql"}), 409, "conflict"
    )
    httpx.post(server.url + "/admin/adapters/promote", headers=auth(), json={"version": "2", "domain": "sql"})
    response = httpx.post(server.url + "/admin/adapters/rollback", headers=auth(), json={"domain": "sql"})
    assert response.json()["event"]["version"] == "1" and registry.champions() == {None: general, "sql": "1"}
    assert registry.aliases() == {**before, "champion-sql": "1"}  # the general adapter's aliases never moved
    registry.client.delete_registered_model_alias(registry.model_name, "champion-sql")
    server.service.watcher.wake()
    wait_for(lambda: "sql" not in engine.adapters.versions(), 5, "the sql slot unloaded")
    assert engine.adapter_version == general


def test_no_registry_is_503(live_server, target, tmp_path):
    with live_server(Engine(target, "early-exit:1", k=3), data_dir=tmp_path, admin_token=TOKEN) as server:
        assert server.service.registry is None
        assert_error(httpx.get(server.url + "/admin/adapters", headers=auth()), 503, "no_registry")
        assert_error(httpx.post(server.url + "/admin/adapters/rollback", headers=auth()), 503, "no_registry")


def test_a_token_read_with_a_trailing_newline_still_matches(live_server, target, tmp_path):
    """`echo $TOKEN > file` then ADAPTIVE_SPEC_ADMIN_TOKEN=$(cat file)... or a k8s Secret made from that
    file: the configured token ends in a newline that no client sends. Read stripped, it matches."""
    settings = {"data_dir": tmp_path, "admin_token": f"  {TOKEN}\n", "api_key": "s3cret-key-7c41e09d\r\n"}
    with live_server(Engine(target, "early-exit:1", k=3), **settings) as server:
        assert server.service.settings.admin_token == TOKEN
        # past the token check: this server has no registry
        assert_error(httpx.get(server.url + "/admin/adapters", headers=auth()), 503, "no_registry")
        assert_error(httpx.get(server.url + "/admin/adapters", headers=auth(TOKEN + "x")), 401, "invalid_admin_token")
        models = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer s3cret-key-7c41e09d"})
        assert models.status_code == 200
