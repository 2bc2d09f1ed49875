"""Adapter events: the registry announces every promote and rollback on the Redis pub/sub channel
`adaptive_spec:adapters`, and servers listen, so a swap follows within milliseconds instead of at the
next alias poll. Both ends of the protocol are here.

    events = AdapterEvents(os.environ.get("REDIS_URL"))
    events.publish({"event": "rollback", "version": "2", "from": "3", "by": "cli:alice@host", ...})
    events.listen(watcher.wake, stop)       # a server's thread: calls wake(event) until stop is set

An event is one JSON object (AdapterRegistry._record writes it, with the same fields as the
registered model's `adaptive_spec.last_event` tag):

    {"event": "rollback", "model": "adaptive-spec-draft", "version": "2", "from": "3",
     "by": "cli:alice@host", "at": 1763800000.0, "changed": true, "target_id": "...", "draft_id": "early-exit:4"}

Pub/sub is best effort by design: a publisher with no Redis (or Redis down) logs and goes on, and
a listener reconnects every 2 s while Redis is away. Servers also poll the alias (the watcher's
`poll_s`), so a lost event delays a swap by one poll at most; it never loses one.

Tests: `.venv/bin/python -m pytest tests/registry/test_registry.py tests/service/test_watcher.py -q`.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from adaptive_spec.contracts import ADAPTER_EVENTS

log = logging.getLogger(__name__)


class AdapterEvents:
    """The adapter-events channel on `redis_url`; without one, publish() is a no-op and listen() returns."""

    def __init__(self, redis_url: str | None, channel: str = ADAPTER_EVENTS) -> None:
        self.redis_url = redis_url
        self.channel = channel
        self._client: Any = None  # the publisher's redis.Redis, opened on the first publish

    def __bool__(self) -> bool:
        return bool(self.redis_url)

    def publish(self, event: dict) -> bool:
        """Send the event; False (logged) when there is no Redis or it does not answer."""
        if not self.redis_url:
            return False
        import redis

        try:
            if self._client is None:
                self._client = redis.Redis.from_url(self.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
            self._client.publish(self.channel, json.dumps(event))
            return True
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning(
                "could not publish %s on %s (%s); servers will see it on their next alias poll",
                event.get("event"),
                self.channel,
                exc,
            )
            return False

    def listen(self, on_event: Callable[[dict], None], stop: threading.Event) -> None:
        """Call `on_event(event)` for every event until `stop` is set; reconnect while Redis is away."""
        if not self.redis_url:
            return
        import redis

        while not stop.is_set():
            client = pubsub = None
            try:
                client = redis.Redis.from_url(self.redis_url, socket_connect_timeout=2.0)
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.channel)
                while not stop.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message is None or message.get("type") != "message":
                        continue
                    try:
                        event = json.loads(message["data"])
                    except (json.JSONDecodeError, TypeError):
                        event = None
                    if not isinstance(event, dict):
                        log.warning("ignoring a malformed adapter event: %r", message["data"][:200])
                        continue
                    on_event(event)
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.debug("adapter events unavailable (%s); the alias poll goes on", exc)
                stop.wait(2.0)
            finally:
                if pubsub is not None:
                    pubsub.close()
                if client is not None:
                    client.close()

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
