"""EAGLE-3 draft heads in the layout the serving engines load: the `speculators` checkpoint (what `vllm serve`
takes as `--speculative-config '{"method": "eagle3", "model": DIR}'`), and the original EAGLE-3 / SpecForge
layout read too. docs/eagle3.md gives the layout, its sources, and the conventions that differ between tools.

    checkpoint = Eagle3Checkpoint(config, tensors)       # tensors by the standard names, below
    checkpoint.write(directory)                         # config.json + model.safetensors (speculators format)
    checkpoint = Eagle3Checkpoint.read(directory)       # either layout; names normalized to `layers.0.*`
    checkpoint.config.draft_to_target()                 # [draft_vocab] target ids, from d2t (an offset)

A directory holds `config.json` (no top-level `model_type`, a `speculators_config`: that is how vLLM knows the
format) and `model.safetensors` with these tensors, h the head's width, H the target's, k the aux layers:

    fc.weight                                [h, k * H]     the target's aux states, side by side, to one state
    layers.0.input_layernorm.weight          [h]            on the token's embedding
    layers.0.hidden_norm.weight              [h]            on the state
    layers.0.self_attn.{q,k,v}_proj.weight   [*, 2h]        over [input_layernorm(embedding) | hidden_norm(state)]
    layers.0.self_attn.o_proj.weight, layers.0.post_attention_layernorm.weight, layers.0.mlp.{gate,up,down}_proj.weight
    norm.weight                              [h]            the head's own final norm
    lm_head.weight                           [draft_vocab, h]
    d2t                                      [draft_vocab]  int64: target id = draft id + d2t[draft id]
    t2d                                      [vocab]        bool: which target ids the draft vocabulary holds
                                                            (neither when the draft vocabulary is the target's)

The original layout names the layer `midlayer.*` and its config `LlamaForCausalLMEagle3` with the layer's fields
at the top; `read` takes both and gives `layers.0.*`. An `embed_tokens.weight` is kept when present (vLLM then
uses the head's own embedding unless it equals the target's); the head shares the target's otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from adaptive_spec.contracts import EAGLE3_CONFIG_FILE as CONFIG_FILE
from adaptive_spec.contracts import EAGLE3_WEIGHTS_FILE as WEIGHTS_FILE

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format this writes
LAYER = "layers.0."
_ORIGINAL_LAYER = "midlayer."
_LAYER_TENSORS = (
    "input_layernorm.weight",
    "hidden_norm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight", *(LAYER + name for name in _LAYER_TENSORS))


class Eagle3FormatError(ValueError):
    """A directory that is not an EAGLE-3 checkpoint this code can read, or one that does not fit a target."""


@dataclass(frozen=True)
class Eagle3Config:
    """What config.json says of a head. `aux_layer_ids` follow vLLM: id i is the state *entering* decoder layer i
    of the target (the output of layer i - 1; id L, past the last of L layers, is what enters the final norm).
    SGLang and SpecForge number the same layers one lower (they add 1 before capturing)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    verifier: str  # the target's name (`speculators_config.verifier.name_or_path`)
    verifier_architectures: tuple[str, ...] = ("LlamaForCausalLM",)
    speculative_tokens: int = 3
    norm_before_residual: bool = False  # False: the layer's residual is the state itself (EAGLE-3, SpecForge)
    hidden_act: str = "silu"
    rope_parameters: dict = field(default_factory=dict)  # the target's (a scaled RoPE's type and factors), if any

    def layer_config(self) -> dict:
        """`transformer_layer_config`: a one-layer Llama config (vLLM builds the head's class from it)."""
        return {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,  # transformers before 5 reads this, 5 and later rope_parameters
            "rope_parameters": {"rope_type": "default", **self.rope_parameters, "rope_theta": self.rope_theta},
            # vLLM sizes fc from this (else from eagle_config's ids, else 3 states): written, so k != 3 loads too
            "num_aux_hidden_states": len(self.aux_layer_ids),
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
        }

    def to_json(self) -> dict:
        """The speculators config.json: no top-level `model_type`, so vLLM reads it as a speculators directory."""
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": self.layer_config(),
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "norm_before_residual": self.norm_before_residual,  # always written: vLLM's default differs by format
            "norm_before_fc": False,
            "fc_norm": False,
            "norm_output": False,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": self.speculative_tokens,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "verifier": {"name_or_path": self.verifier, "architectures": list(self.verifier_architectures)},
            },
        }

    @classmethod
    def from_json(cls, data: dict, where: str = CONFIG_FILE) -> Eagle3Config:
        """A speculators config.json, or an original EAGLE-3 one (`LlamaForCausalLMEagle3`, the layer's fields at
        its top). The original layout names no verifier or aux layers: they come back empty and unknown."""
        if data.get("speculators_model_type") not in (None, "eagle3"):
            raise Eagle3FormatError(f"{where}: speculators_model_type {data['speculators_model_type']!r} is not eagle3")
        speculators = "speculators_config" in data or "transformer_layer_config" in data
        layer = data.get("transformer_layer_config", {}) if speculators else data
        for name, part in (
            ("transformer_layer_config", layer),
            ("speculators_config", data.get("speculators_config", {})),
        ):
            if not isinstance(part, dict):
                raise Eagle3FormatError(f"{where}: {name} is not a JSON object")
        if not speculators and not any("Eagle3" in name for name in data.get("architectures", [])):
            raise Eagle3FormatError(f"{where}: neither a speculators config nor an EAGLE-3 one (architectures)")
        try:
            hidden = int(layer["hidden_size"])
            heads = int(layer["num_attention_heads"])
            rope = layer.get("rope_parameters") or {}
            verifier = data.get("speculators_config", {}).get("verifier", {})
            ids = data.get("eagle_aux_hidden_state_layer_ids") or layer.get("eagle_aux_hidden_state_layer_ids") or []
            methods = data.get("speculators_config", {}).get("proposal_methods") or [{}]
            config = cls(
                hidden_size=hidden,
                intermediate_size=int(layer["intermediate_size"]),
                num_attention_heads=heads,
                num_key_value_heads=int(layer.get("num_key_value_heads", heads)),
                head_dim=int(layer.get("head_dim") or hidden // heads),
                rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))),
                max_position_embeddings=int(layer.get("max_position_embeddings", 2048)),
                vocab_size=int(layer["vocab_size"]),
                draft_vocab_size=int(
                    data.get("draft_vocab_size") or layer.get("draft_vocab_size") or layer["vocab_size"]
                ),
                target_hidden_size=int(data.get("target_hidden_size") or layer.get("target_hidden_size") or hidden),
                aux_layer_ids=tuple(int(i) for i in ids),
                verifier=str(verifier.get("name_or_path") or ""),
                verifier_architectures=tuple(verifier.get("architectures") or ()),
                speculative_tokens=int(methods[0].get("speculative_tokens", 3)),
                # vLLM reads a speculators config without the field as True, an original one as False
                norm_before_residual=bool(
                    data.get("norm_before_residual", layer.get("norm_before_residual", speculators))
                ),
                hidden_act=str(layer.get("hidden_act", "silu")),
                rope_parameters={k: v for k, v in rope.items() if k != "rope_theta"} if isinstance(rope, dict) else {},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise Eagle3FormatError(f"{where}: {type(exc).__name__}: {exc}") from None
        # norm_output means "feed the normed state back" to vLLM and speculators, "norm before the LM head" (as
        # every EAGLE-3 head does) to SpecForge: refused only where it means the former.
        for flag in ("norm_before_fc", "fc_norm", *(("norm_output",) if speculators else ())):
            if data.get(flag) or layer.get(flag):
                raise Eagle3FormatError(f"{where}: {flag} is set; heads with it are not supported here")
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise Eagle3FormatError(
                f"{where}: {layer['num_hidden_layers']} draft layers; heads of one layer are read here"
            )
        if config.hidden_act != "silu":
            raise Eagle3FormatError(f"{where}: hidden_act {config.hidden_act!r}; the Llama layer here is silu")
        return config


