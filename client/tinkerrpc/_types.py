"""User-facing dataclasses beyond the conversation itself (_messages.py): samples, trajectories, models,
checkpoints, train results and run history; plain Python objects, no protobuf in sight."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from tinkerrpc._messages import Message, MessageLike, SampledTurn, Tool, as_messages
from tinkerrpc._openai import (
    ChatCompletionLike,
    ResponseInput,
    ResponseLike,
    messages_from_response_input,
    turn_from_chat_completion,
    turn_from_response,
)

StopReason = Literal["stop", "length"]
CheckpointKind = Literal["state", "sampler"]
TrainOn = Literal["all", "last"]


@dataclass(frozen=True)
class TopLogprob:
    """One candidate token at a sampled or prompt position."""

    token_id: int
    logprob: float
    text: str = ""
    # Its exact bytes (None from a server that does not send them).
    bytes: bytes | None = None


@dataclass(frozen=True)
class Sample:
    """One sampled completion."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    message: Message | None
    stop_reason: StopReason | None
    policy_version: int
    prompt_token_ids: tuple[int, ...]
    top_logprobs: tuple[tuple[TopLogprob, ...], ...] = ()
    token_texts: tuple[str, ...] = ()
    # Each token's exact bytes, with token_texts: a token holding part of a multi-byte character has
    # U+FFFD in its text, and its bytes joined with its neighbours' rebuild the character.
    token_bytes: tuple[bytes, ...] = ()
    prompt_logprobs: tuple[float, ...] = ()
    # The k most likely tokens at each prompt position, with prompt_top_logprobs (position 0: none).
    prompt_top_logprobs: tuple[tuple[TopLogprob, ...], ...] = ()
    # The prompt as text, when asked with return_prompt_text.
    prompt_text: str = ""
    # The server's key for this sample's tokens and logprobs (SampledTurn.sample_key).
    # An opaque handle (a fresh nonce per sample), not content: equal samples compare equal without it.
    sample_key: str = field(default="", compare=False)

    def to_turn(self) -> SampledTurn:
        return SampledTurn(
            self.prompt_token_ids, self.tokens, self.logprobs, self.policy_version, self.sample_key
        )

    def to_message(self) -> Message:
        """The parsed assistant message, or the raw text as one when the prompt was not chat."""
        return self.message if self.message is not None else Message.assistant(self.text)


