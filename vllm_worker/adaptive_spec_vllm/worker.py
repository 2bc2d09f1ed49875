"""A vLLM worker extension: load a new EAGLE-3 draft into the running draft model, between two engine steps, and
read back what it holds.

    vllm serve MODEL --speculative-config '{"method": "eagle3", "model": HEAD, ...}' \
        --worker-extension-cls adaptive_spec_vllm.worker.DraftSwap          # with VLLM_SERVER_DEV_MODE=1
    POST /collective_rpc {"method": "adaptive_spec_load_draft", "args": ["/data/adapters/v0007"]}
    POST /collective_rpc {"method": "adaptive_spec_draft"}                  # {"fingerprint": ..., "path": ...}

vLLM runs a collective RPC in its engine core between two scheduler steps, so a swap pauses decoding for the load
itself (the draft's ~8 M weights copied in place) and no request fails: the next step drafts with the new weights.
The draft must keep its shapes (one layer, the same draft vocabulary size): vLLM sized the draft model when it
loaded the first head, and only values change in place. vLLM's own draft weight update API
(`start_draft_weight_update` / `update_weights` / `finish_weight_update`) does the same through transports that are
CUDA-only in 0.32 (IPC and NCCL); this reads a file the sidecar can see, which works on every device.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from adaptive_spec_vllm.fingerprint import fingerprint

CONFIG = "config.json"
WEIGHTS = "model.safetensors"


class DraftSwap:
    """Mixed into vLLM's worker class (so `self` is the worker: `get_draft_model()`, `rank`)."""

    def adaptive_spec_load_draft(self, path: str) -> dict:
        """Load the EAGLE-3 checkpoint in directory `path` into the draft model, in place; then read it back."""
        from safetensors.torch import load_file

        model = self._adaptive_spec_draft_model()
        directory = Path(path)
        config = json.loads((directory / CONFIG).read_text())
        tensors = load_file(str(directory / WEIGHTS))
        wanted = int(config.get("draft_vocab_size") or config["transformer_layer_config"]["vocab_size"])
        held = int(model.config.draft_vocab_size)
        if wanted != held:
            raise ValueError(
                f"{path}: a draft vocabulary of {wanted} tokens; this vLLM loaded a draft of {held} and can only take "
                f"heads of that size without a restart"
            )
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        draft_config = self.speculative_config.draft_model_config  # type: ignore[attr-defined]  # vLLM's worker
        with torch.no_grad():
            # vLLM's own in-place reload: each layer is loaded, then processed again as at start-up (on CPU its
            # linears are repacked for oneDNN and their parameters emptied, so a plain load_weights cannot land)
            initialize_layerwise_reload(model)
            model.load_weights(tensors.items())
            finalize_layerwise_reload(model, draft_config)
        self._adaptive_spec_loaded = (str(directory), tensors)
        return self.adaptive_spec_draft()

    def adaptive_spec_draft(self) -> dict:
        """What the draft model holds now: the fingerprint of the tensors this worker last loaded into it (at start,
        the head vLLM loaded, read again from its directory), after checking that every parameter still held
        as a plain tensor (norms, d2t, an LM head that was not repacked) equals them; `live` counts those."""
        model = self._adaptive_spec_draft_model()
        path, loaded = getattr(self, "_adaptive_spec_loaded", (None, None))
        if path is None:
            from safetensors.torch import load_file

            path = self.speculative_config.model  # type: ignore[attr-defined]
            loaded = load_file(str(Path(path) / WEIGHTS))
            self._adaptive_spec_loaded = (path, loaded)
        live = standard_tensors(model)
        differ = [
            name
            for name, tensor in live.items()
            if name not in loaded or not torch.equal(tensor, loaded[name].to(tensor))
        ]
        if differ:
            raise RuntimeError(f"the draft's {', '.join(differ[:3])} differ from the head loaded from {path}")
        digest = fingerprint(loaded, self._adaptive_spec_dtype(model))
        return {"fingerprint": digest, "path": path, "live": sorted(live), "rank": int(getattr(self, "rank", 0))}

    @staticmethod
    def _adaptive_spec_dtype(model) -> torch.dtype:
        return next(p for p in model.parameters() if p.is_floating_point()).dtype

    def _adaptive_spec_draft_model(self):
        model = self.get_draft_model()  # type: ignore[attr-defined]  # vLLM's worker
        if model is None:
            raise RuntimeError("this vLLM has no draft model: start it with an eagle3 --speculative-config")
        return model


def standard_tensors(model) -> dict[str, torch.Tensor]:
    """vLLM's Eagle3LlamaForCausalLM parameters that it holds as plain tensors, under the checkpoint's standard
    names: fused qkv_proj and gate_up_proj split back into q/k/v and gate/up, its LM head without the rows it pads
    to a multiple of 64, `draft_id_to_target_id` as d2t. A linear repacked for the CPU holds an empty parameter
    (its weights live in the kernel's own format) and is left out. Tensor parallelism 1."""
    params = {name: p for name, p in model.named_parameters() if p.numel() > 0}
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    out: dict[str, torch.Tensor] = {}
    for name, tensor in params.items():
        if name.startswith("model.embed_tokens"):
            continue
        if name == "draft_id_to_target_id":
            out["d2t"] = tensor
        elif name == "lm_head.weight":
            out[name] = tensor[: int(config.draft_vocab_size)]
        elif name.endswith("qkv_proj.weight"):
            stem = name.removeprefix("model.").removesuffix("qkv_proj.weight")
            for part, chunk in zip("qkv", torch.split(tensor, [q, kv, kv]), strict=True):
                out[f"{stem}{part}_proj.weight"] = chunk
        elif name.endswith("gate_up_proj.weight"):
            stem = name.removeprefix("model.").removesuffix("gate_up_proj.weight")
            gate, up = torch.chunk(tensor, 2)
            out[f"{stem}gate_proj.weight"], out[f"{stem}up_proj.weight"] = gate, up
        else:
            out[name.removeprefix("model.")] = tensor
    return out
