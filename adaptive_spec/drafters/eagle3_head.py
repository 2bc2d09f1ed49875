"""A draft head in the standard EAGLE-3 layout (Li et al. 2025), as vLLM's `Eagle3LlamaForCausalLM` computes it,
so that a head trained here serves in vLLM or SGLang and a head trained by speculators or SpecForge serves here.
The checkpoint it reads and writes is formats/eagle3.py's; docs/eagle3.md gives the layout and its sources.

To draft token t + 1 the head reads the target's auxiliary states at position t (the states entering the
decoder layers `aux_layer_ids`, side by side: [n, width, k * H]) and the embedding of token t + 1:

    h     = fc(aux)                                            [n, width, h]   (a state fed back skips fc)
    x     = [input_layernorm(embedding) | hidden_norm(h)]       [n, width, 2h]  q/k/v read 2h
    r     = h + o_proj(attention(x))                            the residual is the state itself
    out   = r + mlp(post_attention_layernorm(r))                [n, width, h]   fed back to draft further
    logits = lm_head(norm(out))                                 [n, width, draft_vocab]; d2t maps them to the target's

Its differences from the project's own head (draft_head.py): the embedding and the state are normed apart and
meet inside q/k/v (there a linear `fuse` adds them before one norm), the residual carries the state alone, and
the head has a final norm and an LM head of its own over a draft vocabulary of fixed size.

    head = Eagle3Head(target, draft_ids=torch.arange(1024))    # untrained, from the target's last layer
    out = head(ids, aux, position_ids, mask, cache)            # [n, width, h], pre-norm: what is fed back
    head.target_logits(out)                                    # [n, width, vocab]: -inf off the draft vocabulary
    head.checkpoint("smollm2-135m-instruct").write(directory)  # what `vllm serve --speculative-config` loads
    Eagle3Head.from_checkpoint(target, Eagle3Checkpoint.read(directory))

An untrained head starts from the target: its layer a copy of the target's last, q/k/v reading the state half
only (the embedding half zero), `fc` picking the last aux state, its norm and LM head copies of the target's
(the draft vocabulary's rows). With the last aux id the target's layer count (what enters its final norm), it
drafts as the project's untrained head does. Llama-family layers only (q/k/v/o, gate/up/down, two RMSNorms).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from adaptive_spec.drafters.early_exit import decoder_layers
from adaptive_spec.formats.eagle3 import LAYER, Eagle3Checkpoint, Eagle3Config, Eagle3FormatError, default_aux_layer_ids

_LLAMA_LINEARS = tuple(f"self_attn.{n}_proj" for n in "qkvo") + tuple(f"mlp.{n}_proj" for n in ("gate", "up", "down"))


def aux_layer_ids_for(target) -> tuple[int, ...]:
    """The project's choice of aux layers in vLLM's numbering (the state entering layer i): the inputs of layers
    2 and L // 2 and what enters the final norm (id L), EAGLE-3's low, middle and high features; the outputs of
    layers 1, L // 2 - 1 and L - 1, which `feeding.state_layers` reads for the project's own head."""
    n = len(decoder_layers(target, "eagle3"))
    return tuple(sorted({min(2, n), max(n // 2, 1), n}))


class Eagle3Head(nn.Module):
    """The head's own weights are `fc`, `layer` (with `hidden_norm`), `norm` and `lm_head`; the embedding and the
    rotary embedding are the target's, held outside the module tree (state dicts and optimisers see the head's)."""

    def __init__(
        self,
        target,
        aux_layer_ids: tuple[int, ...] | None = None,
        draft_ids: torch.Tensor | None = None,
        norm_before_residual: bool = False,
    ):
        super().__init__()
        config = target.config
        hidden = config.hidden_size
        last = decoder_layers(target, "eagle3")[-1]
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "input_layernorm"):
            try:
                last.get_submodule(part)
            except AttributeError:
                raise Eagle3FormatError(
                    f"an EAGLE-3 head needs a Llama-family layer; {type(last).__name__} has no {part}"
                ) from None
        plain = {f"{part}.weight" for part in (*_LLAMA_LINEARS, "input_layernorm", "post_attention_layernorm")}
        if set(last.state_dict()) != plain:
            extra = sorted(set(last.state_dict()) ^ plain)
            raise Eagle3FormatError(
                f"an EAGLE-3 head here takes a plain Llama layer; {type(last).__name__} differs: {extra}"
            )
        reference = next(last.parameters())
        self.aux_layer_ids = tuple(aux_layer_ids_for(target) if aux_layer_ids is None else aux_layer_ids)
        if len(self.aux_layer_ids) < 2 or list(self.aux_layer_ids) != sorted(set(self.aux_layer_ids)):
            raise Eagle3FormatError(
                f"aux layer ids {self.aux_layer_ids}: at least two, rising (vLLM concatenates them in layer order, and "
                f"a single state would be as wide as a fed-back one)"
            )
        self.norm_before_residual = norm_before_residual
        self.layer = copy.deepcopy(last)
        attention: Any = self.layer.self_attn
        attention.layer_idx = 0  # the head's cache has one layer
        for name in ("q_proj", "k_proj", "v_proj"):  # [out, h] -> [out, 2h]: the embedding half starts at zero
            old: nn.Linear = getattr(attention, name)
            wide = nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None).to(reference)
            with torch.no_grad():
                wide.weight.zero_()
                wide.weight[:, hidden:].copy_(old.weight)
                if old.bias is not None:
                    wide.bias.copy_(old.bias)
            setattr(attention, name, wide)
        self.layer.hidden_norm = copy.deepcopy(self.layer.input_layernorm)
        k = len(self.aux_layer_ids)
        self.fc = nn.Linear(k * hidden, hidden, bias=False).to(reference)
        with torch.no_grad():  # the last aux state alone
            self.fc.weight.zero_()
            self.fc.weight[:, (k - 1) * hidden :].copy_(torch.eye(hidden))
        self.norm = copy.deepcopy(target.model.norm)
        lm_head = target.get_output_embeddings()
        ids = torch.arange(config.vocab_size) if draft_ids is None else draft_ids.long().flatten()
        self.lm_head = nn.Linear(hidden, len(ids), bias=False).to(reference)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head.weight[ids.to(lm_head.weight.device)])
        self.draft_ids: torch.Tensor  # [draft_vocab] target ids, a buffer: it moves with the head
        self.register_buffer("draft_ids", ids.to(reference.device), persistent=False)
        self.vocab_size = config.vocab_size
        self.shared = SimpleNamespace(embed=target.model.embed_tokens, rotary=target.model.rotary_emb)
        self.target_config = self.config = config  # the target's: the attention implementation is set there
        self.layer_type = None  # a Llama layer: full attention

    def forward(
        self,
        input_ids: torch.Tensor,
        states: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
    ) -> torch.Tensor:
        """input_ids [n, width]; states [n, width, k * H] (the target's aux states at each previous position) or
        [n, width, h] (the head's own output, fed back) -> [n, width, h], the pre-norm state. Without a cache or
        mask (training) the attention is causal over the width (the attention function's own, as DraftHead's)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        hidden = self.reduced(states)
        layer: Any = self.layer
        normed = layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(self.shared.embed(input_ids)), normed], dim=-1)  # [n, width, 2h]
        rotary = self.shared.rotary(hidden, position_ids=position_ids)
        attended = layer.self_attn(
            hidden_states=x,
            position_embeddings=rotary,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )[0]
        residual = (normed if self.norm_before_residual else hidden) + attended
        return residual + layer.mlp(layer.post_attention_layernorm(residual))

    @property
    def state_width(self) -> int:
        """The width of the target's state it reads: the aux states side by side (`fc`'s input)."""
        return self.fc.in_features

    def reduced(self, states: torch.Tensor) -> torch.Tensor:
        """[..., k * H] aux states -> [..., h] through `fc`; the head's own states ([..., h]) as they are. The
        drafter applies it once a step, outside the compiled draft step (drafters/head.py `_feed`)."""
        return self.fc(states) if states.shape[-1] != self.fc.out_features else states

    def final_norm(self, states: torch.Tensor) -> torch.Tensor:
        """[..., h] pre-norm states -> what the LM head reads: the head's own final norm."""
        return self.norm(states)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """[..., h] pre-norm states -> [..., draft_vocab], through the head's own norm and LM head."""
        return self.lm_head(self.norm(states))

    def target_logits(self, states: torch.Tensor) -> torch.Tensor:
        """[..., h] -> [..., vocab]: the draft logits at their target ids, -inf elsewhere (vLLM's compute_logits)."""
        draft = self.logits(states)
        full = draft.new_full((*draft.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.draft_ids] = draft
        return full

    # ---------------------------------------------------------------- the standard checkpoint

    def checkpoint(self, verifier: str, speculative_tokens: int = 3) -> Eagle3Checkpoint:
        """This head as an EAGLE-3 checkpoint (speculators format) for the target named `verifier`."""
        config = self.target_config
        attention: Any = self.layer.self_attn
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        layer = {LAYER + name: t.detach().cpu() for name, t in self.layer.state_dict().items()}
        tensors = {
            **layer,
            "fc.weight": self.fc.weight.detach().cpu(),
            "norm.weight": self.norm.weight.detach().cpu(),
            "lm_head.weight": self.lm_head.weight.detach().cpu(),
        }
        eagle3 = Eagle3Config(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=attention.k_proj.out_features // head_dim,
            head_dim=head_dim,
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            max_position_embeddings=int(config.max_position_embeddings),
            vocab_size=self.vocab_size,
            draft_vocab_size=len(self.draft_ids),
            target_hidden_size=config.hidden_size,
            aux_layer_ids=self.aux_layer_ids,
            verifier=verifier,
            verifier_architectures=tuple(getattr(config, "architectures", None) or ("LlamaForCausalLM",)),
            speculative_tokens=speculative_tokens,
            norm_before_residual=self.norm_before_residual,
            rope_parameters={k: v for k, v in rope.items() if k != "rope_theta"},
        )
        return Eagle3Checkpoint(eagle3, tensors).with_vocabulary(self.draft_ids.cpu())

    @classmethod
    def from_checkpoint(
        cls, target, checkpoint: Eagle3Checkpoint, aux_layer_ids: tuple[int, ...] | None = None
    ) -> Eagle3Head:
        """A head with a checkpoint's weights, for `target`; Eagle3FormatError when it does not fit (width, vocabulary,
        heads, aux layers), naming what differs. The aux layers are `aux_layer_ids`, else the checkpoint's own, else
        (an original-layout checkpoint names none) vLLM's default for a three-state fc."""
        config, target_config = checkpoint.config, target.config
        head_dim = (
            getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
        )
        rope = getattr(target_config, "rope_parameters", None) or {}
        fits = {
            "hidden_size": (config.hidden_size, target_config.hidden_size),
            "target_hidden_size": (config.target_hidden_size, target_config.hidden_size),
            "vocab_size": (config.vocab_size, target_config.vocab_size),
            "num_attention_heads": (config.num_attention_heads, target_config.num_attention_heads),
            "num_key_value_heads": (config.num_key_value_heads, target_config.num_key_value_heads),
            "head_dim": (config.head_dim, head_dim),
            "intermediate_size": (config.intermediate_size, target_config.intermediate_size),
            "rope_theta": (
                config.rope_theta,
                float(rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))),
            ),
        }
        wrong = {name: pair for name, pair in fits.items() if pair[0] != pair[1]}
        if wrong:
            said = ", ".join(f"{name} {ours} (the target's {theirs})" for name, (ours, theirs) in wrong.items())
            raise Eagle3FormatError(f"the checkpoint does not fit this target: {said}")
        layers = len(decoder_layers(target, "eagle3"))
        states = checkpoint.tensors["fc.weight"].shape[1] // config.target_hidden_size
        ids = aux_layer_ids or config.aux_layer_ids or (default_aux_layer_ids(layers) if states == 3 else ())
        if len(ids) != states:
            raise Eagle3FormatError(
                f"fc reads {states} aux states, and the aux layers are {ids or 'not named'}: name the aux layers "
                f"(vLLM's numbering: the state entering layer i) that the head was trained on"
            )
        if max(ids) > layers:
            raise Eagle3FormatError(f"aux layer ids {ids}: the target has {layers} decoder layers (ids 0..{layers})")
        embed = checkpoint.tensors.get("embed_tokens.weight")
        if embed is not None and not torch.equal(
            embed.to(target.model.embed_tokens.weight), target.model.embed_tokens.weight
        ):
            raise Eagle3FormatError(
                "the checkpoint's embed_tokens differs from the target's; heads here share the target's"
            )
        head = cls(target, ids, checkpoint.draft_to_target(), config.norm_before_residual)
        own = {name.removeprefix(LAYER): t for name, t in checkpoint.tensors.items() if name.startswith(LAYER)}
        reference = next(head.parameters())
        with torch.no_grad():
            missing, unexpected = head.layer.load_state_dict({k: v.to(reference) for k, v in own.items()}, strict=False)
            if missing or unexpected:
                raise Eagle3FormatError(f"the checkpoint's layer: missing {missing}, unexpected {unexpected}")
            for name in ("fc", "norm", "lm_head"):
                getattr(head, name).weight.copy_(checkpoint.tensors[f"{name}.weight"].to(reference))
        return head
