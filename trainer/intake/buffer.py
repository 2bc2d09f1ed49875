"""What the trainer keeps of the stream: a replay buffer to train on and a held-out set to judge by.

    holdout, replay = HoldoutSplit(fraction=0.1, max_records=256), ReplayBuffer(max_tokens=200_000)
    for record in records:                        # from trainer.stream.CorrectionStream
        if not holdout.add(record):               # about 1 record in 10 is held out, never trained on
            replay.add(examples_from_record(record))
    batch = replay.sample_batch(rng, settings.batch_tokens)

Run its tests: `.venv/bin/python -m pytest tests/trainer/test_buffer.py -q`.

The stream is at-least-once: a record may arrive twice (a reclaim after a crash, or the writer
retrying). Both stores ignore a request id they hold or recently held, so a duplicate is never
trained on twice as often nor counted twice in the gate. Whether a record is held out depends only
on a hash of its request id, so every delivery of it, in any process, lands on the same side.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np

from adaptive_spec.formats.record import CorrectionRecord
from trainer.intake.examples import TrainingExample


class _RecentIds:
    """The last `capacity` ids seen, for dedupe with bounded memory (about 100 bytes an id)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._order: deque[str] = deque()
        self._ids: set[str] = set()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def add(self, request_id: str) -> None:
        self._order.append(request_id)
        self._ids.add(request_id)
        while len(self._order) > self.capacity:
            self._ids.discard(self._order.popleft())


class ReplayBuffer:
    """Training examples, oldest evicted first once their tokens exceed `max_tokens`.

    Tokens are input tokens (prompt + output, as fed to the draft), the cost of replaying an
    example. At 160 tokens a record, 200_000 tokens hold the last 1,250 records. Request ids are
    remembered for `remember_ids` additions, past eviction, so a late duplicate is still refused.
    """

    def __init__(self, max_tokens: int, remember_ids: int = 100_000) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._examples: deque[TrainingExample] = deque()
        self._seen = _RecentIds(max(remember_ids, 1))
        self.tokens = 0  # input tokens held now
        self.added = 0
        self.duplicates = 0  # refused: request id already seen
        self.evicted = 0
        self.refused = 0  # refused: no output position, or longer than max_tokens on its own

    def __len__(self) -> int:
        return len(self._examples)

    def __iter__(self):
        return iter(self._examples)

    @property
    def positions(self) -> int:
        """Output positions held now."""
        return sum(example.num_positions for example in self._examples)

    def add(self, example: TrainingExample) -> bool:
        """Keep the example unless it is a duplicate or useless; evict the oldest to fit. True if kept."""
        if example.request_id in self._seen:
            self.duplicates += 1
            return False
        if example.num_positions == 0 or example.num_tokens > self.max_tokens:
            self.refused += 1
            return False
        self._seen.add(example.request_id)
        self._examples.append(example)
        self.tokens += example.num_tokens
        self.added += 1
        while self.tokens > self.max_tokens:
            self.tokens -= self._examples.popleft().num_tokens
            self.evicted += 1
        return True

    def drop(self, request_ids: set[str]) -> int:
        """Take these records' examples out; their ids stay remembered. Returns how many went."""
        kept = deque(example for example in self._examples if example.request_id not in request_ids)
        dropped, self._examples = len(self._examples) - len(kept), kept
        self.tokens = sum(example.num_tokens for example in kept)
        return dropped

    def sample_batch(self, rng: np.random.Generator, tokens: int) -> list[TrainingExample]:
        """Examples drawn uniformly without replacement until the next would pass `tokens` input
        tokens (always one at least, none if the buffer is empty).

        Example: examples of 100, 300 and 50 tokens drawn in that order with tokens=420 give the
        first two (400); the third would make 450.
        """
        batch, used = [], 0
        for index in rng.permutation(len(self._examples)):
            example = self._examples[index]
            if batch and used + example.num_tokens > tokens:
                break
            batch.append(example)
            used += example.num_tokens
        return batch

    def recent_outputs(self, max_tokens: int) -> list[tuple[list[int], list[int]]]:
        """(prompt, output) token ids of the latest examples, newest first, while their outputs add
        up to at most `max_tokens` tokens (the newest one always): what a promoted version's n-gram
        index is built from (adaptive_spec/drafters/ngram_index.py)."""
        outputs, used = [], 0
        for example in reversed(self._examples):
            prompt, output = split_output(example)
            if outputs and used + len(output) > max_tokens:
                break
            outputs.append((prompt, output))
            used += len(output)
        return outputs


