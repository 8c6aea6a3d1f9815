"""Tokenizer: `tokenizers` BPE built from a HF folder or from GGUF metadata (byte-level BPE, or
SentencePiece BPE with byte fallback: Llama 2, Gemma), plus the chat template.

GGUF files name their pre-tokenizer (`tokenizer.ggml.pre`). Converters that ignore it get digits
wrong: SmolLM2's `smollm` splits every digit on its own before byte-level BPE, so "\\n\\n1" must be
`ĊĊ`,`1` and not `Ċ`,`Ċ`,`1`. `_PRE_TOKENIZERS` rebuilds each pre-tokenizer kvharbor knows.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from kvharbor.common.model_families import reasoning_parser, template_takes_tools, tool_call_parser
from kvharbor.common.tool_calls import messages_for_template

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def _byte_level() -> list:
    return [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]


def _split_then_bytes(pattern: str) -> list:
    return [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]


# llama.cpp's `tokenizer.ggml.pre` names -> the equivalent `tokenizers` pre-tokenizer chain.
_PRE_TOKENIZERS = {
    "default": _byte_level,
    "gpt2": _byte_level,
    # One digit per pre-token, then GPT-2's regex (llama.cpp groups these five together).
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "codeshell", "minerva"),
        lambda: [pre_tokenizers.Digits(individual_digits=True), *_byte_level()],
    ),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _split_then_bytes(_QWEN2_SPLIT),
}

_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4
_SPACE = "\u2581"  # SentencePiece's visible space
# Tokens that end a turn in the families kvharbor serves: llama.cpp stops on these too (its EOG
# set), where a GGUF names only one EOS id (Gemma's <end_of_turn>, Llama 3's <|eot_id|>).
_END_OF_TURN = ("<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>")


def gguf_eos_ids(meta: dict[str, Any]) -> tuple[int, ...]:
    """Every id that ends generation: the file's EOS, EOT and EOM ids, then the end-of-turn
    tokens its vocabulary holds as control tokens."""
    ids = [meta.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    tokens, types = meta.get("tokenizer.ggml.tokens") or [], meta.get("tokenizer.ggml.token_type") or []
    for i, token in enumerate(tokens):
        if token in _END_OF_TURN and i < len(types) and types[i] == _GGUF_CONTROL:
            ids.append(i)
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _byte_level_alphabet() -> dict[str, int]:
    # GPT-2's reversible byte <-> printable-character map used by byte-level BPE vocabularies.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_DECODER = _byte_level_alphabet()


class Tokenizer:
    """Encode, decode and render chats for one model. Special tokens are matched in text."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        chat_template: str | None,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        add_bos: bool,
        model_type: str = "",
    ) -> None:
        self.backend = backend
        self.model_type = model_type  # config.json's, or the GGUF's architecture: its family
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.add_bos = add_bos
        self._template = None

    @property
    def tool_parser(self) -> str:
        """How this model writes tool calls under kvharbor's prompts (common/model_families.py)."""
        return tool_call_parser(self.model_type, template_takes_tools(self.chat_template))

    @property
    def reasoning_parser(self) -> str | None:
        """How its reasoning is told from its answer; None: it writes none apart."""
        return reasoning_parser(self.model_type)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a byte-level token may hold part of a character)."""
        piece = self.backend.id_to_token(token_id)
        if piece is not None and isinstance(self.backend.decoder, decoders.ByteLevel):
            try:
                return bytes(_BYTE_DECODER[c] for c in piece)
            except KeyError:
                pass  # an added token written in plain text
        if piece is not None and isinstance(self.backend.model, models.BPE) and self.backend.model.byte_fallback:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece's byte tokens
                return bytes([int(piece[3:5], 16)])
            return piece.replace(_SPACE, " ").encode()  # its leading space kept (decode would strip it)
        return self.backend.decode([token_id], skip_special_tokens=False).encode()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS is prepended when the model wants it and `add_special_tokens`:
        by tokenizer.json's post-processor where it has one (Llama 3's and Gemma's add BOS there,
        as transformers applies it), else by `add_bos`."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> decoders.DecodeStream:
        """An incremental decoder: `.step(tokenizer.backend, id)` returns new text or None while
        a multi-byte character is still incomplete."""
        return decoders.DecodeStream(skip_special_tokens=skip_special_tokens)

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of `messages` rendered with the chat template, ready for the assistant's
        turn: the one way every part turns a chat into a prompt (the template carries any BOS).
        `tools`: OpenAI tool definitions the model may call. Raises ValueError as
        apply_chat_template does."""
        return self.encode(self.apply_chat_template(messages, tools=tools), add_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """Render `messages` with the model's chat template. A template that takes no `tools` gets
        them, and the messages' tool calls and results, in Hermes' format (common/tool_calls.py).
        Raises ValueError on malformed messages or a model without a template."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template; send a plain prompt to /v1/completions instead")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {role, content} objects")
        takes_tools = template_takes_tools(self.chat_template)
        messages = messages_for_template(messages, tools, takes_tools)
        clean = [_check_message(i, m) for i, m in enumerate(messages)]
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        special = self.backend.get_added_tokens_decoder()
        bos = special[self.bos_token_id].content if self.bos_token_id in special else ""
        eos = special[self.eos_token_ids[0]].content if self.eos_token_ids and self.eos_token_ids[0] in special else ""
        return self._template.render(
            messages=clean, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos,
            tools=tools if takes_tools else None,
        )  # fmt: skip

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer | None:
        """Build from `tokenizer.ggml.*` fields; None if the file has none. Raises ValueError for
        tokenizers kvharbor cannot rebuild."""
        if "tokenizer.ggml.tokens" not in meta:
            return None
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        if kind == "gpt2":
            backend = _byte_level_backend(meta, tokens)
        elif kind == "llama":
            tokens = _respelled(meta, tokens)
            backend = _sentencepiece_backend(meta, tokens)
        else:
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported (kvharbor reads byte-level BPE, 'gpt2', and "
                "SentencePiece BPE, 'llama'); load the Hugging Face folder, whose tokenizer.json works for every model"
            )
        types = meta.get("tokenizer.ggml.token_type", [])
        backend.add_tokens(
            [
                AddedToken(tokens[i], special=False, normalized=False)
                for i, t in enumerate(types)
                if t == _GGUF_USER_DEFINED
            ]
        )
        backend.add_special_tokens(
            [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _GGUF_CONTROL]
        )
        return cls(
            backend,
            chat_template=meta.get("tokenizer.chat_template"),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=gguf_eos_ids(meta),
            # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
            model_type=str(meta.get("general.architecture", "")),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path, eos_token_ids: Sequence[int], bos_token_id: int | None) -> Tokenizer | None:
        """Load tokenizer.json (+ tokenizer_config.json); None when the folder has no tokenizer."""
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            return None
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        template = config.get("chat_template")
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        # tokenizer.json's post-processor adds BOS itself where a model wants it; don't add twice.
        return cls(
            backend,
            chat_template=template,
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            add_bos=bool(config.get("add_bos_token", False)) and backend.post_processor is None,
            model_type=str(_read_json(path / "config.json").get("model_type", "")),
        )


def _byte_level_backend(meta: dict[str, Any], tokens: list[str]) -> HFTokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; known: {', '.join(sorted(_PRE_TOKENIZERS))}")
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence(_PRE_TOKENIZERS[pre]())
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(meta: dict[str, Any], tokens: list[str]) -> HFTokenizer:
    """SentencePiece BPE with byte fallback, as transformers' GGUF converters rebuild it (their
    output is what tests/test_gguf_tokenizers.py compares against). Gemma files differ twice: a
    token of only spaces is stored with real spaces, and merge priority follows the file's order,
    not the scores; and Gemma marks spaces with a normalizer where Llama 2 uses a Metaspace
    pre-tokenizer with a leading space (tokenizer.ggml.add_space_prefix)."""
    gemma = _is_gemma(meta)
    if gemma:
        priority = {t: -i for i, t in enumerate(tokens)}
    else:
        priority = dict(zip(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens), strict=True))
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = meta.get("tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in merges] if merges else _implied_merges(vocab, priority)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if unk is not None else "<unk>"
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=unk_token, byte_fallback=True)
    backend = HFTokenizer(bpe)
    pieces = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", _SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(_SPACE, prepend_scheme="first" if prefix else "never",
                                                         split=False)  # fmt: skip
        if prefix:
            pieces.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(pieces)
    return backend


def _is_gemma(meta: dict[str, Any]) -> bool:
    return str(meta.get("general.architecture", "")).startswith("gemma")


def _respelled(meta: dict[str, Any], tokens: list[str]) -> list[str]:
    """Gemma files store a token of only spaces with real spaces; its vocabulary spells them ▁."""
    if not _is_gemma(meta):
        return tokens
    return [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def _implied_merges(vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies (GGUF files carry none): every split of a
    token into two tokens, best token first, then the longer left piece."""
    found = []
    for token, score in priority.items():
        local = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        found.extend((score, left, right) for left, right in local)
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in found]


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _check_message(i: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"messages[{i}] must be an object with a string 'role'")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages[{i}].content parts must be {{'type': 'text', 'text': ...}}")
            parts.append(part["text"])
        content = "".join(parts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
    return {**message, "content": content}


def _compile_template(source: str) -> Any:
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template refused the messages: {message}")

    def tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ValueError(f"the model's chat template does not compile: {exc}") from None
