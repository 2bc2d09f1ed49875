"""A character-level chat tokenizer built in code, for chat tests on the tiny models (nothing is downloaded).

    tokenizer = tiny_tokenizer()                 # 112 tokens, the tiny models' vocabulary
    tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)

Each printable ASCII character and "\\n" is one token; `<|im_end|>` is EOS, as in ChatML. Built in
benchmarks/tiny_model.py (which `adaptive-spec bench-chaos` runs on too).
"""

from __future__ import annotations

from benchmarks.tiny_model import CHAT_TEMPLATE, SPECIALS, tiny_tokenizer

__all__ = ["CHAT_TEMPLATE", "SPECIALS", "tiny_tokenizer"]