@dataclass
class Trajectory:
    """One rollout: the conversation, every sampled assistant turn in it, and its reward.

    Build it from samples (`from_sample`, `add_sample`), from the sidecar's chat completions
    (`from_openai`, `add_openai`; a `.stream()`'s `get_final_completion()` too) or its Responses
    (`from_openai_response`, `add_openai_response`); a trajectory without sampled turns cannot train.
    """

    messages: list[Message] = field(default_factory=list)
    turns: list[SampledTurn] = field(default_factory=list)
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    tools: list[Tool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = as_messages(self.messages)

    @classmethod
    def from_sample(
        cls,
        messages: Iterable[MessageLike],
        sample: Sample,
        reward: float = 0.0,
        *,
        tools: Iterable[Tool] = (),
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Trajectory:
        """The prompt messages plus the sampled assistant message, with its turn."""
        traj = cls(
            messages=as_messages(messages),
            reward=reward,
            tools=list(tools),
            metrics=dict(metrics or {}),
            metadata=dict(metadata or {}),
        )
        return traj.add_sample(sample)

    @classmethod
    def from_openai(
        cls,
        messages: Iterable[MessageLike],
        chat_completion: ChatCompletionLike,
        reward: float = 0.0,
        choice_index: int = 0,
        *,
        tools: Iterable[Tool | Mapping[str, Any]] = (),
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Trajectory:
        """The prompt messages plus one choice of a sidecar chat completion, with its turn."""
        traj = cls(
            messages=as_messages(messages),
            reward=reward,
            tools=[t if isinstance(t, Tool) else Tool.from_openai(t) for t in tools],
            metrics=dict(metrics or {}),
            metadata=dict(metadata or {}),
        )
        return traj.add_openai(chat_completion, choice_index)

    @classmethod
    def from_openai_response(
        cls,
        input: ResponseInput,
        response: ResponseLike,
        reward: float = 0.0,
        *,
        instructions: str | None = None,
        tools: Iterable[Tool | Mapping[str, Any]] = (),
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Trajectory:
        """The request's `input` (and `instructions`) plus the sampled turn of a sidecar Response.

        `tools` take the Responses form (`{"type": "function", "name": ...}`) or the chat form.
        """
        traj = cls(
            messages=messages_from_response_input(input, instructions),
            reward=reward,
            tools=[t if isinstance(t, Tool) else Tool.from_openai(t) for t in tools],
            metrics=dict(metrics or {}),
            metadata=dict(metadata or {}),
        )
        return traj.add_openai_response(response)

    def add_sample(self, sample: Sample) -> Trajectory:
        """Append a sampled assistant turn (its message and tokens); returns self for chaining."""
        self.messages.append(sample.to_message())
        self.turns.append(sample.to_turn())
        return self

    def add_openai(self, chat_completion: ChatCompletionLike, choice_index: int = 0) -> Trajectory:
        """Append one choice of a sidecar chat completion as a sampled turn; returns self."""
        message, turn = turn_from_chat_completion(chat_completion, choice_index)
        self.messages.append(message)
        self.turns.append(turn)
        return self

    def add_openai_response(self, response: ResponseLike) -> Trajectory:
        """Append the sampled turn of a sidecar Response (`/v1/responses`); returns self."""
        message, turn = turn_from_response(response)
        self.messages.append(message)
        self.turns.append(turn)
        return self

    def add_messages(self, *messages: MessageLike) -> Trajectory:
        """Append non-sampled messages (tool results, user replies); returns self."""
        self.messages.extend(as_messages(messages))
        return self

    @property
    def min_policy_version(self) -> int | None:
        return min((t.policy_version for t in self.turns), default=None)

    @property
    def max_policy_version(self) -> int | None:
        return max((t.policy_version for t in self.turns), default=None)


@dataclass
class TrajectoryGroup:
    """Rollouts of the same prompt; advantages are computed within the group."""

    trajectories: list[Trajectory] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.trajectories = list(self.trajectories)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]


@dataclass(frozen=True)
class SupervisedExample:
    """A conversation to imitate; `train_on` picks which assistant messages carry loss."""

    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    train_on: TrainOn = "all"

    def __post_init__(self) -> None:
        object.__setattr__(self, "messages", tuple(as_messages(self.messages)))
        object.__setattr__(self, "tools", tuple(self.tools))


@dataclass(frozen=True)
class ExportedWeights:
    """A model's LoRA adapter as exported into `directory` (a plain PEFT adapter directory)."""

    model: str
    policy_version: int
    base_model: str
    directory: Path
    files: tuple[str, ...]


@dataclass(frozen=True)
class CheckpointInfo:
    """A saved checkpoint of a model."""

    model: str
    name: str
    policy_version: int
    kind: CheckpointKind
    tinker_path: str = ""
    create_time: datetime | None = None
    automatic: bool = False


@dataclass(frozen=True)
class ModelInfo:
    """A named LoRA run on a base model."""

    name: str
    base_model: str
    policy_version: int
    lora_rank: int = 32
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    renderer: str = ""
    sampleable_versions: tuple[int, ...] = ()
    create_time: datetime | None = None
    seed: int = 0
    tinker_run_id: str = ""
    vocab_size: int = 0
    max_context_length: int = 0


@dataclass(frozen=True)
class SamplerMismatch:
    """How far the learner's logprobs of an RL step's sampled tokens are from the sampler's, with
    d = learner − sampler per sampled token (see SamplerMismatch in protos/tinkerrpc/v1/types.proto)."""

    # KL(sampler || learner), k3 estimator: mean(exp(d) − 1 − d).
    kl: float
    # Mean and largest importance ratio exp(d).
    mean_ratio: float
    max_ratio: float
    # Fraction of tokens whose ratio is outside [MISMATCH_RATIO_MIN, MISMATCH_RATIO_MAX] (contract limits).
    outside_fraction: float
    # Sampled tokens the figures are over.
    tokens: int
    # With importance_ratio_cap: the fraction of tokens whose ratio exceeded it, and the cap (None: none).
    capped_fraction: float = 0.0
    ratio_cap: float | None = None


@dataclass(frozen=True)
class TrainMetrics:
    """Figures from one Train step (see TrainMetrics in protos/tinkerrpc/v1/types.proto)."""

    loss: float = 0.0
    mean_reward: float = 0.0
    trained_tokens: int = 0
    total_tokens: int = 0
    trajectories_used: int = 0
    dropped_stale: int = 0
    dropped_zero_variance: int = 0
    zero_variance_groups: int = 0
    staleness_histogram: Mapping[int, int] = field(default_factory=dict)
    step_seconds: float = 0.0
    tokens_per_second: float = 0.0
    extra: Mapping[str, float] = field(default_factory=dict)
    std_reward: float = 0.0
    learning_rate: float = 0.0
    # Tokens the server had to score (turns without logprobs or a usable sample key).
    scored_tokens: int = 0
    # RL steps: the sampler/learner mismatch over the sampled tokens; None for supervised steps (and
    # when the backend returned no per-token logprobs).
    sampler_mismatch: SamplerMismatch | None = None
    # With a KL penalty: mean of sampler − reference logprob over the sampled tokens (k1 KL estimate).
    reference_kl: float | None = None
    # With distillation: mean of sampler − teacher logprob over the sampled tokens (reverse KL estimate).
    teacher_kl: float | None = None
    # A supervised Train with minibatch_size: each minibatch's loss in order (loss is their sum).
    minibatch_losses: tuple[float, ...] = ()


@dataclass(frozen=True)
class TrainResult:
    """The outcome of one optimizer step."""

    policy_version: int
    metrics: TrainMetrics
    sampler_checkpoint: CheckpointInfo | None = None
    state_checkpoint: CheckpointInfo | None = None
    replayed: bool = False


@dataclass(frozen=True)
class RunStep:
    """One policy version of a model's run: the Train step that made it."""

    policy_version: int
    metrics: TrainMetrics
    commit_time: datetime | None = None
    # The checkpoints of this version that still exist.
    checkpoints: tuple[CheckpointInfo, ...] = ()


@dataclass(frozen=True)
class RunHistory:
    """One page of a model's run; pass `next_page_token` to `history()` for the next (None: the last)."""

    steps: tuple[RunStep, ...]
    next_page_token: str | None = None


ModelEventKind = Literal["version", "checkpoint_saved", "checkpoint_deleted", "restored"]


@dataclass(frozen=True)
class ModelEvent:
    """One event of `watch()`: a new version (`step`), a checkpoint saved or deleted, or a restore
    (`checkpoint` is the state checkpoint restored); `policy_version` is the model's after it."""

    kind: ModelEventKind
    policy_version: int
    time: datetime | None = None
    step: RunStep | None = None
    checkpoint: CheckpointInfo | None = None
    # True for versions replayed from the history, False for live events.
    replayed: bool = False


def check_trainable(groups: Sequence[TrajectoryGroup]) -> None:
    """Refuse, before any network call, groups the server would reject for missing or broken turns."""
    if not groups:
        raise ValueError("train() needs at least one TrajectoryGroup")
    for g, group in enumerate(groups):
        if not group.trajectories:
            raise ValueError(f"groups[{g}] has no trajectories")
        for t, traj in enumerate(group.trajectories):
            where = f"groups[{g}].trajectories[{t}]"
            if not traj.turns:
                raise ValueError(
                    f"{where} has no sampled turns: RL needs the sampler's tokens and logprobs; build it with "
                    "Trajectory.from_sample / from_openai or add_sample / add_openai"
                )
            if not math.isfinite(traj.reward):
                raise ValueError(f"{where}.reward must be finite, got {traj.reward}")
            for k, turn in enumerate(traj.turns):
                if not turn.completion_token_ids:
                    raise ValueError(f"{where}.turns[{k}] has no completion tokens")
                # No logprobs: the server takes them from its sample cache or scores the turn.
                if turn.logprobs and len(turn.logprobs) != len(turn.completion_token_ids):
                    raise ValueError(
                        f"{where}.turns[{k}] has {len(turn.logprobs)} logprobs for "
                        f"{len(turn.completion_token_ids)} completion tokens"
                    )
                if turn.advantages and len(turn.advantages) != len(turn.completion_token_ids):
                    raise ValueError(
                        f"{where}.turns[{k}] has {len(turn.advantages)} advantages for "
                        f"{len(turn.completion_token_ids)} completion tokens"
                    )
