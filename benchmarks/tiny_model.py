"""A tiny random Llama and a character-level chat tokenizer, built in code (nothing is downloaded): the model
`adaptive-spec bench-chaos` runs its fleet on, and the one the tests build (tests/helpers/tiny.py,
tiny_chat.py and the `tiny_model_dir` fixture take them from here).

    path = save_tiny_model(Path("/tmp/tiny"))     # config, weights and tokenizer: `--target /tmp/tiny`
    model = llama(seed=0)                          # 4 layers, 64 wide, 112 tokens, fp32, eval mode
    tokenizer = tiny_tokenizer()                   # tokenizer.apply_chat_template([...], add_generation_prompt=True)

The configs have no EOS token (a caller that wants one passes `eos_token_id` to the Engine), so a generation
runs for its whole budget unless told otherwise; the tokenizer's EOS is `<|im_end|>`, as in ChatML.

`initializer_range` is 0.1 rather than Llama's 0.02: with 0.02 a 64-wide model's next-token logits are almost
flat, and the gap between the two best tokens becomes small enough for float32 rounding (a different matmul
shape in a k + 1 token verification) to swap them. At 0.1 the logits have a standard deviation near 1, so
greedy equality is a property of the engine, not of luck.

Each printable ASCII character and "\\n" is one token; the `<extra_N>` tokens pad the vocabulary to the
model's size, so every id a random model can emit decodes to something.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 112
TARGET_LAYERS = 4
MAX_POSITIONS = 256
SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def llama(
    seed: int,
    vocab: int = VOCAB,
    layers: int = TARGET_LAYERS,
    hidden: int = 64,
    init: float = 0.1,
    positions: int = MAX_POSITIONS,
) -> LlamaForCausalLM:
    """A random fp32 Llama: `hidden` wide, 4 query heads sharing 2 KV heads, 256 positions (or `positions`)."""
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.float32).eval()


def tiny_tokenizer(vocab_size: int = VOCAB) -> PreTrainedTokenizerFast:
    tokens = SPECIALS + ["\n"] + [chr(c) for c in range(32, 127)]
    tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    backend = Tokenizer(WordLevel({token: i for i, token in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE
    )


def save_tiny_model(path: Path, seed: int = 0) -> Path:
    """The 4-layer target (`llama(seed)`) and the chat tokenizer, saved in `path` (once: kept if there)."""
    if not (path / "config.json").is_file():
        llama(seed).save_pretrained(path)
        tiny_tokenizer().save_pretrained(path)
    return path
