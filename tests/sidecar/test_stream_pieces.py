"""How a stream shares a reply's text among its tokens (sample_output.split_by_tokens): each token
carries its text as soon as its bytes complete a character (issue 40 item 8: a token holding part of
a character put all the remaining text into one chunk), and the pieces always join to the text."""

from __future__ import annotations

import pytest

from tinkerrpc import Message, Sample
from tinkerrpc_server.sidecar.sample_output import split_by_tokens

pytestmark = pytest.mark.unit


def sample(token_bytes: list[bytes], content: str) -> Sample:
    return Sample(
        tokens=tuple(range(len(token_bytes))),
        logprobs=(-1.0,) * len(token_bytes),
        text=content,
        message=Message.assistant(content),
        stop_reason="length",
        policy_version=0,
        prompt_token_ids=(1,),
        # What the server sends: a token with part of a character has U+FFFD in its text.
        token_texts=tuple(b.decode(errors="replace") for b in token_bytes),
        token_bytes=tuple(token_bytes),
    )


def test_a_character_split_over_tokens_goes_with_the_token_that_completes_it() -> None:
    parts = [b"caf", b"\xc3", b"\xa9", b" ", b"\xf0\x9f", b"\x8e\x89", b" done"]
    text = b"".join(parts).decode()
    assert split_by_tokens(text, sample(parts, text)) == ["caf", "", "é", " ", "", "🎉", " done"]


def test_a_reply_cut_inside_a_character_ends_with_its_replacement() -> None:
    parts = [b"ok", b"\xe6\x97"]
    text = b"".join(parts).decode(errors="replace")
    assert split_by_tokens(text, sample(parts, text)) == ["ok", "\ufffd"]


def test_content_the_parse_reframed_is_placed_token_by_token() -> None:
    # A think block with its content, then text after it: the parse strips the newlines framing the
    # thinking, so the content is not one stretch of the tokens' text.
    parts = [b"<think>", b"\n", b"hm", b"\n", b"</think>", b"\n\n", b"Hel", b"lo", b"<|im_end|>"]
    content = "<think>hm</think>Hello"
    assert split_by_tokens(content, sample(parts, content)) == [
        "<think>",
        "",
        "hm",
        "",
        "</think>",
        "",
        "Hel",
        "lo",
        "",
    ]


def test_content_found_nowhere_goes_on_the_first_token() -> None:
    parts = [b"a", b"b"]
    assert split_by_tokens("zz", sample(parts, "zz")) == ["zz", ""]
