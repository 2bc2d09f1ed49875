"""Our target-alone path against transformers' own greedy `generate`, on tiny random models.

The equality tests compare speculative output with our plain decoding; this file makes sure
that plain decoding is itself the model's greedy output, so a bug shared by both paths (a wrong
position, a cache off by one) cannot hide.
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from adaptive_spec import Engine


def tiny(seed):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=101,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("prompt_len", [1, 2, 17])
def test_plain_decoding_is_hf_greedy(seed, prompt_len):
    model = tiny(seed)
    prompt = [(7 * i + seed) % 101 for i in range(prompt_len)]
    ours = Engine(model, "early-exit:1", eos_token_id=[]).generate(prompt, 30, speculative=False).token_ids
    with torch.inference_mode():
        hf = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, prompt_len, dtype=torch.long),
            max_new_tokens=30,
            do_sample=False,
            pad_token_id=0,
        )
    assert ours == hf[0, prompt_len:].tolist()
    spec = Engine(model, "early-exit:2", eos_token_id=[]).generate(prompt, 30, k=3).token_ids
    assert spec == ours
