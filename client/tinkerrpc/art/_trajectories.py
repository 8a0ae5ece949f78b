"""ART trajectories as tinkerrpc trajectories, token-exact.

ART keeps a rollout in one of two forms, both taken here (as live objects or their `model_dump()`):

- `messages_and_choices` (every ART version): OpenAI messages and the `Choice`s the rollout got from the
  sidecar. Each Choice is a sampled turn: the sidecar stamps it with the sampled `token_ids`, the
  `policy_version` and the `sample_key` under which the server keeps the sampler's logprobs, and (when
  the request asked for them) those logprobs. ART 0.5.20+'s client also copies the response's
  `prompt_token_ids` onto the Choice: the turn then trains on exactly that prompt; a Choice without
  them (ART 0.5.18) leaves the prompt for the server to re-render from the conversation before it,
  exactly as the sidecar rendered it.
- `exchanges` (ART 0.5.20+ captures every request a rollout makes inside `with trajectory:`): each
  chat completion, legacy completion or Responses exchange of this model is a sampled turn per choice
  with the response's own `prompt_token_ids`, so multi-turn and tool-call rollouts train on exactly the
  tokens the sampler saw and drew. Exchanges with other models (a judge, a user simulator) are not
  trained, as ART's own backends train only the model they serve.

A turn without logprobs trains on the server's copy named by its key; the server scores it only where
that copy is gone or does not match.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import art

from tinkerrpc._messages import Message, SampledTurn, Tool
from tinkerrpc._openai import messages_from_response_input, turn_from_chat_completion, turn_from_response
from tinkerrpc._types import Trajectory, TrajectoryGroup

# What `backend.train()` takes per group: ART's TrajectoryGroup, or its model_dump() (a rollout that
# crossed a process or a file).
TrajectoryGroupLike = art.TrajectoryGroup | Mapping[str, Any]
# ART 0.5.20+'s captured exchanges of the kinds the sidecar serves, and the kind it does not.
EXCHANGE_KINDS = ("chat_completions", "completions", "responses")
UNSERVED_EXCHANGE_KIND = "messages"


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


def _base(raw: Mapping[str, Any], tools: Iterable[Any]) -> Trajectory:
    return Trajectory(
        reward=float(raw.get("reward", 0.0)),
        tools=[Tool.from_openai(t) for t in tools],
        metrics={k: float(v) for k, v in (raw.get("metrics") or {}).items()},
        metadata={k: str(v) for k, v in (raw.get("metadata") or {}).items()},
    )


def _from_messages_and_choices(raw: Mapping[str, Any], where: str) -> Trajectory:
    if raw.get("additional_histories"):
        raise ValueError(f"{where} has additional_histories: train each conversation as its own trajectory")
    converted = _base(raw, raw.get("tools") or ())
    for position, item in enumerate(raw.get("messages_and_choices") or ()):
        item = _as_dict(item)
        if "message" not in item:  # a message the rollout wrote, not a Choice the model sampled
            converted.messages.append(_message(item))
            continue
        choice_where = f"{where}.messages_and_choices[{position}]"
        token_ids, version = item.get("token_ids"), item.get("policy_version")
        if token_ids is None or version is None:
            raise ValueError(
                f"{choice_where} is a Choice without token_ids/policy_version: sample through the "
                "tinkerrpc sidecar (model.openai_client() after model.register(backend))"
            )
        converted.messages.append(_message({"role": "assistant", **item["message"]}))
        entries = (item.get("logprobs") or {}).get("content")
        if entries is not None and len(entries) != len(token_ids):
            raise ValueError(f"{choice_where} has {len(entries)} logprobs for {len(token_ids)} token_ids")
        logprobs = tuple(float(e["logprob"]) for e in entries) if entries is not None else ()
        # ART 0.5.20+ copies the response's prompt ids onto the Choice; without them the server re-renders.
        prompt_ids = tuple(item.get("prompt_token_ids") or ())
        sample_key = str(item.get("sample_key") or "")
        converted.turns.append(SampledTurn(prompt_ids, tuple(token_ids), logprobs, int(version), sample_key))
    return converted


def _is_model(requested: Any, model_name: str) -> bool:
    """Whether an exchange's `model` is this model: `name` or `name@N` (the sidecar's ids)."""
    return isinstance(requested, str) and requested.partition("@")[0] == model_name


def _completion_turns(response: Mapping[str, Any], where: str) -> list[SampledTurn]:
    """The sampled turns of a sidecar legacy completion: one per choice, with the response's prompt ids."""
    turns = []
    for index, choice in enumerate(response.get("choices") or ()):
        token_ids, prompt_ids = choice.get("token_ids"), response.get("prompt_token_ids")
        version = choice.get("policy_version", response.get("policy_version"))
        if token_ids is None or prompt_ids is None or version is None:
            raise ValueError(
                f"{where}.response.choices[{index}] has no token_ids, prompt_token_ids or policy_version: "
                "the completion must come from the tinkerrpc sidecar"
            )
        logprobs = tuple(float(p) for p in (choice.get("logprobs") or {}).get("token_logprobs") or ())
        if logprobs and len(logprobs) != len(token_ids):
            raise ValueError(
                f"{where}.response.choices[{index}] has {len(logprobs)} logprobs for {len(token_ids)} token_ids"
            )
        key = str(choice.get("sample_key") or "")
        turns.append(SampledTurn(tuple(prompt_ids), tuple(token_ids), logprobs, int(version), key))
    return turns


