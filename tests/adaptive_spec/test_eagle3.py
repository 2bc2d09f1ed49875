"""The standard EAGLE-3 head (drafters/eagle3_head.py) and its checkpoint (formats/eagle3.py), on a tiny Llama.

    .venv/bin/python -m pytest tests/adaptive_spec/test_eagle3.py -q -n 0

The head must compute what vLLM's `Eagle3LlamaForCausalLM` computes: `_vllm_reference` below follows
vllm/model_executor/models/llama_eagle3.py line by line in plain tensor operations (vLLM's fused
`RMSNorm(x, residual)` written out as `residual = x + residual; x = norm(residual)`), and the head is compared
to it on random weights. A checkpoint written and read again gives the same head bit for bit, in the
speculators layout and in the original `midlayer.*` one; a bad checkpoint is refused with its file named.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import tiny_target

from adaptive_spec.cache.feeding import capture_states
from adaptive_spec.drafters.eagle3_head import Eagle3Head, aux_layer_ids_for
from adaptive_spec.formats.eagle3 import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    Eagle3Checkpoint,
    Eagle3FormatError,
    vocabulary_tensors,
)

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.tensor([[5, 17, 33, 8, 5, 17, 40, 2, 9]])  # [1, width]


def _random_head(target, seed: int = 0, draft_ids=None) -> Eagle3Head:
    head = Eagle3Head(target, draft_ids=draft_ids)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in head.parameters():  # every weight random, so no half of q/k/v or fc is zero
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1 + (parameter.dim() == 1))
    return head.eval()


def _aux(target, head: Eagle3Head) -> torch.Tensor:
    """The target's aux states for IDS: id i is the state entering layer i (the output of layer i - 1)."""
    with torch.no_grad(), capture_states(target, layers=tuple(i - 1 for i in head.aux_layer_ids)) as captured:
        target.model(input_ids=IDS, use_cache=False)
    return captured[0]  # [1, width, k * hidden]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding, as vLLM's get_rope for Llama: x [heads, width, d]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions[:, None].float() * inv[None]  # [width, d / 2]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    rotated = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


def _vllm_reference(checkpoint: Eagle3Checkpoint, embed: torch.Tensor, ids: torch.Tensor, states: torch.Tensor):
    """vLLM's Eagle3LlamaForCausalLM for one sequence (no cache, causal): ids [width], states [width, k * H] or
    [width, h] -> (pre-norm state [width, h], full-vocabulary logits [width, vocab])."""
    c, w = checkpoint.config, checkpoint.tensors
    layer = {name.removeprefix("layers.0."): t for name, t in w.items() if name.startswith("layers.0.")}
    eps, d = c.rms_norm_eps, c.head_dim
    # combine_hidden_states: fc over the aux states (a state fed back has the head's width and skips it)
    hidden_states = states @ w["fc.weight"].T if states.shape[-1] != c.hidden_size else states
    # LlamaDecoderLayer (layer_idx 0, norm_before_residual False)
    embeds = _rms(embed[ids], layer["input_layernorm.weight"], eps)
    residual = hidden_states
    hidden_states = _rms(hidden_states, layer["hidden_norm.weight"], eps)
    hidden_states = torch.cat([embeds, hidden_states], dim=-1)  # [width, 2h]
    positions = torch.arange(len(ids))
    q = (hidden_states @ layer["self_attn.q_proj.weight"].T).view(len(ids), -1, d).transpose(0, 1)
    k = (hidden_states @ layer["self_attn.k_proj.weight"].T).view(len(ids), -1, d).transpose(0, 1)
    v = (hidden_states @ layer["self_attn.v_proj.weight"].T).view(len(ids), -1, d).transpose(0, 1)
    q, k = _rope(q, positions, c.rope_theta), _rope(k, positions, c.rope_theta)
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    scores = (q @ k.transpose(1, 2)) / d**0.5
    scores = scores.masked_fill(~torch.ones(len(ids), len(ids), dtype=torch.bool).tril(), float("-inf"))
    attended = (scores.softmax(-1) @ v).transpose(0, 1).reshape(len(ids), -1) @ layer["self_attn.o_proj.weight"].T
    residual = attended + residual  # post_attention_layernorm(hidden_states, residual), fused
    hidden_states = _rms(residual, layer["post_attention_layernorm.weight"], eps)
    gate, up = hidden_states @ layer["mlp.gate_proj.weight"].T, hidden_states @ layer["mlp.up_proj.weight"].T
    hidden_states = (torch.nn.functional.silu(gate) * up) @ layer["mlp.down_proj.weight"].T
    prenorm = hidden_states + residual  # self.norm(hidden_states, residual), fused
    logits = _rms(prenorm, w["norm.weight"], eps) @ w["lm_head.weight"].T  # [width, draft_vocab]
    full = logits.new_full((len(ids), c.vocab_size), float("-inf"))
    full[:, checkpoint.draft_to_target()] = logits  # compute_logits: arange(draft_vocab) + d2t
    return prenorm, full


