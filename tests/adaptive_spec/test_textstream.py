"""IncrementalText: the deltas of a stream, and the decode it saves where decoding concatenates.

The tokenizers are built in code: a byte-level BPE (GPT-2's and the default model's kind of decoder) whose
small vocabulary splits accented letters, CJK and emoji across tokens, the tiny model's character-level
one (a fusing decoder), and a SentencePiece-style one (Metaspace), whose decode strips a leading space and
so must decode everything each time.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, WhisperTokenizer

from adaptive_spec.outputs.textstream import IncrementalText, decodes_by_concatenation
from benchmarks.tiny_model import tiny_tokenizer

CORPUS = ["héllo wörld ☃ 日本語のテキスト 🙂🚀 naïve café\n"] * 40


class Decoding:
    """What IncrementalText reads of an engine: its tokenizer and `decode` (as Engine.decode), plus the
    length of every decode asked for."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, token_ids: list[int]) -> str:
        self.lengths.append(len(token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def byte_level() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|end|>"]
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end|>", clean_up_tokenization_spaces=False)


def metaspace() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False)


def streamed(tokenizer, ids: list[int], chunks: list[int], stops=None, concatenates: bool | None = None):
    """Push `ids` in chunks of the given sizes; (the deltas, the decodes' lengths, the stream)."""
    engine = Decoding(tokenizer)
    text = IncrementalText(engine, stops)
    if concatenates is not None:
        text._concatenates = concatenates
    deltas, at = [], 0
    for size in chunks:
        deltas.append(text.push(ids[at : at + size]))
        at += size
    return deltas, engine.lengths, text


def sizes(rng: random.Random, total: int) -> list[int]:
    out = []
    while total > 0:
        out.append(min(total, rng.choice([1, 1, 1, 2, 3, 5])))
        total -= out[-1]
    return out


def test_which_decoders_concatenate():
    assert decodes_by_concatenation(byte_level())
    assert decodes_by_concatenation(tiny_tokenizer())
    assert not decodes_by_concatenation(metaspace())  # strips the first space of a decode
    cleaned = byte_level()
    cleaned.clean_up_tokenization_spaces = True  # " ." -> "." looks across tokens
    assert not decodes_by_concatenation(cleaned)
    assert not decodes_by_concatenation(None)  # no tokenizer: the engine decodes nothing


def test_a_class_that_decodes_its_own_way_decodes_everything():
    """Whisper's tokenizer is byte-level but takes timestamps out of the whole text: after "<|1." and
    "00|>" the output's text is empty, so nothing may have been shown. (Found in review.)"""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {character: i for i, character in enumerate(alphabet)}
    tokenizer = WhisperTokenizer(vocab=vocab, merges=[], clean_up_tokenization_spaces=False)
    assert type(tokenizer.backend_tokenizer.decoder) is decoders.ByteLevel
    assert not decodes_by_concatenation(tokenizer)
    ids = [vocab[character] for character in "<|1.00|>"]
    deltas, _, stream = streamed(tokenizer, ids, [4, 4])
    assert tokenizer.decode(ids, skip_special_tokens=True) == ""
    assert deltas == ["<|1.", ""]  # what decoding everything shows (the first chunk is not yet a timestamp)
    assert stream.finish("") == ""


@pytest.mark.parametrize("seed", range(6))
def test_deltas_equal_decoding_everything_each_time(seed):
    """Random token ids (whole characters, characters split across tokens, bytes that never make one, a
    special token), pushed in random chunks: each delta is what decoding the whole output gives."""
    tokenizer, rng = byte_level(), random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(300)]
    ids[100:100] = tokenizer.encode("".join(CORPUS[:2]))  # text that decodes cleanly, in the middle
    chunks = sizes(rng, len(ids))
    fast, _, stream = streamed(tokenizer, ids, chunks, stops=["ü", "\n\n"])
    slow, _, _ = streamed(tokenizer, ids, chunks, stops=["ü", "\n\n"], concatenates=False)
    assert fast == slow
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert stream._text() == full
    assert "".join(fast) + stream.finish(full) == full


def test_a_character_split_across_tokens_is_shown_once_whole():
    tokenizer = byte_level()
    ids = tokenizer.encode("a🙂b日本")
    assert len(ids) > len("a🙂b日本"), "the emoji and the CJK characters take several byte tokens each"
    deltas, _, _ = streamed(tokenizer, ids, [1] * len(ids))
    assert "".join(deltas) == "a🙂b日本"
    assert all("\ufffd" not in delta for delta in deltas)


def test_decoding_stays_short_for_a_long_output():
    """4,000 tokens one at a time: each decode covers the tokens since the last whole character, not the
    output so far (which made a stream's decoding grow with the square of its length)."""
    tokenizer = byte_level()
    ids = (tokenizer.encode("".join(CORPUS)) * 6)[:4000]
    assert len(ids) == 4000
    deltas, lengths, _ = streamed(tokenizer, ids, [1] * len(ids))
    assert "".join(deltas) == tokenizer.decode(ids)
    assert max(lengths) <= 8  # a token may end inside one character and the next inside another
    _, everything, _ = streamed(tokenizer, ids, [1] * len(ids), concatenates=False)
    assert max(everything) == 4000


def test_a_tokenizer_that_does_not_concatenate_decodes_everything():
    tokenizer = metaspace()
    ids = tokenizer.encode("héllo wörld café naïve")
    deltas, lengths, _ = streamed(tokenizer, ids, [1] * len(ids))
    assert lengths == list(range(1, len(ids) + 1))
    assert "".join(deltas) == tokenizer.decode(ids)


def test_the_tiny_models_tokenizer():
    """Its decoder fuses token strings; a stop string's start is held back as with any tokenizer."""
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("Hello, world!\nSecond lin")
    deltas, lengths, stream = streamed(tokenizer, ids, sizes(random.Random(0), len(ids)), stops=["line"])
    assert "".join(deltas) == "Hello, world!\nSecond "
    assert stream._text() == "Hello, world!\nSecond lin"
    assert max(lengths) <= 5  # each chunk's tokens alone: every token is a whole character