@dataclass
class Eagle3Checkpoint:
    config: Eagle3Config
    tensors: dict[str, torch.Tensor]  # the standard names above (the layer as layers.0.*)

    def write(self, directory: Path | str) -> Path:
        """config.json and model.safetensors in `directory` (made if missing), after `check`."""
        from safetensors.torch import save_file

        self.check()
        if not self.config.verifier:
            raise Eagle3FormatError(
                "no verifier: vLLM needs the target's name (speculators_config.verifier.name_or_path)"
            )
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_FILE).write_text(json.dumps(self.config.to_json(), indent=2) + "\n")
        save_file({name: t.contiguous() for name, t in self.tensors.items()}, directory / WEIGHTS_FILE)
        return directory

    @classmethod
    def read(cls, directory: Path | str) -> Eagle3Checkpoint:
        """A checkpoint in either layout; `check`ed. Errors name the file and what is wrong."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        directory = Path(directory)
        config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
        for path in (config_path, weights_path):
            if not path.is_file():
                raise Eagle3FormatError(
                    f"{path}: missing (an EAGLE-3 checkpoint holds {CONFIG_FILE} and {WEIGHTS_FILE})"
                )
        try:
            data = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise Eagle3FormatError(f"{config_path}: not JSON ({exc})") from None
        if not isinstance(data, dict):
            raise Eagle3FormatError(f"{config_path}: not a JSON object")
        try:
            raw = load_file(weights_path)
        except (OSError, SafetensorError) as exc:
            raise Eagle3FormatError(f"{weights_path}: not a safetensors file ({exc})") from None
        return cls.from_parts(data, raw, str(directory))

    @classmethod
    def from_parts(cls, config: dict, tensors: dict[str, torch.Tensor], where: str = ".") -> Eagle3Checkpoint:
        """A checkpoint from config.json's object and model.safetensors' tensors, read already (an adapter version's
        files, formats/adapters.py); names normalized and `check`ed. Errors name `where`/config.json and the rest."""
        standard = {_standard_name(name): tensor for name, tensor in tensors.items()}
        checkpoint = cls(Eagle3Config.from_json(config, f"{where}/{CONFIG_FILE}"), standard)
        checkpoint.check(f"{where}/{WEIGHTS_FILE}")
        return checkpoint

    def check(self, where: str = WEIGHTS_FILE) -> None:
        """Every required tensor there, of the shape the config says, finite, and a vocabulary mapping that holds."""
        config, tensors = self.config, self.tensors
        missing = [name for name in REQUIRED if name not in tensors]
        if missing:
            raise Eagle3FormatError(f"{where}: missing {', '.join(missing)}")
        deeper = sorted(name for name in tensors if name.startswith("layers.") and not name.startswith(LAYER))
        if deeper:
            raise Eagle3FormatError(
                f"{where}: more than one draft layer ({deeper[0]}, ...); heads of one layer are read here"
            )
        h, k = (
            config.hidden_size,
            len(config.aux_layer_ids) or tensors["fc.weight"].shape[1] // config.target_hidden_size,
        )
        shapes = {
            "fc.weight": (h, k * config.target_hidden_size),
            "norm.weight": (h,),
            "lm_head.weight": (config.draft_vocab_size, h),
            LAYER + "self_attn.q_proj.weight": (config.num_attention_heads * config.head_dim, 2 * h),
            LAYER + "self_attn.k_proj.weight": (config.num_key_value_heads * config.head_dim, 2 * h),
            LAYER + "self_attn.v_proj.weight": (config.num_key_value_heads * config.head_dim, 2 * h),
            LAYER + "self_attn.o_proj.weight": (h, config.num_attention_heads * config.head_dim),
            LAYER + "mlp.down_proj.weight": (h, config.intermediate_size),
        }
        for name, shape in shapes.items():
            if tuple(tensors[name].shape) != shape:
                raise Eagle3FormatError(f"{where}: {name} is {tuple(tensors[name].shape)}, the config says {shape}")
        for name, tensor in tensors.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise Eagle3FormatError(f"{where}: {name} holds NaN or infinite values")
        if config.draft_vocab_size != config.vocab_size or "d2t" in tensors:
            ids = self.draft_to_target(where)
            if ids.min() < 0 or ids.max() >= config.vocab_size or len(set(ids.tolist())) != len(ids):
                raise Eagle3FormatError(f"{where}: d2t maps draft ids outside [0, {config.vocab_size}) or twice")
            t2d = tensors.get("t2d")
            if t2d is not None and (t2d.shape != (config.vocab_size,) or not bool(t2d[ids].all())):
                raise Eagle3FormatError(f"{where}: t2d does not mark the target ids d2t maps to")

    def draft_to_target(self, where: str = WEIGHTS_FILE) -> torch.Tensor:
        """[draft_vocab] int64: the target id of each draft id (d2t is an offset; none = the same vocabulary)."""
        d2t = self.tensors.get("d2t")
        if d2t is None:
            if self.config.draft_vocab_size != self.config.vocab_size:
                raise Eagle3FormatError(f"{where}: d2t missing, and the draft vocabulary is smaller than the target's")
            return torch.arange(self.config.vocab_size)
        if d2t.shape != (self.config.draft_vocab_size,) or d2t.is_floating_point():
            wanted = f"({self.config.draft_vocab_size},) int64"
            raise Eagle3FormatError(f"{where}: d2t is {tuple(d2t.shape)} {d2t.dtype}, wanted {wanted}")
        return torch.arange(self.config.draft_vocab_size) + d2t.long()

    def with_vocabulary(self, target_ids: torch.Tensor) -> Eagle3Checkpoint:
        """The same checkpoint whose draft id i stands for `target_ids[i]` ([draft_vocab] int64): d2t and t2d; none
        when the draft vocabulary is the target's whole vocabulary in order. vLLM 0.32 refuses a d2t there (it makes
        the mapping's parameter only for a smaller draft vocabulary), and speculators writes none."""
        tensors = {name: t for name, t in self.tensors.items() if name not in ("d2t", "t2d")}
        target_ids = target_ids.long().flatten()
        if not torch.equal(target_ids, torch.arange(self.config.vocab_size)):
            tensors.update(vocabulary_tensors(target_ids, self.config.vocab_size))
        return replace(self, tensors=tensors)


def vocabulary_tensors(target_ids: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """d2t [draft_vocab] int64 (target id - draft id) and t2d [vocab] bool for a draft vocabulary.

    Example: draft ids 0, 1, 2 standing for target ids 5, 9, 11 give d2t [5, 8, 9] and t2d True at 5, 9, 11."""
    target_ids = target_ids.long().flatten()
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return {"d2t": target_ids - torch.arange(len(target_ids)), "t2d": t2d}


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's own choice when a config names none: the inputs of layers 2, L // 2 and L - 3."""
    return (2, num_layers // 2, num_layers - 3)


def _standard_name(name: str) -> str:
    """`midlayer.x` (the original layout) -> `layers.0.x`; a `model.` prefix some exports add is dropped."""
    name = name.removeprefix("model.")
    return LAYER + name.removeprefix(_ORIGINAL_LAYER) if name.startswith(_ORIGINAL_LAYER) else name
