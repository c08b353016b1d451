"""Text <-> token ids and the chat template, on top of the ``tokenizers`` library.

Owns one ``Tokenizer`` class, built either from a ``tokenizer.json`` (Hugging Face folder) or
from the vocabulary and merges a GGUF header stores (byte-level BPE). It does not read GGUF
files itself (gguf_loader.py hands it plain lists) and knows nothing about the model.
"""
from __future__ import annotations

import functools
import json
import warnings
from datetime import datetime
from pathlib import Path
from typing import Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from .errors import CorruptModelError, ModelNotFoundError

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# End-of-turn markers of common chat formats: a chat model ends its reply with one of these,
# which is not always the single eos its config names (Llama 3 Instruct: eos <|end_of_text|>, turns end <|eot_id|>).
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """How text is cut into words before BPE, by llama.cpp's name for it (``tokenizer.ggml.pre``).

    The merges were learned on words cut this way, so a different cut gives different ids.
    """
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's word regex
    if pre in (None, "default", "gpt2", "gpt-2"):
        return gpt2
    if pre in ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"):
        # Every digit is a word of its own, then GPT-2's regex: "2024" -> "2", "0", "2", "4".
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}: using GPT-2's; ids may differ from the model's own tokenizer")
    return gpt2


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map: byte-level BPE spells every token in these 256 characters."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


@functools.lru_cache(maxsize=8)
def _compile_chat_template(template: str):
    """A Hugging Face chat template, compiled with the Jinja settings transformers uses."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # Templates come with downloaded models: render them sandboxed.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _render_chat_template(template: str, **context) -> str:
    return _compile_chat_template(template).render(**context)


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus what a chat model needs around it: special ids and the chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        name: str = "tokenizer",
    ) -> None:
        self.backend, self.chat_template, self.name = backend, chat_template, name
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token is not None else None
        eos = [backend.token_to_id(eos_token)] if eos_token is not None else []
        eos += list(extra_eos_token_ids)
        for marker in END_OF_TURN:
            # Only markers the chat template writes: a base model's <|endoftext|> in the vocab is not a stop.
            if chat_template and marker in chat_template and backend.token_to_id(marker) is not None:
                eos.append(backend.token_to_id(marker))
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(t for t in eos if t is not None))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) become their own ids."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, e.g. ``[{"role": "user", "content": "Hi"}]``, in the model's format."""
        if not self.chat_template:
            raise ValueError(
                f"{self.name} has no chat template (base model?): pass plain text to encode() instead"
            )
        return _render_chat_template(
            self.chat_template,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_ids})"

    # ----- builders -------------------------------------------------------------------------

    @classmethod
    def from_byte_level_bpe(
        cls,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int] | None = None,
        pre: str | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        chat_template: str | None = None,
        name: str = "gguf",
    ) -> "Tokenizer":
        """From GGUF's ``tokenizer.ggml.*`` lists: tokens (id order), merges ("a b"), token types, pre-tokenizer name."""
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {}
        for i, tok in enumerate(tokens):
            # A token written outside the byte alphabet (some converters store raw text) gets respelled.
            if not set(tok) <= alphabet:
                tok = "".join(spelling[b] for b in tok.encode("utf-8"))
            vocab.setdefault(tok, i)
        bpe = models.BPE(
            vocab=vocab,
            merges=[tuple(m.split(" ", 1)) for m in merges],
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
        backend = tokenizers.Tokenizer(bpe)
        backend.pre_tokenizer = _pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        types = list(token_types or [])
        # Control tokens (<|im_start|>) must match whole in text and be droppable on decode: special.
        # A "control" token outside the byte alphabet is a converter's mislabel; adding it would grow the vocab.
        special = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types)
            if ty == CONTROL and set(t) <= alphabet
        ]
        if special:
            backend.add_special_tokens(special)
        # User-defined tokens (<think>) also match whole, but are ordinary text on decode.
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types)
            if ty == USER_DEFINED and t in vocab
        ]
        if user:
            backend.add_tokens(user)
        token = lambda i: tokens[i] if i is not None and 0 <= i < len(tokens) else None  # noqa: E731
        return cls(backend, chat_template, token(bos_token_id), token(eos_token_id), name=name)

    @classmethod
    def from_hf_folder(cls, folder: str | Path, config_eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
        """From ``tokenizer.json`` + ``tokenizer_config.json`` (and ``chat_template.jinja`` if there)."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelNotFoundError(
                f"{folder} has no tokenizer.json: minipaged reads only fast tokenizers. "
                "Save one with transformers: AutoTokenizer.from_pretrained(...).save_pretrained(folder)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:
            raise CorruptModelError(f"{path} could not be read as a tokenizer (corrupt or truncated?): {e}") from e
        cfg = {}
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise CorruptModelError(f"{cfg_path} is not valid JSON (corrupt or truncated?): {e}") from e
        template = cfg.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one is the chat one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        jinja_path = folder / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text(encoding="utf-8")

        def content(tok):
            return tok.get("content") if isinstance(tok, dict) else tok

        return cls(
            backend,
            template,
            content(cfg.get("bos_token")),
            content(cfg.get("eos_token")),
            extra_eos_token_ids=config_eos_token_ids,
            name=folder.name,
        )
