"""GGUF SentencePiece tokenizers (tokenizer.ggml.model "llama": Llama 2 and Gemma kinds) against
transformers' GGUF converters, the independent reference, on a held set of strings: digits,
whitespace runs, Unicode past the vocabulary (byte fallback), special tokens and a chat turn.
The fast tests use a small vocabulary built here; the slow one, the real Gemma 3 270M file."""

from __future__ import annotations

import itertools

import pytest

from kvharbor.common.tokenizer import Tokenizer, gguf_eos_ids

HELD = [
    "Hello world",
    "the band and the hat",
    "  two  spaces\tand a tab\n\nnewlines",
    "digits 1234567890 3.14159",
    "Unicode: naïve café 日本語 🤖 Ωmega",
    "    indented code():\n        return x",
    "",
    " leading",
    "trailing   ",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
]
CORPUS = [
    "the",
    "band",
    "and",
    "the",
    "hat",
    "that",
    "a",
    "cat",
    "had",
    "then",
    "hand",
    "the",
    "sand",
    "to",
    "an",
    "ant",
    "and",
    "then",
    "the",
    "man",
    "ran",
]
SPACE = "\u2581"


def vocabulary(gemma: bool) -> dict:
    """tokenizer.ggml.* fields of a SentencePiece BPE vocabulary: specials, the 256 byte tokens,
    and every piece of up to four characters of the corpus' words, most frequent first."""
    counts: dict[str, int] = {}
    for word in CORPUS:
        text = SPACE + word
        for i, j in itertools.combinations(range(len(text) + 1), 2):
            if j - i <= 4:
                counts[text[i:j]] = counts.get(text[i:j], 0) + 1
    pieces = sorted(counts, key=lambda p: (-counts[p], len(p), p))
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + ["  ", "   "] * gemma + pieces
    types = [3, 3, 3, 2, 3, 3] + [6] * 256 + [4, 4] * gemma + [1] * len(pieces)
    return {
        "general.architecture": "gemma3" if gemma else "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * (len(tokens) - len(pieces)) + [-float(i) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        **({"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": True} if gemma else {}),
    }


def reference(meta: dict):
    """transformers' tokenizer for the same fields (its GGUF reader's renaming, then its builder)."""
    from transformers.integrations.gguf import convert_gguf_tokenizer
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    fields = {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
    backend, _ = convert_gguf_tokenizer(meta["general.architecture"], fields)
    return backend


def assert_same(ours: Tokenizer, theirs, texts: list[str]) -> None:
    for text in texts:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False), text


@pytest.mark.parametrize("gemma", [False, True], ids=["llama-kind", "gemma-kind"])
def test_a_sentencepiece_vocabulary_encodes_and_decodes_like_transformers(gemma):
    meta = vocabulary(gemma)
    ours = Tokenizer.from_gguf_metadata(meta)
    assert_same(ours, reference(meta), HELD)
    assert ours.add_bos and ours.encode("the hat")[0] == 2  # BOS as llama.cpp and transformers add it


def test_byte_tokens_give_their_byte_and_pieces_keep_their_space():
    """token_bytes (structured outputs, logprob bytes): a byte-fallback token is its one byte, and a
    piece's leading ▁ is a space, which decoding a lone token would strip."""
    tok = Tokenizer.from_gguf_metadata(vocabulary(gemma=False))
    assert tok.token_bytes(6 + 0xE2) == b"\xe2"
    the = tok.backend.token_to_id(SPACE + "the")
    assert tok.token_bytes(the) == b" the"
    assert b"".join(tok.token_bytes(i) for i in tok.encode("the 日", add_special_tokens=False)) == " the 日".encode()


def test_end_of_turn_tokens_stop_generation_too():
    meta = vocabulary(gemma=True)
    assert gguf_eos_ids(meta) == (1, 5)  # <eos>, then <end_of_turn> (a control token)
    assert gguf_eos_ids({**meta, "tokenizer.ggml.eot_token_id": 4}) == (1, 4, 5)


def test_an_unknown_tokenizer_model_is_refused_by_name():
    with pytest.raises(ValueError, match="'t5' is not supported"):
        Tokenizer.from_gguf_metadata({**vocabulary(gemma=False), "tokenizer.ggml.model": "t5"})


@pytest.mark.slow  # reads a 262,144-token vocabulary twice (ours and the reference): ~6 s
def test_the_real_gemma3_vocabulary_matches_transformers(gemma3_gguf):
    from kvharbor.common.gguf_file import read_gguf_header

    meta = read_gguf_header(gemma3_gguf).metadata
    ours = Tokenizer.from_gguf_metadata(meta)
    assert_same(ours, reference(meta), HELD)
    assert ours.eos_token_ids == (1, 106) and ours.encode("Hi")[0] == 2
