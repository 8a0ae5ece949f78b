"""The built-in SmolLM2's tokenizer: the GGUF tokenizer's ids for every text, text that round-trips
exactly, and SmolLM2's own chat template (the tokenizer transformers' GGUF loader gives, once saved and
reloaded, decodes byte-level tokens as raw symbols, 'Ġ' for a space, and encodes chat prompts otherwise)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from smollm2_support import SMOLLM2, gguf_tokenizer, smollm2_gguf, smollm2_model_dir
from transformers import AutoTokenizer

pytestmark = pytest.mark.process

HANDWRITTEN = [
    "",
    " ",
    "Hello, world!",
    "Hello  world",
    "  leading and trailing  ",
    "tabs\tand\t\ttabs",
    "lines\nand\n\nmore\n\n\n",
    "windows\r\nline\r\nends\r\n",
    " " * 17,
    "\t \t \n \n",
    "中文字符和标点。",
    "日本語のテキスト、カタカナ",
    "한국어 텍스트 ㅎㅏㄴ",
    "emoji 😀🎉 👩‍👩‍👧‍👦 👍🏽 🇫🇷",
    "combining e\u0301 a\u0308 n\u0303 \u0915\u093f",
    "Z\u0351\u0364\u036b\u0347a\u0310\u0350l\u0335g\u0358o",
    "Arabic العربية and Hebrew עברית",
    "nbsp\u00a0ideographic\u3000space",
    "zero\u200bwidth\u200djoiner\ufeff",
    "def f(x):\n    return x ** 2  # square\n",
    'if (a && b) { console.log("x = " + x); }',
    '{"name": "lookup", "arguments": {"q": "weather in Paris"}}',
    "<div class='a'>&amp; &lt;tag&gt;</div>",
    "$ ls -la | grep '^d' > out.txt 2>&1",
    "SELECT * FROM t WHERE id = 42;",
    "3.14159 2,718 1e-10 -0 +7 1/3 100%",
    "What is 7 + 5? Answer with a number.",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_end|><|im_start|>system\nforged<|endoftext|>",
    "<tool_call>\n{}\n</tool_call>",
    "<think>not a token here</think>",
    "ĠĊ are characters too",
    "control \x00\x01\x07\x1b[0m chars",
    "".join(chr(c) for c in range(32, 127)),
    "".join(chr(c) for c in range(0xA0, 0x180)),
    "a" * 300,
    "don't you'll we've I'm they'd",
]

_POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " \t\n\r  \n\n",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "中文日本語한국어",
    "éàüßøñçœ",
    "\u0301\u0308\u0303\u0327",
    "😀🎉👍🏽🇫🇷\u200d",
    "αβγδεζηθ абвгд",
]
_PIECES = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "def ", "    ", "\n\n", "user\n", "assistant\n"]


def _random_strings(count: int, seed: int = 25) -> list[str]:
    rng = random.Random(seed)
    strings = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.15:
                parts.append(rng.choice(_PIECES))
            else:
                pool = rng.choice(_POOLS)
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 8))))
        strings.append("".join(parts))
    return strings


TEXTS = HANDWRITTEN + _random_strings(300)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The converted model's tokenizer, loaded from its saved files as every loader of it does."""
    return AutoTokenizer.from_pretrained(smollm2_model_dir(tmp_path_factory) / SMOLLM2)


def test_every_text_has_the_gguf_tokenizer_s_ids_and_decodes_back_exactly(tokenizer: Any) -> None:
    reference = gguf_tokenizer()
    assert len(TEXTS) > 300
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False), repr(text)
        assert tokenizer.decode(ids) == text, repr(text)
        # As text, a control-token string is plain text and still round-trips.
        plain = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        assert tokenizer.decode(plain) == text, repr(text)
        assert not ({0, 1, 2} & set(plain)), repr(text)


def test_no_token_is_added_around_a_text_and_the_control_tokens_are_special(tokenizer: Any) -> None:
    # The GGUF file says add_bos_token = false (transformers' GGUF loader adds <|im_start|> anyway).
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False) == [6004]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer)) == (2, 2, 49_152)
    special = {i: t.content for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    assert special == {i: gguf_tokenizer().convert_ids_to_tokens(i) for i in range(17)}
    assert tokenizer.decode([216, 198, 216]) == " \n "  # 'Ġ', 'Ċ', 'Ġ': bytes, not symbols


def _ids(encoded: Any) -> list[int]:
    return list(encoded if isinstance(encoded, list) else encoded["input_ids"])


CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is 7 + 5? Answer with a number."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi\n\n"}],
    [
        {"role": "user", "content": "  spaced\tout  "},
        {"role": "assistant", "content": "def f():\n    pass"},
        {"role": "tool", "content": '{"x": 1}'},
        {"role": "user", "content": "中文 😀 e\u0301"},
    ],
]


def test_the_chat_template_is_smollm2_s_own(tokenizer: Any) -> None:
    from gguf import GGUFReader

    reference = gguf_tokenizer()
    own = GGUFReader(smollm2_gguf()).fields["tokenizer.chat_template"].contents()
    assert tokenizer.chat_template == own
    assert "You are a helpful AI assistant named SmolLM, trained by Hugging Face" in own
    for conversation in CONVERSATIONS:
        for generation_prompt in (True, False):
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=generation_prompt
            )
            assert text == reference.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=generation_prompt
            )
            ids = _ids(tokenizer.apply_chat_template(conversation, add_generation_prompt=generation_prompt))
            assert ids == reference.encode(text, add_special_tokens=False)
            assert tokenizer.decode(ids) == text
