"""Our GGUF-built tokenizer against transformers' tokenizer from the same GGUF file.

Encode, decode and the chat template must agree on text that stresses byte-level BPE:
unicode, whitespace runs, code, special tokens written in the text.
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # needs the SmolLM2 GGUF

TEXTS = [
    "Hello world",
    "",
    " ",
    "  leading,   inner   and trailing spaces   ",
    "tabs\tand\nnewlines\n\n\r\n  indented\n",
    "naïve café — 日本語のテキスト, Ελληνικά, русский 🤖👍🏽 a\u0301",
    "\u00a0no-break\u2003em space ＡＢＣ ﬁ",
    "def f(x):\n    return x**2  # square\n\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }  // C",
    "digits 1234567 and 3.14159, 2024-12-01, 0x1F",
    "I'm sure it's what they'd've DONE, y'all",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "x<|endoftext|>y <repo_name>z<|im_start|><|im_start|>",
    "<|im_end no closing bracket, <|im_start |> with a space",
    "😀" * 5 + "\U0001F9D1\u200D\U0001F4BB",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Bonjour, ça va ?"}],
]


@pytest.fixture(scope="module")
def ours(smollm2):
    return smollm2[1]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_encode_matches_transformers(ours, hf_smollm2_tokenizer, text):
    hf = hf_smollm2_tokenizer
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(ours, hf_smollm2_tokenizer, text, skip):
    ids = hf_smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=skip) == hf_smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
    if not skip:
        assert ours.decode(ids, skip_special_tokens=False) == text  # byte-level BPE loses nothing


def test_decode_of_a_partial_character(ours, hf_smollm2_tokenizer):
    ids = ours.encode("🤖")
    assert len(ids) > 1  # a 4-byte emoji is several byte tokens
    assert ours.decode(ids[:1]) == hf_smollm2_tokenizer.decode(ids[:1])  # replacement char, not a crash


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(ours, hf_smollm2_tokenizer, messages, gen):
    want = hf_smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
    got = ours.apply_chat_template(messages, add_generation_prompt=gen)
    assert got == want
    assert ours.encode(got) == hf_smollm2_tokenizer.encode(want, add_special_tokens=False)


def test_special_ids(ours, hf_smollm2_tokenizer):
    hf = hf_smollm2_tokenizer
    assert ours.bos_token_id == hf.bos_token_id
    assert hf.eos_token_id in ours.eos_token_ids
    assert hf.convert_tokens_to_ids("<|im_end|>") in ours.eos_token_ids  # a chat turn ends there
    assert ours.vocab_size == len(hf)
    for i in hf.all_special_ids:  # special: dropped on decode, kept when asked
        assert ours.decode([i]) == "" and ours.decode([i], skip_special_tokens=False) == hf.convert_ids_to_tokens(i)


def test_non_ascii_numerals_split_like_llama_cpp(ours, hf_smollm2_tokenizer):
    """A known difference: GGUF says pre-tokenizer 'smollm' (each \\p{N} character alone, then GPT-2's
    regex, as llama.cpp and SmolLM2's own tokenizer.json do); transformers' GGUF converter ignores it.
    For ASCII digits both agree (the vocabulary has no multi-digit tokens); for other numerals we follow
    the model's own tokenizer, i.e. transformers' tokenizer with that pre-tokenizer put back."""
    from tokenizers import Tokenizer, pre_tokenizers

    text = "١٢٣ ½ Ⅻ 42"
    fixed = Tokenizer.from_str(hf_smollm2_tokenizer.backend_tokenizer.to_str())  # a copy
    fixed.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    assert ours.encode(text) == fixed.encode(text, add_special_tokens=False).ids
