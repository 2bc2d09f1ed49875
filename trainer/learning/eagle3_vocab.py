"""The draft vocabulary of an EAGLE-3 head version: a fixed number of the target's tokens, those recent traffic used,
chosen anew as the head trains, so that each version's checkpoint maps its own (d2t) at the one size a deployment
has: an engine that sizes the head when it loads one (vLLM does) takes every later version without a restart.

    traffic = TrafficTokens(vocab_size=49152)
    traffic.add(example)                          # each example trained on; a record counts once (its request id)
    ids = traffic.draft_ids(4096, previous)       # [4096] int64, sorted: draft id i is target id ids[i]

Which tokens, in this order until there are `size`:

1. the target's choices (its top-1) in the recent records, the most frequent first: what the head must draft;
2. the rest of their logged top-m, the most frequent first: what the target nearly chose, which the KL trains
   towards and which the target draws under sampling;
3. the previous vocabulary's tokens (the head's now): what the lineage used before, so a trainer restarted with an
   empty window keeps its champion's tokens, and a narrow domain's head keeps what it learned a while;
4. the lowest ids not in yet: a BPE vocabulary numbers its bytes and its earliest, most frequent merges first.

Ties go to the lower id; the result is sorted. Example: size 4, top-1 counts {7: 5, 3: 2}, the rest of the top-m
{9: 4, 3: 1}, previous [1, 3, 7, 8]: 7 and 3, then 9, then 1 -> [1, 3, 7, 9].

Recent: the records of the last `window` output positions trained on, 200,000 by default (OnlineSettings'
replay buffer holds as many input tokens). A narrow domain's traffic uses about a thousand of the default model's
49,152 tokens as top-1 (trainer/intake/intake.py `target_tokens`), so the default 4,096 (TrainerSettings
`draft_vocab_size`) leaves room for their top-m and for several domains at once: the trainer holds one head for
every lineage, and the window is all of them.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from trainer.intake.examples import TrainingExample

WINDOW_POSITIONS = 200_000


class TrafficTokens:
    """Counts of the target's tokens over the most recent records trained on."""

    def __init__(self, vocab_size: int, window: int = WINDOW_POSITIONS) -> None:
        self.vocab_size = vocab_size
        self.window = window
        self.top1 = np.zeros(vocab_size, dtype=np.int64)  # [vocab]: times chosen, over the window's records
        self.others = np.zeros(vocab_size, dtype=np.int64)  # [vocab]: times in the rest of the top-m
        self.positions = 0
        self._records: OrderedDict[str, tuple[np.ndarray, np.ndarray]] = OrderedDict()  # request id -> (top1, others)

    def __len__(self) -> int:
        return len(self._records)

    def add(self, example: TrainingExample) -> None:
        """Count the example's logged top-m once per request id; the oldest records leave past the window."""
        if example.request_id in self._records or not example.num_positions:
            return
        logprobs = example.target_topk_logprobs.float()  # [positions, m], -inf where not logged
        ids = example.target_topk_ids  # [positions, m]
        best = logprobs.argmax(-1, keepdim=True)
        top1 = ids.gather(-1, best)[:, 0].numpy()
        rest = torch.isfinite(logprobs)
        rest.scatter_(-1, best, False)
        others = ids[rest].numpy()
        self._records[example.request_id] = (top1, others)
        np.add.at(self.top1, top1, 1)
        np.add.at(self.others, others, 1)
        self.positions += len(top1)
        while self.positions > self.window and len(self._records) > 1:
            _, (old_top1, old_others) = self._records.popitem(last=False)
            np.subtract.at(self.top1, old_top1, 1)
            np.subtract.at(self.others, old_others, 1)
            self.positions -= len(old_top1)

    def draft_ids(self, size: int, previous: torch.Tensor | None = None) -> torch.Tensor:
        """[min(size, vocab)] int64, sorted: the tokens of the module docstring's order."""
        size = min(size, self.vocab_size)
        tier = np.full(self.vocab_size, 3)  # 3: the lowest ids last
        if previous is not None:
            tier[previous.cpu().numpy()] = 2
        tier[self.others > 0] = 1
        tier[self.top1 > 0] = 0
        count = np.where(tier == 0, self.top1, np.where(tier == 1, self.others, 0))
        order = np.lexsort((np.arange(self.vocab_size), -count, tier))  # the last key sorts first
        return torch.from_numpy(np.sort(order[:size]))
