"""The traffic: closed-loop users, each failed attempt sent once more to the other replica, counted in a `Tally`."""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import numpy as np

from benchmarks.chaos.fleet import API_KEY, Fleet, Replica
from benchmarks.chaos.settings import ChaosSettings


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    failed_both: int = 0
    retried: int = 0
    live_5xx: int = 0
    by_status: Counter = field(default_factory=Counter)  # per attempt: "a:200", "b:ConnectError", ...
    answered_at: list[float] = field(default_factory=list)
    failed_at: list[float] = field(default_factory=list)
    versions: Counter = field(default_factory=Counter)
    ids: list[str] = field(default_factory=list)  # request ids answered: each has a record unless dropped


class Users:
    """Closed-loop users; a failed attempt is sent once more to the other replica."""

    def __init__(self, fleet: Fleet, settings: ChaosSettings, tally: Tally) -> None:
        self.fleet, self.tally, self.settings = fleet, tally, settings
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._turn = 0
        rng = np.random.default_rng(settings.seed)
        if settings.target is None:  # token prompts from a narrow range: a 1-layer draft can learn the traffic
            self.prompts: list = [rng.integers(3, 19, 8).tolist() for _ in range(16)]
        else:
            from adaptive_spec.outputs.prompts import load_prompts
            from benchmarks.prompts import shipped

            self.prompts = [item.prompt for item in load_prompts(shipped("json_extraction"))[:64]]
        self.threads = [threading.Thread(target=self._user, daemon=True) for _ in range(settings.users)]

    def __enter__(self) -> Users:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)

    def _user(self) -> None:
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            while not self.stop.is_set():
                with self._lock:
                    self._turn += 1
                    first = self._turn % 2
                    prompt = self.prompts[self._turn % len(self.prompts)]
                    self.tally.sent += 1
                order = [self.fleet.replicas[first], self.fleet.replicas[1 - first]]
                for attempt, replica in enumerate(order):
                    ok = self._attempt(client, replica, prompt)
                    if ok:
                        break
                    if attempt == 0:
                        with self._lock:
                            self.tally.retried += 1
                else:
                    with self._lock:
                        self.tally.failed_both += 1
                        self.tally.failed_at.append(time.time())
                    time.sleep(0.2)

    def _attempt(self, client: httpx.Client, replica: Replica, prompt) -> bool:
        faulted = replica.faulted.is_set()
        body = {"model": "chaos", "max_tokens": self.settings.max_tokens, "temperature": 0}
        chat = isinstance(prompt, list) and isinstance(prompt[0], dict)
        try:
            if chat:
                answer = client.post(replica.url + "/v1/chat/completions", json={**body, "messages": prompt})
            else:
                answer = client.post(replica.url + "/v1/completions", json={**body, "prompt": prompt})
            status = str(answer.status_code)
        except httpx.HTTPError as exc:
            answer, status = None, type(exc).__name__
        with self._lock:
            self.tally.by_status[f"{replica.name}:{status}"] += 1
            if answer is not None and answer.status_code >= 500 and not (faulted or replica.faulted.is_set()):
                self.tally.live_5xx += 1
            if answer is not None and answer.status_code == 200:
                self.tally.answered += 1
                self.tally.answered_at.append(time.time())
                self.tally.versions[answer.json()["usage"]["spec_decode"]["adapter_version"] or "base"] += 1
                self.tally.ids.append(answer.headers.get("x-request-id", ""))
                return True
        return False