def _from_exchanges(raw: Mapping[str, Any], model_name: str, where: str) -> Trajectory:
    exchanges = _as_dict(raw["exchanges"])
    if exchanges.get(UNSERVED_EXCHANGE_KIND) and any(
        _is_model(_as_dict(e).get("request", {}).get("model"), model_name)
        for e in exchanges[UNSERVED_EXCHANGE_KIND]
    ):
        raise ValueError(
            f"{where} has Anthropic Messages exchanges: the tinkerrpc sidecar serves no /v1/messages"
        )
    # Every exchange of this model, in the order they started.
    ours = sorted(
        (
            (str(exchange.get("start_time", "")), kind, position, exchange)
            for kind in EXCHANGE_KINDS
            for position, exchange in enumerate(map(_as_dict, exchanges.get(kind) or ()))
            if _is_model(exchange.get("request", {}).get("model"), model_name)
        ),
        key=lambda entry: entry[0],
    )
    if not ours:
        models = sorted(
            {
                str(_as_dict(e).get("request", {}).get("model"))
                for k in EXCHANGE_KINDS
                for e in exchanges.get(k) or ()
            }
        )
        raise ValueError(f"{where} has no exchanges with model {model_name!r} (its exchanges name {models})")
    converted = _base(raw, ())
    for _, kind, position, exchange in ours:
        request, response = _as_dict(exchange["request"]), _as_dict(exchange["response"])
        exchange_where = f"{where}.exchanges.{kind}[{position}]"
        if kind == "completions":
            converted.turns.extend(_completion_turns(response, exchange_where))
            continue
        if kind == "responses":
            message, turn = turn_from_response(response)
            conversation = messages_from_response_input(request["input"], request.get("instructions"))
            tools: Sequence[Any] = [t for t in request.get("tools") or () if t.get("type") == "function"]
            replies, turns = [message], [turn]
        else:
            pairs = [
                turn_from_chat_completion(response, i) for i in range(len(response.get("choices") or ()))
            ]
            conversation = [_message(_as_dict(m)) for m in request.get("messages") or ()]
            tools = request.get("tools") or ()
            replies, turns = [m for m, _ in pairs], [t for _, t in pairs]
        converted.turns.extend(turns)
        # The conversation is the last exchange's with its first reply (every turn brings its own prompt).
        converted.messages = [*conversation, replies[0]]
        converted.tools = [Tool.from_openai(t) for t in tools]
    return converted


def convert_trajectory(trajectory: Any, model_name: str, where: str) -> Trajectory:
    """The tinkerrpc Trajectory of an ART one (or its model_dump()): one turn per Choice or per choice of
    an exchange with `model_name`, with its messages, reward and metrics."""
    raw = _as_dict(trajectory)
    exchanges = raw.get("exchanges")
    if exchanges and any(_as_dict(exchanges).get(kind) for kind in (*EXCHANGE_KINDS, UNSERVED_EXCHANGE_KIND)):
        return _from_exchanges(raw, model_name, where)
    return _from_messages_and_choices(raw, where)


def convert_groups(groups: Iterable[TrajectoryGroupLike], model_name: str) -> list[TrajectoryGroup]:
    """Every ART group with trajectories, converted; groups left empty by failed rollouts are skipped."""
    result = []
    for g, group in enumerate(groups):
        members = group.get("trajectories") or () if isinstance(group, Mapping) else group.trajectories
        trajectories = [
            convert_trajectory(t, model_name, f"groups[{g}].trajectories[{i}]") for i, t in enumerate(members)
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
