"""`adaptive-spec bench-chaos`: a small fleet on loopback under traffic, with a random fault every 20-40 s.

    adaptive-spec bench-chaos --minutes 20 --json chaos.json --plot chaos.png     # the run RELIABILITY.md reports
    adaptive-spec bench-chaos --minutes 3                                          # a short look (CPU: ~3 minutes)
    adaptive-spec bench-chaos --target smollm2-135m-instruct --draft head          # the default model instead

The fleet, as the README's fleet section and ops/compose.yaml run it, every process on 127.0.0.1: Redis
(append-only, a password, `maxmemory` with `noeviction`), an `mlflow server`, two `adaptive-spec serve`
replicas and one `adaptive-spec train`, sharing one signing key. `--users` closed-loop users send
completions; each picks the next replica in turn and, when a request fails (refused, reset, or a 5xx),
sends it once to the other replica, as a load balancer that retries would.

Faults, one at a time, each 20-40 s after the last one ended, chosen at random (`--seed`):

| fault | what happens | what must hold |
|---|---|---|
| `redis_kill` | SIGKILL, restarted 3 s later on its port and files | no request fails; no record Redis acknowledged is lost |
| `redis_stop` | SIGSTOP for 5 s, then SIGCONT | the same |
| `trainer_kill` | SIGKILL, restarted 2 s later (an orchestrator's job) | it resumes from its checkpoint and re-reads what it had not acknowledged |
| `mlflow_down` | the server stopped for 15 s | serving goes on; promotions wait and land |
| `replica_restart` | SIGTERM to one replica, restarted on its port | its requests in flight finish; the others go to the other replica |
| `bad_records` | 6 bad records (ids past the vocabulary, another target, NaN log-probabilities) written into the stream | the trainer drops them and trains on |
| `forged_version` | a version registered by hand without the key (unsigned, or with a NaN weight) and promoted | both replicas refuse it and keep serving; then an operator's rollback |
| `rollback_race` | `adapters rollback` (a process) and an admin-API promotion at the same moment | the aliases end as the two moves made one after the other |

The report: requests sent, answered and failed (on both replicas), retried, 5xx from a replica that was
not being faulted; records Redis acknowledged (each writer's `written`, from the line each server process logs
as it stops) against the distinct records in the stream at the end: lost is the larger of two lower bounds,
acknowledged minus in the stream, and answered requests without a record minus what the writers dropped (a
record dropped while Redis was away for longer than the writer's queue lasts was never acknowledged); the
trainer's status; versions the trainer promoted, versions forged and which replicas refused each; swaps;
every fault with its outcome; processes that exited without a fault (restarted, as an orchestrator would).
`--json` writes it with a timeline (one sample a second) and `--plot` draws the timeline with the faults
marked. The bar (`bar`) is what a fleet owes its users: no acknowledged record lost, no request failed on both replicas, no
5xx from a live replica, at least one version promoted, every forged or NaN version refused by both
replicas; the command exits 1 when any of them fails.

The model: by default the tests' tiny random Llama (benchmarks/tiny_model.py: 4 layers, 64 wide, 112
tokens) with the draft `early-exit:1`. On 2 CPU cores, three processes of the default model would decode
a few requests a minute between them and promote perhaps once in 20 minutes; the tiny model runs every
code path (records, rounds, the gate, registration, signatures, swaps) hundreds of times in the same time,
which is what faults need.
"""

from benchmarks.chaos.report import bar, plot, summary
from benchmarks.chaos.run import run_chaos
from benchmarks.chaos.settings import FAULTS, ChaosSettings

__all__ = ["FAULTS", "ChaosSettings", "bar", "plot", "run_chaos", "summary"]