def split_output(example: TrainingExample) -> tuple[list[int], list[int]]:
    """(prompt, output) of a training example. Its input is prompt + output[:-1] and the logits at
    its first position predict the output's first token; the target's top-1 at the last position
    stands for the output's last token (the same token when the request was greedy).

    Example: input [p0 p1 p2 o0], positions [2, 3], top-1 ids [o0, o1] -> ([p0 p1 p2], [o0 o1]).
    """
    ids = example.input_ids.tolist()
    first = int(example.positions[0]) + 1
    return ids[:first], [*ids[first:], int(example.target_topk_ids[-1, 0])]


class HoldoutSplit:
    """Decides which records are held out, and keeps the most recent `max_records` of them.

    A record is held out when blake2b(salt + request_id), read as a number in [0, 1), is below
    `fraction`: deterministic across deliveries, processes and restarts. The store evicts in
    arrival order (the stream's order, which is time order). `revision` changes whenever the store
    does, so a caller can reuse the champion's figures until then.

    Until the store holds `warmup_records`, a record is also held out when its number is below
    `warmup_fraction`, so the gate's first decision comes sooner: at one user, 1 record in 10 took
    51 records (7 minutes of bench-drift --scenario traffic) to hold out 3. The rule still gives
    every delivery of a record the same place: the store only grows until it is warm (it keeps
    `max_records` >= `warmup_records`), a record held out while it was cold is remembered as held
    out, and a record trained on after it was warm never meets a cold store again, also when a
    checkpoint is restored (held-out records first).
    """

    def __init__(
        self,
        fraction: float = 0.1,
        max_records: int = 256,
        salt: str = "",
        remember_ids: int = 100_000,
        warmup_records: int = 0,
        warmup_fraction: float = 1 / 3,
    ) -> None:
        if not 0 <= fraction <= 1 or not 0 <= warmup_fraction <= 1:
            raise ValueError(f"fractions must be in [0, 1], got {fraction} and {warmup_fraction}")
        if max_records < 1 or not 0 <= warmup_records <= max_records:
            raise ValueError(
                f"need 1 <= max_records and 0 <= warmup_records <= max_records, got {max_records}, {warmup_records}"
            )
        self.fraction = fraction
        self.warmup_records, self.warmup_fraction = warmup_records, warmup_fraction
        self.max_records = max_records
        self.salt = salt
        self._records: OrderedDict[str, CorrectionRecord] = OrderedDict()
        self._seen = _RecentIds(max(remember_ids, 1))
        self.revision = 0
        self.duplicates = 0

    def __len__(self) -> int:
        return len(self._records)

    @property
    def records(self) -> list[CorrectionRecord]:
        """The held-out records, oldest first."""
        return list(self._records.values())

    @property
    def positions(self) -> int:
        return sum(len(record.output_ids) for record in self._records.values())

    def is_held_out(self, request_id: str) -> bool:
        """Held out by the hash alone (the rule once the store is warm)."""
        return self._number(request_id) < self.fraction

    def _number(self, request_id: str) -> float:
        digest = hashlib.blake2b((self.salt + request_id).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2**64

    def add(self, record: CorrectionRecord) -> bool:
        """True if the record is held out (kept here, or a duplicate of one): never train on it.
        False if it is for training."""
        if record.request_id in self._seen:
            self.duplicates += 1
            return True
        number = self._number(record.request_id)
        cold = len(self._records) < self.warmup_records
        if not (number < self.fraction or (cold and number < self.warmup_fraction)):
            return False
        self.hold(record)
        return True

    def drop(self, request_ids: set[str]) -> int:
        """Take these records out; their ids stay remembered. Returns how many went."""
        dropped = [self._records.pop(request_id) for request_id in request_ids if request_id in self._records]
        self.revision += bool(dropped)
        return len(dropped)

    def hold(self, record: CorrectionRecord) -> None:
        """Keep a record that another split held out (its domain's, trainer/loop/domains.py), whatever
        this split's own rule says, so that no adapter trains on it."""
        if record.request_id in self._seen:
            return
        self._seen.add(record.request_id)
        self._records[record.request_id] = record
        while len(self._records) > self.max_records:
            self._records.popitem(last=False)
        self.revision += 1
