"""SmolLM2's tokenizer rebuilt from GGUF metadata: known ids, the digit pre-tokenizer, whitespace
runs, special tokens, the chat template, and streaming decode of multi-byte text."""

import pytest

from kvharbor.engine.detokenizer import Detokenizer
from kvharbor.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok(smollm):
    return smollm.tokenizer


def pieces(tok, text):
    return [tok.id_to_token(i) for i in tok.encode(text)]


def test_known_ids_from_the_reference_answer(tok):
    assert tok.encode("The capital of France is Paris.<|im_end|>") == [504, 3575, 282, 4649, 314, 7042, 30, 2]


def test_digits_split_one_by_one_without_breaking_whitespace_runs(tok):
    # The `smollm` pre-tokenizer: "\n\n1" is ĊĊ + 1 (transformers' GGUF import gives Ċ, Ċ, 1).
    assert pieces(tok, "\n\n1") == ["ĊĊ", "1"]
    assert pieces(tok, "2024") == ["2", "0", "2", "4"]
    assert pieces(tok, "x = 3.14") == ["x", "Ġ=", "Ġ", "3", ".", "1", "4"]


@pytest.mark.parametrize(
    "text",
    [
        "a  b\t\tc\n\n\nd",
        "   leading and trailing   ",
        "naïve café — 東京 🙂",
        "x1y22z333",
        "\r\n\r\nwin",
        "<|im_start|>",
    ],
)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_special_tokens_are_matched_in_text_and_skipped_on_decode(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.add_bos is False  # SmolLM2 adds no BOS


def test_chat_template_is_chatml_with_the_default_system_prompt(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    parts = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert parts == text
    # encode_chat, the one way every part turns a chat into ids: the template's text, no BOS added
    assert tok.encode_chat([{"role": "user", "content": "Hi"}]) == tok.encode(text, add_special_tokens=False)
    assert tok.encode_chat([{"role": "user", "content": "Hi"}])[0] == tok.encode("<|im_start|>")[0]


@pytest.mark.parametrize(
    ("messages", "match"),
    [([], "non-empty list"), ([{"content": "x"}], "string 'role'"), ([{"role": "user", "content": 5}], "content")],
)
def test_bad_messages(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_streaming_decode_waits_for_whole_characters(tok):
    text = "naïve café — 東京 🙂 done"
    ids = tok.encode(text)
    detok = Detokenizer(tok, SamplingParams())
    deltas = []
    for i in range(1, len(ids) + 1):
        detok.update(ids[:i])
        deltas.append(detok.delta(final=i == len(ids)))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_spanning_tokens_is_cut_and_never_half_streamed(tok):
    text = "The answer is forty-two, clearly."
    ids = tok.encode(text)
    detok = Detokenizer(tok, SamplingParams(stop=["forty-two"]))
    deltas, stop = [], None
    for i in range(1, len(ids) + 1):
        stop = detok.update(ids[:i])
        deltas.append(detok.delta(final=stop is not None))
        if stop:
            break
    assert stop == "forty-two"
    assert "".join(deltas) == detok.text == "The answer is "
    assert all("fort" not in d for d in deltas)


@pytest.mark.slow  # a fresh interpreter
def test_the_tokenizer_loads_without_weights_or_torch(smollm):
    """The gateway tokenizes with common.model_files: same ids as the engine, and no torch."""
    import subprocess
    import sys

    code = (
        "import sys; from kvharbor.common.model_files import load_tokenizer\n"
        "name, tok = load_tokenizer(None)\n"
        "print(name, tok.encode('The year 2026, twice: 2026!'), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 1)
    assert out[0] == smollm.name == "SmolLM2-135M-Instruct"
    assert out[1].strip() == f"{smollm.tokenizer.encode('The year 2026, twice: 2026!')} False"


@pytest.mark.parametrize("post_processor", [True, False])
def test_an_hf_folder_adds_bos_as_transformers_does(tok, tmp_path, post_processor):
    """Llama 3's and Gemma's tokenizer.json add BOS in their post-processor: a plain prompt to
    /v1/completions must get it, as transformers' tokenizer gives it; a chat prompt must not get a
    second one (its template writes BOS)."""
    import json

    from tokenizers import processors
    from transformers import AutoTokenizer

    from kvharbor.common.tokenizer import Tokenizer

    backend = tok.backend.__class__.from_str(tok.backend.to_str())
    if post_processor:
        backend.post_processor = processors.TemplateProcessing(
            single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
        )
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
              "chat_template": "<|im_start|>{% for m in messages %}{{ m['content'] }}{% endfor %}"}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_hf_dir(tmp_path, (2,), 1)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "The capital of France is"
    assert ours.encode(text) == theirs(text).input_ids == ([1] if post_processor else []) + tok.encode(text)
    assert ours.encode_chat([{"role": "user", "content": text}]) == [1, *tok.encode(text)]  # one BOS
