"""Every request check, before anything touches the backend: a malformed field becomes a BadRequest
field violation naming it (e.g. `groups[0].trajectories[1].turns[0].completion_logprobs`); a request over
this server's size limits is RESOURCE_EXHAUSTED naming the flag; an expected version that is not the
model's is FAILED_PRECONDITION."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from tinkerrpc.contract.limits import (
    MAX_ABS_REWARD,
    MAX_ABS_TOKEN_ADVANTAGE,
    MAX_HISTORY_PAGE_SIZE,
    MAX_IDEMPOTENCY_KEY_BYTES,
    MAX_LORA_RANK,
    MAX_METRIC_NAME_BYTES,
    MAX_NAME_CHARS,
    MAX_SAMPLE_KEY_CHARS,
    MAX_STOP_STRING_BYTES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TEXT_BYTES_PER_TOKEN,
    MAX_TOP_LOGPROBS,
    MAX_TRAIN_METRIC_NAMES,
    MAX_TRAJECTORY_METRICS,
    MIN_LOGPROB,
    MIN_TEMPERATURE,
)
from tinkerrpc.v1 import trainer_service_pb2, types_pb2
from tinkerrpc_server.bounded_json import BoundedJsonError, parse_json_object
from tinkerrpc_server.service import errors
from tinkerrpc_server.service.errors import Violations
from tinkerrpc_server.service.limits import Limits, flag_of
from tinkerrpc_server.service.minibatches import check_minibatches
from tinkerrpc_server.service.rendering import ROLE_NAMES
from tinkerrpc_server.service.store import KIND_SAMPLER, KIND_STATE, ModelRow
from tinkerrpc_server.service.train_options import check_adam, check_advantages, check_loss, check_train_terms

NAME_PATTERN = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_NAME_CHARS - 1}}}")
NAME_RULE = f"1-{MAX_NAME_CHARS} characters of [A-Za-z0-9._-], starting with a letter or digit"
# The LoraConfig flags of the modules an adapter trains (unset means true).
LORA_MODULE_FLAGS: tuple[Literal["train_mlp", "train_attn", "train_unembed"], ...] = (
    "train_mlp",
    "train_attn",
    "train_unembed",
)


def _check_name(violations: Violations, field: str, name: str) -> None:
    if not NAME_PATTERN.fullmatch(name):
        violations.add(field, f"{errors.shown(name)}: must be {NAME_RULE}")


def _finite(value: float) -> bool:
    return math.isfinite(value)


def check_train_request(
    request: trainer_service_pb2.TrainRequest, current_version: int, vocab_size: int, context_length: int
) -> None:
    """Raises INVALID_ARGUMENT with every violation found; text over the context's byte bound is refused
    here, token lengths against the context when datums are built (still before anything runs)."""
    v = Violations()
    if request.groups and request.examples:
        v.add("groups", "give either groups (RL) or examples (supervised), not both")
    if not request.groups and not request.examples:
        v.add("groups", "empty batch: give trajectory groups (RL) or supervised examples")
    check_loss(v, request)
    check_advantages(v, request)
    check_train_terms(v, request)
    check_adam(v, request.adam)
    check_minibatches(v, request)
    if request.HasField("max_staleness") and request.max_staleness < 0:
        v.add("max_staleness", "must be >= 0")
    if request.strict_staleness and not request.HasField("max_staleness"):
        v.add("strict_staleness", "needs max_staleness")
    if request.HasField("expected_policy_version") and request.expected_policy_version < 0:
        v.add("expected_policy_version", "must be >= 0")
    key_bytes = len(request.idempotency_key.encode())
    if key_bytes > MAX_IDEMPOTENCY_KEY_BYTES:
        v.add("idempotency_key", f"{key_bytes} bytes: at most {MAX_IDEMPOTENCY_KEY_BYTES}")
    metric_names: set[str] = set()
    for g, group in enumerate(request.groups):
        if not group.trajectories:
            v.add(f"groups[{g}].trajectories", "a group needs at least one trajectory")
        for t, trajectory in enumerate(group.trajectories):
            field = f"groups[{g}].trajectories[{t}]"
            _check_trajectory(v, field, trajectory, current_version, vocab_size)
            metric_names.update(trajectory.metrics)
            _check_text_size(v, f"{field}.messages", trajectory.messages, trajectory.tools, context_length)
    if len(metric_names) > MAX_TRAIN_METRIC_NAMES:
        v.add(
            "groups",
            f"{len(metric_names)} distinct trajectory metric names: at most {MAX_TRAIN_METRIC_NAMES} per Train",
        )
    for e, example in enumerate(request.examples):
        field = f"examples[{e}]"
        _check_text_size(v, f"{field}.messages", example.messages, example.tools, context_length)
        _check_messages(v, list(example.messages), f"{field}.messages")
        _check_tools(v, list(example.tools), f"{field}.tools")
        if not any(m.role == types_pb2.ROLE_ASSISTANT for m in example.messages):
            v.add(f"{field}.messages", "a supervised example needs at least one assistant message")
        if example.train_on not in types_pb2.TrainOn.values():
            v.add(f"{field}.train_on", f"unknown value {example.train_on}")
    v.raise_if_any()


def _check_tokens(v: Violations, field: str, tokens: Sequence[int], vocab_size: int) -> None:
    # min and max run in C; the scan for the first bad id runs only when there is one.
    if not tokens or (min(tokens) >= 0 and max(tokens) < vocab_size):
        return
    bad = next(i for i, token in enumerate(tokens) if not 0 <= token < vocab_size)
    v.add(field, f"token id {tokens[bad]} at index {bad} is outside the vocabulary [0, {vocab_size})")


def _first_outside(values: Sequence[float], low: float, high: float) -> float | None:
    """The first value that is not a finite number in [low, high], or None. A finite sum (no NaN or
    infinity among them) and the min and max, all in C, clear the common case without a Python loop."""
    if not values or (math.isfinite(sum(values)) and low <= min(values) and max(values) <= high):
        return None
    return next((x for x in values if not (_finite(x) and low <= x <= high)), None)


def _check_trajectory(
    v: Violations, field: str, trajectory: types_pb2.Trajectory, current_version: int, vocab_size: int
) -> None:
    if not (_finite(trajectory.reward) and abs(trajectory.reward) <= MAX_ABS_REWARD):
        v.add(
            f"{field}.reward",
            f"must be a finite number in [-{MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}], got {trajectory.reward}",
        )
    _check_metrics(v, f"{field}.metrics", trajectory.metrics)
    _check_messages(v, list(trajectory.messages), f"{field}.messages")
    _check_tools(v, list(trajectory.tools), f"{field}.tools")
    if not trajectory.turns:
        v.add(f"{field}.turns", "no sampled turn: RL needs the token ids and logprobs the sampler returned")
    assistant_messages = sum(1 for m in trajectory.messages if m.role == types_pb2.ROLE_ASSISTANT)
    for k, turn in enumerate(trajectory.turns):
        turn_field = f"{field}.turns[{k}]"
        if not turn.completion_token_ids:
            v.add(
                f"{turn_field}.completion_token_ids", "empty: a sampled turn needs the completion token ids"
            )
        if len(turn.sample_key) > MAX_SAMPLE_KEY_CHARS:
            v.add(
                f"{turn_field}.sample_key",
                f"{len(turn.sample_key)} characters, at most {MAX_SAMPLE_KEY_CHARS}",
            )
        # No logprobs: taken from the sample cache under a valid sample_key, else scored at Train.
        if turn.completion_logprobs and len(turn.completion_logprobs) != len(turn.completion_token_ids):
            v.add(
                f"{turn_field}.completion_logprobs",
                f"{len(turn.completion_logprobs)} logprobs for {len(turn.completion_token_ids)} completion tokens",
            )
        else:
            bad_logprob = _first_outside(list(turn.completion_logprobs), MIN_LOGPROB, 0.0)
            if bad_logprob is not None:
                v.add(
                    f"{turn_field}.completion_logprobs",
                    f"must be finite numbers in [{MIN_LOGPROB:g}, 0] (log-probabilities a sampler returned), "
                    f"got {bad_logprob}",
                )
        if turn.advantages and len(turn.advantages) != len(turn.completion_token_ids):
            v.add(
                f"{turn_field}.advantages",
                f"{len(turn.advantages)} advantages for {len(turn.completion_token_ids)} completion tokens",
            )
        elif (
            _first_outside(list(turn.advantages), -MAX_ABS_TOKEN_ADVANTAGE, MAX_ABS_TOKEN_ADVANTAGE)
            is not None
        ):
            v.add(
                f"{turn_field}.advantages",
                f"must be finite numbers in [-{MAX_ABS_TOKEN_ADVANTAGE:g}, {MAX_ABS_TOKEN_ADVANTAGE:g}]",
            )
        # Lists first: a protobuf repeated field is read element by element at each pass over it.
        _check_tokens(v, f"{turn_field}.completion_token_ids", list(turn.completion_token_ids), vocab_size)
        _check_tokens(v, f"{turn_field}.prompt_token_ids", list(turn.prompt_token_ids), vocab_size)
        if not turn.prompt_token_ids and k >= assistant_messages:
            v.add(
                f"{turn_field}.prompt_token_ids",
                "empty, and the trajectory has no matching assistant message to re-render the prompt from",
            )
        if not 0 <= turn.policy_version <= current_version:
            v.add(
                f"{turn_field}.policy_version",
                f"{turn.policy_version} is not a version of this model (current version {current_version})",
            )


def _check_metrics(v: Violations, field: str, metrics: Mapping[str, float]) -> None:
    if len(metrics) > MAX_TRAJECTORY_METRICS:
        v.add(field, f"{len(metrics)} metrics: at most {MAX_TRAJECTORY_METRICS} per trajectory")
        return
    for name, value in metrics.items():
        name_bytes = len(name.encode())
        if name_bytes > MAX_METRIC_NAME_BYTES:
            v.add(
                f"{field}[{errors.shown(name)}]",
                f"a name of {name_bytes} bytes: at most {MAX_METRIC_NAME_BYTES}",
            )
        elif not _finite(value):
            v.add(f"{field}[{name}]", "must be finite")


def _json_object_problem(text: str) -> str:
    """Why `text` (empty means {}) is not a JSON object this server takes, or "" when it is one."""
    try:
        parse_json_object(text)
    except BoundedJsonError as error:
        return str(error)
    return ""


def _check_messages(v: Violations, messages: list[types_pb2.Message], field: str) -> None:
    """Messages a renderer cannot take."""
    for i, message in enumerate(messages):
        if message.role not in ROLE_NAMES:
            v.add(f"{field}[{i}].role", "role must be system, user, assistant or tool")
        for j, call in enumerate(message.tool_calls):
            problem = _json_object_problem(call.arguments_json)
            if problem:
                v.add(f"{field}[{i}].tool_calls[{j}].arguments_json", f"must be a JSON object ({problem})")


def _check_tools(v: Violations, tools: list[types_pb2.Tool], field: str) -> None:
    for i, tool in enumerate(tools):
        if not tool.name:
            v.add(f"{field}[{i}].name", "tool name is required")
        problem = _json_object_problem(tool.parameters_json)
        if problem:
            v.add(f"{field}[{i}].parameters_json", f"must be a JSON Schema object ({problem})")


def check_create_model(request: trainer_service_pb2.CreateModelRequest) -> None:
    v = Violations()
    _check_name(v, "name", request.name)
    if not request.base_model:
        v.add("base_model", "required")
    if request.lora.rank < 0:
        v.add("lora.rank", "must be > 0 (0 = default 32)")
    elif request.lora.rank > MAX_LORA_RANK:
        v.add("lora.rank", f"{request.lora.rank} is over the maximum of {MAX_LORA_RANK}")
    if all(request.lora.HasField(flag) and not getattr(request.lora, flag) for flag in LORA_MODULE_FLAGS):
        v.add("lora", "nothing to train: at least one of train_mlp, train_attn, train_unembed must be true")
    for retention in ("keep_sampler_versions", "keep_state_checkpoints"):
        if request.HasField(retention) and getattr(request, retention) < 1:
            v.add(retention, "must be at least 1 (unset = the server's default)")
    v.raise_if_any()


def check_lora_rank(rank: int, base_model: str, hidden_size: int | None) -> None:
    """The rank against its base model's honest maximum (known once the base model's config is loaded)."""
    if hidden_size is None:
        return  # a remote model's width is unknown here: check_create_model applied the cap
    maximum = min(hidden_size, MAX_LORA_RANK)
    if rank > maximum:
        raise errors.invalid_argument(
            [
                (
                    "lora.rank",
                    f"{rank} is over the maximum of {maximum} for {errors.shown(base_model)} "
                    f"(its hidden size {hidden_size}, and at most {MAX_LORA_RANK})",
                )
            ]
        )


def check_checkpoint_name(name: str) -> None:
    """An explicit SaveCheckpoint name (empty: the automatic one)."""
    if name:
        v = Violations()
        _check_name(v, "name", name)
        v.raise_if_any()


def check_checkpoint_kind(kind: int) -> None:
    if kind not in (KIND_STATE, KIND_SAMPLER):
        raise errors.invalid_argument([("kind", f"unknown checkpoint kind {kind}")])


def check_expected_version(
    row: ModelRow,
    request: trainer_service_pb2.TrainRequest | trainer_service_pb2.ExportWeightsRequest,
) -> None:
    if request.HasField("expected_policy_version") and request.expected_policy_version != row.policy_version:
        raise errors.failed_precondition(
            errors.VERSION_MISMATCH,
            f"model {row.name!r} is at version {row.policy_version}, "
            f"not the expected {request.expected_policy_version}",
            {"current_version": row.policy_version, "expected_version": request.expected_policy_version},
        )


def check_train_size(request: trainer_service_pb2.TrainRequest, limits: Limits) -> None:
    count = sum(len(group.trajectories) for group in request.groups) + len(request.examples)
    if count > limits.max_train_trajectories:
        raise errors.resource_exhausted(
            flag_of("max_train_trajectories"),
            f"the batch has {count} trajectories/examples; this server takes at most "
            f"{limits.max_train_trajectories} per Train (--max-train-trajectories): split it",
        )


def check_train_tokens(total_tokens: int, limits: Limits) -> None:
    """The built batch's tokens, prompts and completions."""
    if total_tokens > limits.max_train_tokens:
        raise errors.resource_exhausted(
            flag_of("max_train_tokens"),
            f"the batch has {total_tokens} tokens; this server takes at most "
            f"{limits.max_train_tokens} per Train (--max-train-tokens): split it",
        )


