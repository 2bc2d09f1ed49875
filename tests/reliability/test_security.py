"""Security promises on real processes: tokens, secrets, privacy, retention, bind address.

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/reliability/test_security.py -q -s   (about 40 s)

- The admin and API tokens are checked with a constant-time comparison (service/deps.py), and a
  missing, wrong or prefix token is refused while nothing moves in the registry.
- Secrets (the admin token, the API key, a Redis password inside REDIS_URL) appear nowhere in the
  server's log (at INFO, through a Redis outage and a shutdown), in /metrics, or in any GET route
  of the OpenAPI schema.
- A request that opts out of logging leaves nothing at all in Redis: no stream entry, no dashboard
  counter, no key; a normal request afterwards does (so the check can fail).
- Retention is bounded: the correction stream stays near ADAPTIVE_SPEC_STREAM_MAXLEN (MAXLEN ~),
  and every other key the server writes either expires or is a capped stream.
- `adaptive-spec serve` without --host listens on 127.0.0.1 only, as does the Redis the suite starts.
"""

from __future__ import annotations

import ast
import inspect
import time

import httpx
import pytest
import redis
from registry_support import write_adapter
from support import MODEL, ServeProcess, eventually, kill_redis, listening_address, tiny_target

from adaptive_spec.contracts import CORRECTION_STREAM, PAYLOAD_FIELD, STATS_ADAPTERS_KEY, STATS_EVENTS_KEY
from adaptive_spec.formats.record import CorrectionRecord
from service import deps

pytestmark = pytest.mark.redis

ADMIN_TOKEN = "s3cret-admin-9f2c41d7"
API_KEY = "s3cret-apikey-52be07aa"
REDIS_PASSWORD = "s3cret-redispw-c0ffee11"
SECRETS = (ADMIN_TOKEN, API_KEY, REDIS_PASSWORD)
BODY = {"model": MODEL, "prompt": [5, 17, 33, 8, 5, 17], "max_tokens": 4, "temperature": 0}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def require_password(server, password: str) -> None:
    redis.Redis(host="127.0.0.1", port=server.port).config_set("requirepass", password)


@pytest.fixture(scope="module")
def locked_down(tmp_path_factory, tiny_model_dir):
    """A server with every secret set, on a Redis that requires a password, with an MLflow registry on sqlite."""
    from launch.redis import started_server

    workdir = tmp_path_factory.mktemp("locked-down")
    redis_server = started_server(workdir)
    require_password(redis_server, REDIS_PASSWORD)
    env = {
        "REDIS_URL": f"redis://:{REDIS_PASSWORD}@127.0.0.1:{redis_server.port}/0",
        "ADAPTIVE_SPEC_ADMIN_TOKEN": ADMIN_TOKEN,
        "ADAPTIVE_SPEC_API_KEY": API_KEY,
        "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}",
    }
    server = ServeProcess(workdir, tiny_model_dir, env, args=[], verbose=True)  # no --host: the default
    server.start()
    try:
        yield server, redis_server
    finally:
        server.stop()
        redis_server.stop()


def test_tokens_are_compared_in_constant_time():
    """Both checks go through secrets.compare_digest (= hmac.compare_digest), and neither compares with ==."""
    for check in (deps.require_admin, deps.require_api_key):
        tree = ast.parse(inspect.getsource(check))
        calls = [
            node.func.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        ]
        equalities = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops)
        ]
        assert "compare_digest" in calls, check.__name__
        assert not equalities, f"{check.__name__} compares with ==: {[ast.unparse(e) for e in equalities]}"


def test_admin_refuses_without_the_token_and_nothing_moves(locked_down):
    server, _ = locked_down
    url = server.url + "/admin/adapters"
    for headers in (
        {},
        {"Authorization": "Bearer"},
        bearer("wrong"),
        bearer(ADMIN_TOKEN[:-1]),
        bearer(ADMIN_TOKEN + "x"),
        bearer(API_KEY),
        {"Authorization": ADMIN_TOKEN},
    ):
        for method, path in (("GET", ""), ("POST", "/rollback"), ("POST", "/promote")):
            response = httpx.request(method, url + path, headers=headers, json={"version": "1"})
            assert response.status_code == 401, (headers, method, path, response.text)
    # the first authorised call opens the MLflow store (imports, sqlite schema): seconds on a busy machine
    assert httpx.get(url, headers=bearer(ADMIN_TOKEN), timeout=60).json()["aliases"] == {}
    assert httpx.post(server.url + "/v1/completions", json=BODY, headers=bearer(ADMIN_TOKEN)).status_code == 401
    assert httpx.post(server.url + "/v1/completions", json=BODY, headers=bearer(API_KEY)).status_code == 200