@pytest.mark.parametrize("draft_vocab", [None, 48])
def test_the_head_computes_what_vllms_eagle3_llama_computes_and_feeds_its_own_state_back(draft_vocab) -> None:
    target = tiny_target(0)
    draft_ids = None if draft_vocab is None else torch.randperm(target.config.vocab_size)[:draft_vocab].sort()[0]
    head = _random_head(target, draft_ids=draft_ids)
    checkpoint = head.checkpoint("tiny")
    aux = _aux(target, head)
    with torch.no_grad():
        out = head(IDS, aux)  # first pass: from the target's aux states
        again = head(IDS, out)  # a further draft step: its own pre-norm state, no fc
    embed = target.model.embed_tokens.weight
    for ours, states in ((out, aux), (again, out)):
        prenorm, logits = _vllm_reference(checkpoint, embed, IDS[0], states[0])
        torch.testing.assert_close(ours[0], prenorm, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(head.target_logits(ours)[0], logits, atol=1e-5, rtol=1e-5)
    assert head.aux_layer_ids == aux_layer_ids_for(target) == (2, 4)  # 4 layers: layer 2's input, the final state


def test_an_untrained_head_reads_the_final_state_through_the_targets_last_layer() -> None:
    """fc picks the last aux state (what enters the final norm) and q/k/v read the state half only: the head's
    output does not depend on the embedding, and its norm and LM head are the target's."""
    target = tiny_target(0)
    head = Eagle3Head(target).eval()
    aux = _aux(target, head)
    other = torch.tensor([[9, 9, 9, 9, 9, 9, 9, 9, 9]])
    with torch.no_grad():
        torch.testing.assert_close(head(IDS, aux), head(other, aux))
        hidden = target.config.hidden_size
        torch.testing.assert_close(head.fc(aux), aux[..., -hidden:])
    assert torch.equal(head.lm_head.weight, target.lm_head.weight) and torch.equal(
        head.norm.weight, target.model.norm.weight
    )


@pytest.mark.parametrize("layout", ["speculators", "original"])
def test_a_checkpoint_written_and_read_again_is_the_same_head(tmp_path, layout) -> None:
    target = tiny_target(0)
    head = _random_head(target, seed=1, draft_ids=torch.arange(10, 70))
    directory = head.checkpoint("tiny", speculative_tokens=4).write(tmp_path / "head")
    config = json.loads((directory / CONFIG_FILE).read_text())
    assert "model_type" not in config and config["speculators_model_type"] == "eagle3"  # how vLLM recognises it
    assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert config["norm_before_residual"] is False and config["eagle_aux_hidden_state_layer_ids"] == [2, 4]
    tensors = load_file(directory / WEIGHTS_FILE)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * target.config.hidden_size
    if layout == "original":  # SpecForge / SafeAILab: midlayer.*, the layer's fields at the top of config.json
        save_file({k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}, directory / WEIGHTS_FILE)
        original = {
            **config["transformer_layer_config"],
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": config["draft_vocab_size"],
        }
        (directory / CONFIG_FILE).write_text(json.dumps(original))
    read = Eagle3Checkpoint.read(directory)
    assert read.tensors.keys() == head.checkpoint("tiny").tensors.keys()
    if layout == "original":  # the original layout names no aux layers: a 2-layer fc needs them named
        assert read.config.aux_layer_ids == ()
        with pytest.raises(Eagle3FormatError, match="name the aux layers"):
            Eagle3Head.from_checkpoint(target, read)
    again = Eagle3Head.from_checkpoint(target, read, aux_layer_ids=head.aux_layer_ids).eval()
    aux = _aux(target, head)
    with torch.no_grad():
        assert torch.equal(again(IDS, aux), head(IDS, aux))
        assert torch.equal(again.target_logits(head(IDS, aux)), head.target_logits(head(IDS, aux)))
    assert torch.equal(again.draft_ids, torch.arange(10, 70))


def test_vocabulary_tensors_are_offsets_and_a_mask() -> None:
    mapping = vocabulary_tensors(torch.tensor([5, 9, 11]), vocab_size=16)
    assert mapping["d2t"].tolist() == [5, 8, 9]  # target id = draft id + d2t[draft id]
    assert mapping["t2d"].nonzero().flatten().tolist() == [5, 9, 11]


def _written(tmp_path):
    target = tiny_target(0)
    return target, _random_head(target, draft_ids=torch.arange(40)).checkpoint("tiny")


@pytest.mark.parametrize(
    ("spoil", "says"),
    [
        (lambda t: t.pop("fc.weight"), "missing fc.weight"),
        (lambda t: t.__setitem__("norm.weight", torch.ones(3)), re.escape("norm.weight is (3,)")),
        (lambda t: t["lm_head.weight"].__setitem__((0, 0), float("nan")), "lm_head.weight holds NaN"),
        (lambda t: t.__setitem__("d2t", torch.full((40,), 100)), "d2t maps draft ids"),  # past the vocabulary
    ],
)
def test_a_bad_checkpoint_is_refused_naming_the_file_and_what_is_wrong(tmp_path, spoil, says) -> None:
    _, checkpoint = _written(tmp_path)
    directory = checkpoint.write(tmp_path / "head")
    tensors = load_file(directory / WEIGHTS_FILE)
    spoil(tensors)
    save_file(tensors, directory / WEIGHTS_FILE)
    with pytest.raises(Eagle3FormatError, match=says) as refused:
        Eagle3Checkpoint.read(directory)
    assert str(directory / WEIGHTS_FILE) in str(refused.value)


def test_a_directory_that_is_no_eagle3_checkpoint_or_does_not_fit_the_target_is_refused(tmp_path) -> None:
    target, checkpoint = _written(tmp_path)
    with pytest.raises(Eagle3FormatError, match="missing"):
        Eagle3Checkpoint.read(tmp_path)
    directory = checkpoint.write(tmp_path / "head")
    (directory / CONFIG_FILE).write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    with pytest.raises(Eagle3FormatError, match="neither a speculators config nor an EAGLE-3 one"):
        Eagle3Checkpoint.read(directory)
    other = tiny_target(0, vocab=target.config.vocab_size + 8)
    with pytest.raises(Eagle3FormatError, match="vocab_size"):
        Eagle3Head.from_checkpoint(other, checkpoint)


def test_a_speculators_config_without_norm_before_residual_reads_as_vllm_reads_it_and_two_layers_are_refused(
    tmp_path,
) -> None:
    """vLLM takes a speculators config without `norm_before_residual` as true (an original one as false), and sizes
    fc from `num_aux_hidden_states`; a head of two draft layers would lose its second here, so it is refused."""
    _, checkpoint = _written(tmp_path)
    directory = checkpoint.write(tmp_path / "head")
    config = json.loads((directory / CONFIG_FILE).read_text())
    assert config["transformer_layer_config"]["num_aux_hidden_states"] == 2
    del config["norm_before_residual"]
    (directory / CONFIG_FILE).write_text(json.dumps(config))
    assert Eagle3Checkpoint.read(directory).config.norm_before_residual is True
    tensors = load_file(directory / WEIGHTS_FILE)
    tensors["layers.1.input_layernorm.weight"] = torch.ones(64)
    save_file(tensors, directory / WEIGHTS_FILE)
    with pytest.raises(Eagle3FormatError, match="more than one draft layer"):
        Eagle3Checkpoint.read(directory)


def test_a_head_over_the_whole_vocabulary_writes_no_mapping(tmp_path) -> None:
    """vLLM 0.32 makes its d2t parameter only for a smaller draft vocabulary and refuses a d2t otherwise (seen with
    `vllm serve` on the default model); speculators writes none there either."""
    target = tiny_target(0)
    head = _random_head(target)
    checkpoint = head.checkpoint("tiny")
    assert "d2t" not in checkpoint.tensors and "t2d" not in checkpoint.tensors
    read = Eagle3Checkpoint.read(checkpoint.write(tmp_path / "head"))
    assert torch.equal(read.draft_to_target(), torch.arange(target.config.vocab_size))
