"""A character-level chat tokenizer built in code, for chat tests on the tiny models (nothing is downloaded).

    tokenizer = tiny_tokenizer()                 # 112 tokens, the tiny models' vocabulary
    tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)

Each printable ASCII character and "\\n" is one token; `<|im_end|>` is EOS, as in ChatML. The
`<extra_N>` tokens pad the vocabulary to the model's size, so every id a random model can
emit decodes to something.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(vocab_size: int = 112) -> PreTrainedTokenizerFast:
    tokens = SPECIALS + ["\n"] + [chr(c) for c in range(32, 127)]
    tokens += [f"<extra_{i}>" for i in range(vocab_size - len(tokens))]
    backend = Tokenizer(WordLevel({token: i for i, token in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE
    )
