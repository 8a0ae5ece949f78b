"""ART trajectories as tinkerrpc trajectories, token-exact.

An ART `Trajectory` holds OpenAI messages and the `Choice`s its rollout got from the sidecar. Each
Choice is a sampled turn: the sidecar stamps it with the sampled `token_ids`, the `policy_version` and
the `sample_key` under which the server keeps the sampler's logprobs, and (when the request asked for
logprobs) those logprobs themselves. The turn's prompt is left for the server to re-render from the
conversation before it, exactly as the sidecar rendered it. A Choice without logprobs trains on the
server's copy named by its key; the server scores it only where that copy is gone or does not match.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import art

from tinkerrpc._messages import Message, SampledTurn, Tool
from tinkerrpc._types import Trajectory, TrajectoryGroup


def _as_dict(item: Any) -> Mapping[str, Any]:
    if isinstance(item, Mapping):
        return item
    dumped: Mapping[str, Any] = item.model_dump()
    return dumped


def _text(content: Any) -> str:
    """A message's content as text; OpenAI content parts are joined."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if isinstance(part, Mapping))


def _message(raw: Mapping[str, Any]) -> Message:
    return Message.from_openai({**raw, "content": _text(raw.get("content"))})


def convert_trajectory(trajectory: art.Trajectory, where: str) -> Trajectory:
    """The tinkerrpc Trajectory of an ART one: its messages, one turn per Choice, its reward and metrics."""
    if trajectory.additional_histories:
        raise ValueError(f"{where} has additional_histories: train each conversation as its own trajectory")
    converted = Trajectory(
        reward=float(trajectory.reward),
        tools=[Tool.from_openai(t) for t in trajectory.tools or ()],
        metrics={k: float(v) for k, v in trajectory.metrics.items()},
        metadata={k: str(v) for k, v in trajectory.metadata.items()},
    )
    for position, item in enumerate(trajectory.messages_and_choices):
        raw = _as_dict(item)
        if "message" not in raw:  # a message the rollout wrote, not a Choice the model sampled
            converted.messages.append(_message(raw))
            continue
        choice_where = f"{where}.messages_and_choices[{position}]"
        token_ids, version = raw.get("token_ids"), raw.get("policy_version")
        if token_ids is None or version is None:
            raise ValueError(
                f"{choice_where} is a Choice without token_ids/policy_version: sample through the "
                "tinkerrpc sidecar (model.openai_client() after model.register(backend))"
            )
        converted.messages.append(_message({"role": "assistant", **raw["message"]}))
        entries = (raw.get("logprobs") or {}).get("content")
        if entries is not None and len(entries) != len(token_ids):
            raise ValueError(f"{choice_where} has {len(entries)} logprobs for {len(token_ids)} token_ids")
        logprobs = tuple(float(e["logprob"]) for e in entries) if entries is not None else ()
        # No prompt ids: the server re-renders the conversation before this turn.
        sample_key = str(raw.get("sample_key") or "")
        converted.turns.append(SampledTurn((), tuple(token_ids), logprobs, int(version), sample_key))
    return converted


def convert_groups(groups: Iterable[art.TrajectoryGroup]) -> list[TrajectoryGroup]:
    """Every ART group with trajectories, converted; groups left empty by failed rollouts are skipped."""
    result = []
    for g, group in enumerate(groups):
        trajectories = [
            convert_trajectory(t, f"groups[{g}].trajectories[{i}]") for i, t in enumerate(group.trajectories)
        ]
        if trajectories:
            result.append(TrajectoryGroup(trajectories))
    return result


def sft_conversation(trajectory: art.Trajectory) -> tuple[tuple[Message, ...], tuple[Tool, ...]]:
    """An ART SFT trajectory as a conversation to imitate (its Choices become assistant messages)."""
    messages = tuple(
        _message({"role": "assistant", **raw["message"]}) if "message" in raw else _message(raw)
        for raw in map(_as_dict, trajectory.messages_and_choices)
    )
    return messages, tuple(Tool.from_openai(t) for t in trajectory.tools or ())