def _check_text_size(
    v: Violations,
    field: str,
    messages: Iterable[types_pb2.Message],
    tools: Iterable[types_pb2.Tool],
    context_length: int,
) -> None:
    """Messages and tools whose text (their encoded size, counted without copying it) cannot fit the
    context, refused before they are rendered."""
    size = sum(m.ByteSize() for m in messages) + sum(t.ByteSize() for t in tools)
    _check_bytes(v, field, size, context_length)


def _check_bytes(v: Violations, field: str, size: int, context_length: int) -> None:
    limit = context_length * MAX_TEXT_BYTES_PER_TOKEN
    if size > limit:
        v.add(
            field,
            f"{size} bytes of text cannot fit the model's context of {context_length} tokens "
            f"(at most {limit} bytes, {MAX_TEXT_BYTES_PER_TOKEN} per token): refused before tokenising",
        )


def check_prompt(request: trainer_service_pb2.SampleRequest, context_length: int) -> None:
    """What can be checked before the prompt is rendered or tokenized, text size included."""
    v = Violations()
    kind = request.WhichOneof("prompt")
    if kind is None:
        v.add("prompt", "give chat, tokens or text")
    elif kind == "text":
        _check_bytes(v, "text", len(request.text.encode()), context_length)
    elif kind == "chat":
        _check_text_size(v, "chat.messages", request.chat.messages, request.chat.tools, context_length)
        if not request.chat.messages:
            v.add("chat.messages", "give at least one message")
        _check_messages(v, list(request.chat.messages), "chat.messages")
        _check_tools(v, list(request.chat.tools), "chat.tools")
        _check_forced_tool_call(v, request.chat)
    v.raise_if_any()


