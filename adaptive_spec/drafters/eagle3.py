"""Proposing with a head in the standard EAGLE-3 layout (`Eagle3Head`, eagle3_head.py): the draft `eagle3`.

    engine = Engine(target, draft="eagle3")              # an untrained head from the target's last layer
    engine.load_adapter("adapters/v0007")                 # a version: a speculators checkpoint (formats/eagle3.py)

It drafts as `HeadDrafter` does, chains and trees, every row of a head version in one forward per draft token,
compiled where the engine compiles: the loop is the same, only the head differs. Its state is the target's aux
states side by side ([k * hidden]: the outputs of layers `aux_layer_ids - 1`, vLLM's numbering), which `fc` turns
into one before the step, and its logits come from its own final norm and LM head over a draft vocabulary
(`Eagle3Head.draft_ids`, the checkpoint's d2t), which `DraftVocab(lm_head, row_ids=draft_ids)` maps back to the
target's tokens. A version is the checkpoint itself, whole weights (about 7.6 M on the default model with 4,096
draft tokens: the layer 4.1 M, fc 1 M, the LM head's rows 2.4 M), built into a head of its own
(`build_weights`); the base head's LM head covers the whole vocabulary.

The engine hands the drafter the target's states of `feeding.state_layers` (kernels/compiled.py taps the same in
the compiled step), so a head must read those layers: (2, L // 2, L) in vLLM's numbering, `aux_layer_ids_for`.
A version trained on others is refused with the ids named (docs/eagle3.md, "Aux layers").
"""

from __future__ import annotations

import torch

from adaptive_spec.cache import feeding
from adaptive_spec.drafters.eagle3_head import Eagle3Head
from adaptive_spec.drafters.head import HeadDrafter
from adaptive_spec.drafters.vocab import DraftVocab
from adaptive_spec.formats.eagle3 import Eagle3Checkpoint, Eagle3FormatError
from adaptive_spec.kernels import exact


class Eagle3Drafter(HeadDrafter):
    """A `HeadDrafter` whose head, base and versions, is an `Eagle3Head`."""

    def __init__(self, target, name: str = "eagle3"):
        self.target = target  # a version's head is built on it (Eagle3Head.from_checkpoint)
        super().__init__(target, name)

    def base_head(self, target) -> Eagle3Head:
        head = Eagle3Head(target)
        taps = tuple(layer + 1 for layer in feeding.state_layers(target))
        if head.aux_layer_ids != taps:
            raise Eagle3FormatError(
                f"the engine captures the target's states entering layers {taps} (vLLM's numbering), and an EAGLE-3 "
                f"head here reads {head.aux_layer_ids}"
            )
        return head

    def new_vocab(self, weights: Eagle3Head | None = None) -> DraftVocab:
        """The head's own LM head, whose rows are its draft vocabulary's tokens (all of them for the base head)."""
        head = self.head if weights is None else weights
        assert isinstance(head, Eagle3Head)
        whole = len(head.draft_ids) == head.vocab_size
        return DraftVocab(head.lm_head, None if whole else head.draft_ids, head.vocab_size)

    def build_weights(self, config: dict, tensors: dict[str, torch.Tensor]) -> Eagle3Head:
        """A version (config.json's object and model.safetensors' tensors) as a head to decode with; AdapterError,
        naming what differs, when it is not an EAGLE-3 checkpoint that fits this target and these aux layers."""
        from adaptive_spec.formats.adapters import AdapterError

        if "peft_type" in config:
            raise AdapterError(
                "a LoRA version (the project's own head or an early exit) on an eagle3 draft: it drafts with "
                "EAGLE-3 checkpoints only"
            )
        assert isinstance(self.head, Eagle3Head)
        try:
            checkpoint = Eagle3Checkpoint.from_parts(config, tensors, "the version")
            head = Eagle3Head.from_checkpoint(self.target, checkpoint)
        except Eagle3FormatError as exc:
            raise AdapterError(str(exc)) from None
        if head.aux_layer_ids != self.head.aux_layer_ids:
            raise AdapterError(
                f"the version reads aux layers {head.aux_layer_ids}, and this engine captures "
                f"{self.head.aux_layer_ids} (vLLM's numbering)"
            )
        exact.draft_products(head)
        return head.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
