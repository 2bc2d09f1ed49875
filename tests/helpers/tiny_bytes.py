"""A byte-level BPE chat tokenizer built in code for the tiny models, which the grammar library
(llguidance) can read: structured outputs and token bytes on tiny models (nothing is downloaded).

    tokenizer = tiny_byte_tokenizer()     # 112 tokens, the tiny models' vocabulary
    tokenizer.encode('{"a": 1}')          # one token per character, as GPT-2 spells bytes

The character-level tokenizer of tiny_chat.py decodes with `Fuse`, which llguidance refuses; this
one spells each byte as GPT-2 does ("Ġ" for a space, "Ċ" for a newline) and decodes with
`ByteLevel`, like SmolLM2's. It has printable ASCII and "\\n", no merges; `<|im_end|>` is EOS.
"""

from __future__ import annotations

from tiny_chat import CHAT_TEMPLATE, SPECIALS
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast


def byte_stand_in(byte: int) -> str:
    """GPT-2's printable character for a byte (`bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


def tiny_byte_tokenizer(vocab_size: int = 112, chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    tokens = SPECIALS + [byte_stand_in(b) for b in [10, *range(32, 127)]]
    tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    backend = Tokenizer(BPE({token: i for i, token in enumerate(tokens)}, [], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>", chat_template=chat_template
    )