def test_secrets_never_appear_in_logs_metrics_or_any_route(locked_down):
    server, redis_server = locked_down
    for key in (API_KEY, "wrong-key"):
        httpx.post(server.url + "/v1/completions", json=BODY, headers=bearer(key))
    httpx.get(server.url + "/admin/adapters", headers=bearer(ADMIN_TOKEN))
    httpx.get(server.url + "/admin/adapters", headers=bearer("wrong-token"))
    kill_redis(redis_server)  # connection errors get logged: they must not carry the URL's password
    for _ in range(3):
        assert httpx.post(server.url + "/v1/completions", json=BODY, headers=bearer(API_KEY)).status_code == 200
    time.sleep(1.5)  # the writer and the dashboard store retry and log
    redis_server.start()
    require_password(redis_server, REDIS_PASSWORD)
    eventually(lambda: server.health()["correction_log"]["queue_depth"] == 0, 15, "the writer to catch up")

    schema = httpx.get(server.url + "/openapi.json").json()
    pages = {}
    for path, methods in schema["paths"].items():
        if "get" in methods and "{" not in path:
            headers = bearer(ADMIN_TOKEN if path.startswith("/admin") else API_KEY)
            pages[path] = httpx.get(server.url + path, headers=headers).text
    pages["/openapi.json"] = str(schema)
    pages["/dashboard"] = httpx.get(server.url + "/dashboard").text
    assert {"/metrics", "/health", "/v1/models", "/admin/adapters", "/api/stats/summary"} <= set(pages)
    log = server.log()
    assert "serving tiny" in log and "redis://***@127.0.0.1" in log  # the settings were logged, redacted
    for secret in SECRETS:
        assert secret not in log, f"a secret is in the server log: {secret[:10]}..."
        for path, text in pages.items():
            assert secret not in text, f"a secret is in {path}"
    print(f"\nchecked {len(log.splitlines())} log lines and {len(pages)} GET routes for {len(SECRETS)} secrets")


def test_server_listens_on_loopback_by_default(locked_down):
    server, redis_server = locked_down
    assert "--host" not in server.command
    assert listening_address(server.port) == "127.0.0.1"
    assert listening_address(redis_server.port) == "127.0.0.1"  # the Redis that tests and `up` start


def records_everywhere(client: redis.Redis) -> dict[bytes, bytes]:
    """Every key with what it holds, readable: hash fields and values, stream entries (correction records
    decoded to their request id, domain and tokens), strings, and the members of lists, sets and zsets."""
    held = {}
    for key in client.scan_iter():
        kind = client.type(key)
        if kind == b"hash":
            parts = [b"%s=%s" % item for item in client.hgetall(key).items()]
        elif kind == b"stream":
            parts = []
            for _, fields in client.xrange(key):
                for name, value in fields.items():
                    if key == CORRECTION_STREAM.encode() and name == PAYLOAD_FIELD.encode():
                        record = CorrectionRecord.decode(value)
                        value = f"{record.request_id} {record.domain} {record.prompt_ids} {record.output_ids}".encode()
                    parts.append(name + b"=" + value)
        elif kind == b"string":
            parts = [client.get(key)]
        else:
            parts = (
                client.lrange(key, 0, -1)
                if kind == b"list"
                else list(client.zrange(key, 0, -1) if kind == b"zset" else client.smembers(key))
            )
        held[key] = b"\n".join(parts)
    return held


def test_opted_out_requests_leave_no_trace_in_redis(serve_process, redis_server):
    client = redis.Redis.from_url(redis_server.url)
    with serve_process(env={"REDIS_URL": redis_server.url}) as server:
        private = {**BODY, "adaptive_spec": {"log": False, "domain": "private-tag"}}
        ids = [httpx.post(server.url + "/v1/completions", json=private).headers["x-request-id"] for _ in range(5)]
        eventually(
            lambda: server.metric("adaptive_spec:request_success_total", domain="private-tag") == 5,
            10,
            "the opted-out requests to finish",
        )
        time.sleep(2.5)  # the dashboard store flushes every second; the writer at once
        after_private = records_everywhere(client)

        logged = httpx.post(server.url + "/v1/completions", json={**BODY, "adaptive_spec": {"domain": "shared-tag"}})
        eventually(lambda: client.xlen(CORRECTION_STREAM) == 1, 10, "the logged request's record")
        eventually(
            lambda: any(b"shared-tag" in value for value in records_everywhere(client).values()),
            10,
            "the logged request's dashboard counters",
        )
    print(
        f"\nafter 5 opted-out requests Redis held {len(after_private)} keys; after one logged request: "
        f"{sorted(k.decode() for k in records_everywhere(client))}"
    )
    assert after_private == {}, sorted(after_private)
    everything = b"".join(records_everywhere(client).values())
    assert logged.headers["x-request-id"].encode() in everything  # the control: a logged request is found
    assert not any(request_id.encode() in everything for request_id in ids)
    assert b"private-tag" not in everything


