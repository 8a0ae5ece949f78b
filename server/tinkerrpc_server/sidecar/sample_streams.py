"""What every endpoint's stream shares: the SampleStream call opened before the response starts (so a
refused request is an ordinary OpenAI error, not a broken stream), each choice's content as it may be
sent, and a delta seen as a `Sample` of its own tokens (for the logprob entries).

A choice's content is sent as its tokens arrive, up to where the reply could still change: the server
already holds back text that could be the start of a stop string, and a chat reply is also held from
its first tag (`markup_start`: where a think block or tool-call markup opens, which the renderer's parse
turns into something else). The last delta of a choice (the one that ends it) is not sent as it is:
once the whole sample is there, the rest of the final content (stop strings cut as the request asks,
markup parsed) is sent, so the pieces always join to the content the plain response would have.
"""

from __future__ import annotations

import codecs
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from tinkerrpc import Sample, SampleChunk, SampleDelta, SamplingOptions
from tinkerrpc_server.sidecar.models import ModelRef
from tinkerrpc_server.sidecar.sampling_args import Prompt
from tinkerrpc_server.stream_text import held_back_from

log = logging.getLogger("tinkerrpc.sidecar")

# A tag's name after its `<`, as the renderers' markup writes them (`<think>`, `<tool_call>`, `<|python_tag|>`).
_TAG_NAME = re.compile(r"[A-Za-z_|/][\w|/.-]*")


def markup_start(text: str) -> int | None:
    """Where the first tag that is, or may still become, markup opens in `text` (None: none does): a `<`
    at the end, or followed by a tag name that is at the end or closed by `>`. `a < b` or `<3` is text."""
    for opening in re.finditer("<", text):
        rest = text[opening.end() :]
        name = _TAG_NAME.match(rest)
        if not rest or (name is not None and rest[name.end() :][:1] in ("", ">")):
            return opening.start()
    return None


@dataclass
class OpenedStream:
    """A SampleStream whose head has arrived: the prompt and the version sampled, then the rest."""

    head: SampleChunk
    chunks: AsyncIterator[SampleChunk]  # the deltas, then the chunk with the samples
    close: Callable[[], Awaitable[None]]

    @property
    def policy_version(self) -> int:
        assert self.head.policy_version is not None
        return self.head.policy_version


# The app's one SampleStream call, as the routes reach it: (route, model, prompt, arguments); it maps a
# refusal to an OpenAI error, and counts the route's tokens once the samples are there.
StreamSampler = Callable[[str, ModelRef, Prompt, SamplingOptions], Awaitable[OpenedStream]]


class ChoiceContent:
    """One choice's content as it may be sent: `take` what a delta adds, `finish` with the final content.

    A legacy completion's content is the sample's text, which the deltas' `text` already is (the server
    held back what a stop string could still cut). A chat reply's content is what the renderer parses
    out of its tokens, special tokens' text included: it is rebuilt here from the tokens' bytes, held
    back before a possible stop string and from its first tag (`chat=True`)."""

    def __init__(self, chat: bool, stops: Sequence[str] = (), held: bool = False) -> None:
        """`held`: nothing is sent before the end (the text that must come first is not known yet)."""
        self._chat = chat
        self._stops = stops
        self._bytes = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._raw = ""
        self.sent = ""
        self._held = held

    def take(self, delta: SampleDelta) -> str:
        """What may be sent now of the text `delta` adds (nothing of a choice's last delta)."""
        if delta.stop_reason is not None or self._held:
            return ""
        if not self._chat:
            self._raw += delta.text
            return self._advance(self._raw)
        # Token texts stand in for a server that sends no bytes.
        exact = delta.token_bytes if delta.token_bytes else tuple(t.encode() for t in delta.token_texts)
        self._raw += "".join(self._bytes.decode(piece) for piece in exact)
        safe = self._raw[: held_back_from(self._raw, self._stops)]
        markup = markup_start(safe)
        if markup is not None:
            # A tag still being written may turn out to be text; one closed is markup: held to the end.
            self._held = ">" in safe[markup:]
            safe = safe[:markup]
        return self._advance(safe)

    def _advance(self, safe: str) -> str:
        new = safe[len(self.sent) :] if safe.startswith(self.sent) else ""
        self.sent += new
        return new

    def finish(self, content: str) -> str:
        """The rest of the final `content` after what was sent."""
        if not content.startswith(self.sent):
            log.warning(
                "a streamed reply's content changed after it was sent: %r, then %r", self.sent, content
            )
            return ""
        return content[len(self.sent) :]


def delta_sample(delta: SampleDelta, policy_version: int) -> Sample:
    """The delta's tokens as a Sample of their own: what the logprob entries of one chunk read."""
    return Sample(
        tokens=delta.tokens,
        logprobs=delta.logprobs,
        text=delta.text,
        message=None,
        stop_reason=delta.stop_reason,
        policy_version=policy_version,
        prompt_token_ids=(),
        top_logprobs=delta.top_logprobs,
        token_texts=delta.token_texts,
        token_bytes=delta.token_bytes,
    )


async def deltas_then_samples(opened: OpenedStream) -> AsyncIterator[SampleDelta | tuple[Sample, ...]]:
    """Each delta as it arrives, then every sample (the stream's last chunk)."""
    async for chunk in opened.chunks:
        for delta in chunk.deltas:
            yield delta
        if chunk.samples is not None:
            yield chunk.samples
            return
    raise RuntimeError("the sample stream ended without its samples")
