"""The head draft's network (EAGLE-style): one decoder layer that reads the target's own hidden state.

To draft token t + 1, the head takes the target's hidden state at position t - 1 (what entered
the target's final norm there, `f[t-1]`) and the embedding of token t, fuses them with a linear
map `[2 * hidden -> hidden]`, and runs one decoder layer of the target's architecture over the
result, with its own KV cache. Its output is its prediction of the target's hidden state at t,
`f'[t]`; the target's final norm and LM head (shared, not copied) turn it into the next-token
distribution. To draft further it feeds its own prediction back: (f'[t], d1) gives f'[t+1] and
d2, and so on (Li et al., EAGLE, 2024).

The target's state it reads is wider than `f`: the outputs of the target's state layers side by side
(`feeding.state_layers`: a low, a middle and the last, EAGLE-3's fused features, Li et al. 2025; (1, 14, 29) on
the default model), which a linear `reduce` [layers * hidden -> hidden] turns into one state before the fuse.
`reduce` starts as the last layer's block alone, so an untrained head, and a version trained before the
reduction existed (it saved none), read `f` exactly as before; training learns what the lower layers add.
The head's own predictions are `hidden` wide and skip it. On 160 python records (benchmarks/head_ablation.py,
400 steps, the default recipe otherwise) the fused head matched the first token 0.65 against 0.56 after 100
steps, 0.79 against 0.75 after 200, and 0.81 against 0.80 at 400, where 2.35 against 2.32 draft tokens of k = 4
were accepted a round (docs/figures/head-ablation-fused-python.json): it learns faster, which is what an
online head's first half hour is.

    head = DraftHead(target)                              # fuse + reduce + a copy of the target's last layer
    states = head(ids, features, position_ids, mask, cache)   # [n, width, hidden]: predicted f
    logits = head.logits(states)                          # [n, width, vocab], through the target's norm and LM head

Weights: one decoder layer (3.5 M on the default model) plus the fuse (0.66 M) and the reduction (1 M), against
30 layers and a 49152-row head for the target. The layer starts as a copy of the target's last layer and the
fuse as `f + e` (identity on both halves); a trained head version (trainer/) replaces them and the reduction
(`DraftHead.with_weights`). The target never changes. `HeadDrafter` (head.py) proposes with it.
"""

from __future__ import annotations

import copy
import inspect
import itertools
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from adaptive_spec.cache import feeding
from adaptive_spec.drafters.early_exit import decoder_layers