def test_stream_and_dashboard_retention_are_bounded(serve_process, redis_server, tiny_model_dir, tmp_path):
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("stream-node-max-entries", 10)  # MAXLEN ~ trims whole nodes: small nodes, tight bound
    maxlen, requests = 20, 120
    # served from the start, so the dashboard also keeps its gate figures (the adapters hash)
    adapter = write_adapter(tiny_target(0), 1, tmp_path / "v0001", seed=1, version=1, target_id=str(tiny_model_dir))
    env = {
        "REDIS_URL": redis_server.url,
        "ADAPTIVE_SPEC_STREAM_MAXLEN": str(maxlen),
        "ADAPTIVE_SPEC_ADAPTER": str(adapter),
    }
    with serve_process(env=env) as server:
        body = {**BODY, "max_tokens": 2}
        with httpx.Client() as http:
            statuses = {http.post(server.url + "/v1/completions", json=body).status_code for _ in range(requests)}
        eventually(lambda: server.health()["correction_log"]["written"] == requests, 15, "every record written")
        time.sleep(1.5)  # one more dashboard flush
    length = client.xlen(CORRECTION_STREAM)
    keys = {key.decode(): (client.type(key).decode(), client.ttl(key)) for key in client.scan_iter()}
    print(f"\n{requests} records with MAXLEN ~ {maxlen}: stream length {length}; keys {keys}")
    assert statuses == {200}
    assert maxlen <= length <= maxlen + 10
    for key, (kind, ttl) in keys.items():
        if kind == "stream":  # the two streams are written with MAXLEN ~ (10000 for the swap markers)
            assert key in (CORRECTION_STREAM, STATS_EVENTS_KEY), f"{key}: a stream nobody caps"
            continue
        assert 0 < ttl <= 7 * 86400, f"{key} ({kind}) never expires"
    assert any(kind == "hash" for kind, _ in keys.values()), "the dashboard wrote no bucket: nothing was checked"
    assert STATS_ADAPTERS_KEY in keys, "the served adapter's figures were not kept: that key was not checked"


@pytest.mark.parametrize(
    "name, value, said",
    [
        ("ADAPTIVE_SPEC_ADMIN_TOKEN", "change-me", "holds a placeholder"),
        ("ADAPTIVE_SPEC_API_KEY", "short-key-1", "is too weak (11 characters"),
        ("ADAPTIVE_SPEC_SIGNING_KEY", "aaaaaaaaaaaaaaaaaaaa", "is too weak (20 characters, 1 distinct)"),
    ],
)
def test_weak_tokens_and_placeholders_are_refused_at_start(serve_process, tmp_path, name, value, said):
    """The shipped manifest's `change-me` (and any short or one-letter token) stops the server before it loads
    anything, with a message that says how to make a real one."""
    server = ServeProcess(tmp_path, tmp_path / "never-loaded", {name: value}, [])
    server.launch()
    assert server.wait(60) == 2
    log = server.log()
    assert f"adaptive-spec: error: {name} {said}" in log and "openssl rand -hex 24" in log, log[-2000:]
    assert value not in log.replace(f"{name} {said}", "")  # the refused value itself is never echoed


def test_serving_beyond_loopback_without_an_api_key_warns(tmp_path, tiny_model_dir):
    """`serve --host 0.0.0.0` with no ADAPTIVE_SPEC_API_KEY says, before it loads anything, that /v1 is open;
    the same server on loopback does not (nor does one with a key). It is stopped before it binds."""
    said = "without ADAPTIVE_SPEC_API_KEY: /v1 is open to anyone who reaches this address"
    servers = {}
    try:
        for case, env, args in (  # launched together: each spends its seconds importing
            ("open", {}, ["--host", "0.0.0.0"]),
            ("keyed", {"ADAPTIVE_SPEC_API_KEY": API_KEY}, ["--host", "0.0.0.0"]),
            ("loopback", {}, []),
        ):
            (tmp_path / case).mkdir()
            server = ServeProcess(tmp_path / case, tiny_model_dir, env, args)
            server.launch()
            servers[case] = server
        for server in servers.values():
            server.wait_until(lambda s=server: "ADAPTIVE_SPEC_SIGNING_KEY is not set" in s.log(), 90, "its warnings")
    finally:
        for server in servers.values():
            server.stop()
    logs = {case: server.log() for case, server in servers.items()}
    assert said in logs["open"] and said not in logs["keyed"] and said not in logs["loopback"]
