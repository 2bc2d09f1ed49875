"""Watching the fleet once a second: what each replica serves, its writer's counters, its refusals; the
registry's events."""

from __future__ import annotations

import threading
import time

import httpx

from benchmarks.chaos.fleet import Fleet, Replica


class Monitor:
    """Once a second: what each replica serves and its writer's counters; the registry's events (pub/sub)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.samples: list[dict] = []
        self.events: list[dict] = []
        self.served: dict[str, list[tuple[float, str | None]]] = {r.name: [] for r in fleet.replicas}
        self.stop = threading.Event()
        from registry.events import AdapterEvents

        self._events = AdapterEvents(fleet.redis.url)
        self._threads = [
            threading.Thread(target=self._poll, daemon=True),
            threading.Thread(target=self._events.listen, args=(self._event, self.stop), daemon=True),
        ]

    def __enter__(self) -> Monitor:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(10)

    def _event(self, event: dict) -> None:
        self.events.append({**event, "received": time.time()})

    def health(self, replica: Replica) -> dict | None:
        try:
            answer = httpx.get(replica.url + "/health", timeout=2)
            return answer.json() if answer.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def refusals(self, replica: Replica) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        try:
            text = httpx.get(replica.url + "/metrics", timeout=5).text
        except httpx.HTTPError:
            return {}
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "adaptive_spec:adapter_refusals_total":
                    found[sample.labels["reason"]] = sample.value
        return found

    def _poll(self) -> None:
        while not self.stop.wait(1.0):
            self.fleet.supervise(time.time())
            sample: dict = {"t": time.time()}
            for replica in self.fleet.replicas:
                health = self.health(replica)
                sample[replica.name] = None if health is None else health["adapter_version"]
                if health is not None:
                    replica.written[replica.life] = health["correction_log"]["written"]
                    replica.dropped[replica.life] = health["correction_log"]["dropped"]
                    history = self.served[replica.name]
                    if not history or history[-1][1] != health["adapter_version"]:
                        history.append((time.time(), health["adapter_version"]))
            self.samples.append(sample)