def _check_forced_tool_call(v: Violations, chat: trainer_service_pb2.ChatPrompt) -> None:
    if not chat.HasField("forced_tool_call"):
        return
    if not chat.tools:
        v.add("chat.forced_tool_call", "forcing a tool call needs chat.tools")
        return
    name = chat.forced_tool_call.function_name
    if name and name not in {tool.name for tool in chat.tools}:
        v.add(
            "chat.forced_tool_call.function_name",
            f"{errors.shown(name)} is not the name of one of chat.tools",
        )


def check_prompt_tokens(
    request: trainer_service_pb2.SampleRequest, prompt: list[int], vocab_size: int
) -> None:
    kind = request.WhichOneof("prompt")
    assert kind is not None, "check_prompt ran first"
    v = Violations()
    if kind == "tokens":
        _check_tokens(v, "tokens.token_ids", prompt, vocab_size)
    if not prompt:
        v.add(kind, "the prompt is empty")
    v.raise_if_any()


def check_sampling_params(
    params: types_pb2.SamplingParams, prompt_length: int, vocab_size: int, context_length: int, limits: Limits
) -> None:
    v = Violations()
    if params.n < 0:
        v.add("params.n", "must be >= 1 (0 = default 1)")
    elif params.n > limits.max_sample_n:
        v.add("params.n", f"{params.n} is over this server's limit of {limits.max_sample_n} (--max-sample-n)")
    if prompt_length >= context_length:
        v.add("prompt", f"{prompt_length} tokens fill the model's context of {context_length}")
    if params.max_tokens <= 0:
        v.add("params.max_tokens", "must be > 0 (it is required)")
    elif params.max_tokens > limits.max_sample_tokens:
        v.add(
            "params.max_tokens",
            f"{params.max_tokens} is over this server's limit of {limits.max_sample_tokens} "
            "(--max-sample-tokens)",
        )
    elif prompt_length + params.max_tokens > context_length:
        v.add(
            "params.max_tokens",
            f"prompt ({prompt_length}) + max_tokens ({params.max_tokens}) exceed the context of "
            f"{context_length}",
        )
    if params.HasField("temperature") and not (
        params.temperature == 0 or MIN_TEMPERATURE <= params.temperature <= MAX_TEMPERATURE
    ):
        v.add(
            "params.temperature",
            f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {params.temperature:g}",
        )
    if params.HasField("top_p") and not 0 < params.top_p <= 1:
        v.add("params.top_p", "must be in (0, 1]")
    if params.top_k < 0:
        v.add("params.top_k", "must be >= 0 (0 = off)")
    for name, k in (
        ("top_logprobs", params.top_logprobs),
        ("prompt_top_logprobs", params.prompt_top_logprobs),
    ):
        if not 0 <= k <= MAX_TOP_LOGPROBS:
            v.add(f"params.{name}", f"must be in [0, {MAX_TOP_LOGPROBS}], got {k}")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        v.add("params.stop_token_ids", f"{len(params.stop_token_ids)} ids: at most {MAX_STOP_TOKEN_IDS}")
    else:
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            v.add("params.stop_token_ids", f"token ids {bad} are outside the vocabulary [0, {vocab_size})")
    _check_stop_strings(v, list(params.stop))
    if params.min_tokens < 0:
        v.add("params.min_tokens", "must be >= 0 (0 = off)")
    elif params.min_tokens > params.max_tokens > 0:
        v.add("params.min_tokens", f"{params.min_tokens} is over max_tokens ({params.max_tokens})")
    v.raise_if_any()