class DraftHead(nn.Module):
    """The head's own weights are `fuse` and `layer`; the embedding, final norm, LM head and rotary
    embedding are the target's, held outside the module tree so that state dicts, adapters and
    optimisers see only the head's own weights."""

    def __init__(self, target, feature_layers: Sequence[int] | None = None):
        super().__init__()
        self.config = target.config
        hidden = target.config.hidden_size
        layers = decoder_layers(target, "head")
        reference = next(layers[-1].parameters())
        self.feature_layers = tuple(feeding.state_layers(target) if feature_layers is None else feature_layers)
        if self.feature_layers[-1] != len(layers) - 1 or not all(
            0 <= a < b for a, b in itertools.pairwise(self.feature_layers)
        ):
            raise ValueError(
                f"feature layers must rise and end at the last layer ({len(layers) - 1}), got {self.feature_layers}"
            )
        self.fuse = nn.Linear(2 * hidden, hidden, bias=False, device=reference.device, dtype=reference.dtype)
        with torch.no_grad():
            eye = torch.eye(hidden, device=reference.device, dtype=reference.dtype)
            self.fuse.weight.copy_(torch.cat([eye, eye], dim=1))  # f + e
        self.reduce: nn.Linear | None = None
        if len(self.feature_layers) > 1:  # EAGLE-3's fused features: [low | ... | last] -> hidden, at first the last
            wide = len(self.feature_layers) * hidden
            self.reduce = nn.Linear(wide, hidden, bias=False, device=reference.device, dtype=reference.dtype)
            with torch.no_grad():
                self.reduce.weight.zero_()
                self.reduce.weight[:, wide - hidden :].copy_(eye)
        self.layer = copy.deepcopy(layers[-1])
        attention: Any = self.layer.self_attn
        attention.layer_idx = 0  # the head's cache has one layer
        self.shared = SimpleNamespace(
            embed=target.model.embed_tokens,
            norm=target.model.norm,
            lm_head=target.get_output_embeddings(),
            rotary=target.model.rotary_emb,
        )
        # Models with several layer types (Gemma 3: sliding and full attention) keep a rotary embedding
        # per type; the head is its last layer's type.
        layer_types = getattr(target.config, "layer_types", None)
        self.layer_type = layer_types[len(layers) - 1] if layer_types else None
        takes_type = "layer_type" in inspect.signature(target.model.rotary_emb.forward).parameters
        self._rotary_kwargs = {"layer_type": self.layer_type} if takes_type else {}

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
    ) -> torch.Tensor:
        """input_ids [n, width]; features [n, width, hidden], the target's state at each previous
        position -> the predicted target state at each position, [n, width, hidden]. Without a
        cache or mask (training) the attention is causal over the width."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        fused = self.fuse(torch.cat([self.reduced(features), self.shared.embed(input_ids)], dim=-1))
        rotary = self.shared.rotary(fused, position_ids=position_ids, **self._rotary_kwargs)
        return self.layer(
            fused,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            position_embeddings=rotary,
        )

    @property
    def state_width(self) -> int:
        """The width of the target's state it reads: its state layers' outputs side by side."""
        return self.config.hidden_size * len(self.feature_layers)

    def final_norm(self, states: torch.Tensor) -> torch.Tensor:
        """[..., hidden] predicted states -> what the LM head reads: the target's own final norm."""
        return self.shared.norm(states)

    def reduced(self, features: torch.Tensor) -> torch.Tensor:
        """[..., layers * hidden] target states -> [..., hidden] through `reduce`; the head's own predicted states
        ([..., hidden]) as they are."""
        if self.reduce is None or features.shape[-1] == self.config.hidden_size:
            return features
        return self.reduce(features)

    def with_weights(
        self, fuse: torch.Tensor | None, lora_pairs: dict, reduce: torch.Tensor | None = None
    ) -> DraftHead:
        """A new head sharing the target's modules, with this one's weights plus a LoRA merged into
        its layer and, when given, a new fuse weight [hidden, 2 * hidden] and reduction [hidden, layers * hidden]
        (a version trained without one reads the last layer alone, as this head's reduction starts)."""
        head = DraftHead.__new__(DraftHead)
        nn.Module.__init__(head)
        head.config, head.shared, head.layer_type, head._rotary_kwargs, head.feature_layers = (
            self.config,
            self.shared,
            self.layer_type,
            self._rotary_kwargs,
            self.feature_layers,
        )
        head.fuse = copy.deepcopy(self.fuse)
        head.reduce = copy.deepcopy(self.reduce)
        head.layer = copy.deepcopy(self.layer)
        modules = dict(head.layer.named_modules())
        with torch.no_grad():
            if fuse is not None:
                head.fuse.weight.copy_(fuse.to(head.fuse.weight))
            if reduce is not None and head.reduce is not None:  # build_weights checked that it fits
                head.reduce.weight.copy_(reduce.to(head.reduce.weight))
            for name, (lora_a, lora_b, scaling) in lora_pairs.items():
                linear = modules[name.removeprefix("layer.")]
                linear.weight += ((lora_b.float() @ lora_a.float()) * scaling).to(linear.weight)
        return head.eval().requires_grad_(False)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """[..., hidden] predicted states -> [..., vocab], through the target's final norm and head."""
        return self.shared.lm_head(self.shared.norm(states))