def _check_stop_strings(v: Violations, stops: list[str]) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        v.add("params.stop", f"{len(stops)} stop strings: at most {MAX_STOP_STRINGS}")
        return
    if any(not s for s in stops):
        v.add("params.stop", "stop strings must not be empty")
    longest = max((len(s.encode()) for s in stops), default=0)
    if longest > MAX_STOP_STRING_BYTES:
        v.add("params.stop", f"a stop string of {longest} bytes: at most {MAX_STOP_STRING_BYTES} bytes each")


def check_export_request(request: trainer_service_pb2.ExportWeightsRequest) -> None:
    v = Violations()
    for field_name in ("expected_policy_version", "policy_version"):
        if request.HasField(field_name) and getattr(request, field_name) < 0:
            v.add(field_name, "must be >= 0")
    v.raise_if_any()


def check_history_request(request: trainer_service_pb2.GetRunHistoryRequest) -> int:
    """Checks a GetRunHistory request; returns the first version of the page it asks for."""
    v = Violations()
    first = request.from_version if request.HasField("from_version") else 0
    if first < 0:
        v.add("from_version", "must be >= 0")
    if request.HasField("to_version") and request.to_version < first:
        v.add("to_version", f"must be >= from_version ({first})")
    if not 0 <= request.page_size <= MAX_HISTORY_PAGE_SIZE:
        v.add("page_size", f"must be in [0, {MAX_HISTORY_PAGE_SIZE}] (0 = the default)")
    if request.page_token:
        # The token is the next page's first version, written by this server.
        if not (
            request.page_token.isascii() and request.page_token.isdigit() and len(request.page_token) < 19
        ):
            v.add("page_token", "is not a next_page_token this server returned")
        elif int(request.page_token) <= first:
            v.add("page_token", "does not belong to this from_version")
        else:
            first = int(request.page_token)
    v.raise_if_any()
    return first


def check_watch_request(request: trainer_service_pb2.WatchModelRequest) -> None:
    if request.HasField("from_version") and request.from_version < 0:
        raise errors.invalid_argument([("from_version", "must be >= 0")])
