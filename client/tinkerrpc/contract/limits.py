"""Every fixed bound, default and constant of the tinkerrpc API, and the defaults of the server's limit flags.

A constant here is the only definition of its value: the service's validation, the sidecar's request
models, the engine's request checks, the SDK's client-side checks and the generated docs read it.
`LIMITS` describes each fixed bound and constant (what it applies to) for `limits_markdown()`; `SERVER_FLAGS`
the server's per-request limits that `tinkerrpc serve` flags change, which a running server reports
in GetServerInfo's `limits`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# --- Wire types: token counts and ids are int32, seeds and versions int64.
MAX_INT32 = 2**31 - 1
MIN_INT64 = -(2**63)
MAX_INT64 = 2**63 - 1

# --- Sample
# OpenAI's top_logprobs cap.
MAX_TOP_LOGPROBS = 20
# The engine's cap on K of the tinker SDK's topk_sample_logprobs and topk_prompt_logprobs (the cookbook's
# distillation recipes ask for 20), target_prompt_logprobs and prompt_alt_tokens_k; each position's K
# entries are kept until the answer is read.
MAX_ENGINE_TOPK_LOGPROBS = 256
# Sampled sequences the engine remembers by sequence_id (provenance spans and stable_reinforce name
# them), each with its prompt and tokens, in all sessions together; past it the oldest of the session
# keeping the most expires, so a busy session expires its own. Naming an expired one is refused.
MAX_ENGINE_SAMPLED_SEQUENCES = 16384
# The engine's cap on K of `[N, K]` soft target_tokens in forward_backward (a teacher's top-K: the
# cookbook's distillation sends 20); each datum's logprobs and loss inputs hold N·K values.
MAX_ENGINE_SOFT_TARGETS = 1024
# Token streams (the engine's sample stream, SampleStream): streams open at once on the engine, and the
# tokens one stream may hold unread; a reader that far behind loses its stream and its rows stop decoding.
MAX_ENGINE_TOKEN_STREAMS = 256
MAX_STREAM_BUFFERED_TOKENS = 65_536
# Stop strings: the count and UTF-8 bytes of each, and stop token ids (they become stop strings when
# stop strings are given too, so each one costs a string match).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 256
MAX_STOP_TOKEN_IDS = 128
# 0 is greedy; below the floor logits/temperature overflow float32 (1e-40 gave NaN logprobs); above the
# ceiling the distribution is uniform to float32 precision.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 100.0
# Text is refused before it is tokenised when it is over this many UTF-8 bytes per token of the model's
# context: no tokenizer packs that much ordinary text into one token, so such a text could not fit.
MAX_TEXT_BYTES_PER_TOKEN = 32

# --- The sidecar's OpenAI-compatible endpoints (tighter than the gRPC API where OpenAI's are).
# Completions per request (n, best_of): OpenAI-style clients ask for few; a batch goes through gRPC.
SIDECAR_MAX_N = 16
# OpenAI's temperature range is [0, 2].
SIDECAR_MAX_TEMPERATURE = 2.0
# Characters of a caller's request id or cache salt (echoed or ignored, never interpreted).
SIDECAR_MAX_TAG_CHARS = 256

# --- Train
# A value beyond these bounds is never a setting that trains: it overflows float32 in the first step or
# cannot come from a real sampler or environment. Whether a step overflows also depends on the weights,
# so the engine checks each step itself (NON_FINITE_UPDATE); these refuse what is plainly wrong first.
MAX_LEARNING_RATE = 10.0
# Smaller rounds to 0 or a subnormal in float32, where an untouched parameter's update is 0/0.
MIN_ADAM_EPS = 1e-30
MAX_WEIGHT_DECAY = 1.0
# Clip thresholds and DRO's beta above this weigh nothing more: the loss is already unclipped/dominated.
MAX_LOSS_PARAMETER = 1e3
# A sampler never emits a token of probability e^-10000; anything lower is not a sampling logprob.
MIN_LOGPROB = -1e4
MAX_ABS_REWARD = 1e6
# A sample key the Sample RPC returns is 87 characters; anything much longer is no key of ours.
MAX_SAMPLE_KEY_CHARS = 128
# What a Train stores with its step (the idempotency record, the run history's metrics): a key is a
# client's retry token (a UUID is 36 bytes); metrics are an environment's few figures per trajectory,
# and each distinct name becomes a stored "env/<name>" mean.
MAX_IDEMPOTENCY_KEY_BYTES = 256
MAX_TRAJECTORY_METRICS = 64
MAX_METRIC_NAME_BYTES = 128
MAX_TRAIN_METRIC_NAMES = 256
# Tinker's AdamParams defaults: the SDK's learning rate, and what a Train that leaves beta1, beta2 or
# eps unset gets.
DEFAULT_LEARNING_RATE = 1e-4
DEFAULT_ADAM_BETA1 = 0.9
DEFAULT_ADAM_BETA2 = 0.95
DEFAULT_ADAM_EPS = 1e-12
# With normalize_std a group's advantages are divided by its reward std plus this, so a group whose
# rewards barely differ gets large but finite advantages (a zero-variance group trains nothing anyway).
ADVANTAGE_STD_EPSILON = 1e-6
# An RL step's sampler/learner mismatch (TrainMetrics.sampler_mismatch) counts the sampled tokens whose
# importance ratio exp(learner - sampler) lies outside [MIN, MAX]: a token the learner finds half or
# twice as likely as the sampler did is past what PPO-style clipping (0.8 to 1.2 and the like) absorbs.
MISMATCH_RATIO_MIN = 0.5
MISMATCH_RATIO_MAX = 2.0
# The per-token terms of Train (contract/train_terms.py): a KL penalty's or distillation's coefficient
# weighs a logprob gap of a few nats against group advantages of order 1; past 100 the term alone trains,
# which is what distillation (default weight 1, tinker-cookbook's) is for.
MAX_KL_COEFFICIENT = 100.0
DEFAULT_DISTILLATION_COEFFICIENT = 1.0
# A given per-token advantage is bounded as rewards are.
MAX_ABS_TOKEN_ADVANTAGE = 1e6
# Truncated importance sampling trains as cispo with this lower clip: far below any ratio a sampled token
# has (a ratio this small is already a zero weight), so only the cap clips.
TRUNCATED_IS_CLIP_LOW = 1e-30
# A policy version a Train names as its KL reference or distillation teacher is pinned: retention keeps its
# sampler weights while a model trains against it (service/reference_pins.py). Each model holds at most
# one pin per term; a model's versions pinned at once are bounded by this, so its disk stays bounded too.
MAX_PINNED_REFERENCE_VERSIONS = 16
# The sample cache, which lets a turn that names its sample key train on the sampler's own logprobs: a
# key is honoured this long after its Sample, and the server keeps at most this many samples and bytes of
# them (least recently used out first); a key past these is scored again, never an error.
MAX_SAMPLE_KEY_AGE_SECONDS = 600
MAX_CACHED_SAMPLES = 65_536
MAX_SAMPLE_CACHE_BYTES = 64 * 1024 * 1024

# --- Models
# Model and checkpoint names: 1 to this many characters of [A-Za-z0-9._-], starting with a letter or digit.
MAX_NAME_CHARS = 64
# The rank of a model created without one: Tinker's SDK's create_lora_training_client default (the
# engine's create_model without lora_config gets it too).
DEFAULT_LORA_RANK = 32
# At most the base model's hidden size (a rank past the width of the layers it adapts adds parameters,
# not expressiveness) and never over this cap, whose adapter and Adam state on a mid-size model are
# already gigabytes.
MAX_LORA_RANK = 512

# --- GetRunHistory pages
DEFAULT_HISTORY_PAGE_SIZE = 100
MAX_HISTORY_PAGE_SIZE = 1000

# --- The engine's REST listings and records (tinker SDK: RestClient, AdminClient)
# Page size of list_sessions, list_training_runs and list_user_checkpoints (search_sessions: the SDK's 200).
MAX_ENGINE_PAGE_SIZE = 1000
# Entries of a user_metadata (session, training run, checkpoint) and tags of a session: labels, not data.
MAX_ENGINE_LABELS = 64
# Characters of one tag, display name, user_metadata key or value, and of a session's finish detail.
MAX_ENGINE_LABEL_CHARS = 1024
# Session records the engine keeps (list_sessions, get_session, search_sessions); every SDK ServiceClient
# opens a session. Past the cap the oldest ended ones (finished, or silent for the session timeout) are
# forgotten, never one with a training client or sampling session in memory or a checkpoint on disk (what
# it made stays findable by its session and project). Why 1024: listing and searching read every record
# per call, and a record holds up to about 200 KB of labels (MAX_ENGINE_LABELS tags and metadata entries
# of MAX_ENGINE_LABEL_CHARS; a few hundred bytes as the SDK sends it), so at most about 200 MB in memory
# and the index, and still far more sessions than anyone pages through.
MAX_ENGINE_SESSION_RECORDS = 1024
# Finished session ids the engine remembers, so that a heartbeat of one answers 410 (the SDK then stops its
# loop); past it the oldest are forgotten, and a forgotten session that heartbeats again is adopted, as
# after a restart, until it falls silent. Why 4096: an id costs about 100 bytes, so under half a MB, and
# four times the records kept of sessions.
MAX_ENGINE_FINISHED_SESSION_IDS = 4096
# Training-run records the engine keeps (list_training_runs, get_training_run): every training client is a
# run, so a service that rebuilds its client after each failed step makes one per step. Past the cap the
# least recently used idle runs (no checkpoint, no training client in memory) are forgotten and then
# unknown (404); a run with a checkpoint or a live client always stays (its checkpoints' listing and
# get_training_run_by_tinker_path need it). Why 1024: listing reads every record per call and a record
# holds up to about 130 KB of user_metadata (MAX_ENGINE_LABELS entries of MAX_ENGINE_LABEL_CHARS), so at
# most about 130 MB, as for session records, and far more runs than anyone pages through.
MAX_ENGINE_RUN_RECORDS = 1024
# Seconds an idle run (as above) stays recorded after its last request. Why a week: the engine's audit log
# names a run's requests for 7 days, so every run it names can still be looked up.
MAX_ENGINE_IDLE_RUN_SECONDS = 7 * 86400
# A checkpoint's ttl_seconds (a save's, a copy's, set_checkpoint_ttl's): Tinker's 10 years. The engine's
# least is 1 s, not Tinker's hour.
MAX_CHECKPOINT_TTL_SECONDS = 10 * 365 * 86400
# age recipients of an encrypted export (save_weights_external), and characters of one (an SSH RSA
# public key of 8192 bits is about 1400).
MAX_AGE_RECIPIENTS = 16
MAX_AGE_RECIPIENT_CHARS = 4096

# --- WatchModel
# Events a watcher may fall behind by before its stream ends with ABORTED (it resumes from a version):
# a reader that slow would otherwise hold the server's memory without bound.
MAX_WATCH_BACKLOG_EVENTS = 1024

# --- JSON carried in requests (the sidecar's bodies, a tool's parameters_json, a call's arguments_json)
# Arrays and objects inside one another: real schemas nest a handful of levels, and every layer that
# walks the value afterwards (renderers, dataclasses.asdict) recurses; far from Python's recursion limit.
MAX_JSON_DEPTH = 64
# Entries of one object or array: a legacy prompt of token ids is the longest list a request needs.
MAX_JSON_ENTRIES = 1 << 17
# Characters of one number literal: an int64 is 20, a double's shortest exact form 24; far under the
# 4300 digits where Python refuses to convert an integer.
MAX_JSON_NUMBER_CHARS = 100


@dataclass(frozen=True)
class Limit:
    """One fixed bound, default or constant: `name` is its constant in this module, `bounds` what it
    applies to."""

    name: str
    value: int | float
    bounds: str
    kind: Literal["at most", "at least", "default", "constant"]


def _most(name: str, bounds: str) -> Limit:
    return Limit(name, globals()[name], bounds, "at most")


def _least(name: str, bounds: str) -> Limit:
    return Limit(name, globals()[name], bounds, "at least")


def _default(name: str, bounds: str) -> Limit:
    return Limit(name, globals()[name], bounds, "default")


def _constant(name: str, bounds: str) -> Limit:
    return Limit(name, globals()[name], bounds, "constant")


LIMITS: tuple[Limit, ...] = (
    _most(
        "MAX_TOP_LOGPROBS",
        "SamplingParams.top_logprobs and prompt_top_logprobs (the sidecar's top_logprobs, logprobs, "
        "prompt_logprobs)",
    ),
    _most(
        "MAX_ENGINE_TOPK_LOGPROBS",
        "K of the engine's topk_sample_logprobs and topk_prompt_logprobs (also at most the vocabulary), "
        "target_prompt_logprobs and prompt_alt_tokens_k (tinker SDK)",
    ),
    _most(
        "MAX_ENGINE_SAMPLED_SEQUENCES",
        "sampled sequences the engine keeps for provenance spans and stable_reinforce, all sessions "
        "together (past it, the oldest of the session keeping the most expires; an expired sequence_id "
        "is refused as such)",
    ),
    _most(
        "MAX_ENGINE_SOFT_TARGETS",
        "K of the engine's [N, K] soft target_tokens in forward_backward (tinker SDK; losses whose "
        "contract row has soft_targets)",
    ),
    _most("MAX_ENGINE_TOKEN_STREAMS", "token streams open at once on the engine (SampleStream)"),
    _most(
        "MAX_STREAM_BUFFERED_TOKENS",
        "tokens a stream holds unread; a reader further behind loses its stream, its rows stop decoding",
    ),
    _most("MAX_STOP_STRINGS", "strings in SamplingParams.stop (the sidecar's stop)"),
    _most("MAX_STOP_STRING_BYTES", "UTF-8 bytes of one stop string (each also non-empty)"),
    _most("MAX_STOP_TOKEN_IDS", "ids in SamplingParams.stop_token_ids"),
    _least("MIN_TEMPERATURE", "SamplingParams.temperature, unless 0 (greedy)"),
    _most("MAX_TEMPERATURE", "SamplingParams.temperature"),
    _most(
        "MAX_TEXT_BYTES_PER_TOKEN",
        "UTF-8 bytes of text per token of the model's context (a Sample's text, a chat's messages and "
        "tools, a Train example's or trajectory's messages), refused before tokenising",
    ),
    _most("SIDECAR_MAX_N", "the sidecar's n and best_of"),
    _most("SIDECAR_MAX_TEMPERATURE", "the sidecar's temperature (OpenAI's range)"),
    _most("SIDECAR_MAX_TAG_CHARS", "characters of the sidecar's request_id and cache_salt"),
    _most(
        "MAX_LEARNING_RATE",
        "AdamParams.learning_rate (required, > 0) and each of TrainRequest.minibatch_learning_rates",
    ),
    _default("DEFAULT_LEARNING_RATE", "the SDK's learning_rate (Train's has none: it is required)"),
    _default("DEFAULT_ADAM_BETA1", "AdamParams.beta1 when unset (Tinker's)"),
    _default("DEFAULT_ADAM_BETA2", "AdamParams.beta2 when unset (Tinker's)"),
    _default("DEFAULT_ADAM_EPS", "AdamParams.eps when unset (Tinker's)"),
    _least("MIN_ADAM_EPS", "AdamParams.eps (smaller is 0 in float32)"),
    _most("MAX_WEIGHT_DECAY", "AdamParams.weight_decay (>= 0)"),
    _most("MAX_LOSS_PARAMETER", "LossConfig's clip_high_threshold and beta"),
    _least("MIN_LOGPROB", "SampledTurn.completion_logprobs (each also <= 0)"),
    _most("MAX_ABS_REWARD", "|Trajectory.reward|"),
    _most("MAX_SAMPLE_KEY_CHARS", "characters of SampledTurn.sample_key"),
    _most("MAX_IDEMPOTENCY_KEY_BYTES", "bytes of TrainRequest.idempotency_key"),
    _most("MAX_TRAJECTORY_METRICS", "metrics of one trajectory (each finite)"),
    _most("MAX_METRIC_NAME_BYTES", "bytes of one trajectory metric's name"),
    _most("MAX_TRAIN_METRIC_NAMES", "distinct trajectory metric names in one Train"),
    _constant(
        "ADVANTAGE_STD_EPSILON",
        "added to a group's reward std (population) before the advantages are divided by it "
        "(AdvantageOptions.normalize_std)",
    ),
    _constant(
        "MISMATCH_RATIO_MIN",
        "SamplerMismatch.outside_fraction counts sampled tokens whose importance ratio is below this",
    ),
    _constant(
        "MISMATCH_RATIO_MAX",
        "SamplerMismatch.outside_fraction counts sampled tokens whose importance ratio is above this",
    ),
    _most("MAX_KL_COEFFICIENT", "KLPenalty.coefficient and Distillation.coefficient (each > 0)"),
    _default("DEFAULT_DISTILLATION_COEFFICIENT", "Distillation.coefficient when unset (tinker-cookbook's)"),
    _most("MAX_ABS_TOKEN_ADVANTAGE", "|SampledTurn.advantages| (each finite)"),
    _constant(
        "TRUNCATED_IS_CLIP_LOW",
        "cispo's clip_low_threshold when TrainRequest.importance_ratio_cap trains importance_sampling",
    ),
    _most(
        "MAX_PINNED_REFERENCE_VERSIONS",
        "versions of one model kept as the KL reference or distillation teacher of Trains (pinned past "
        "--keep-sampler-versions; one more is FAILED_PRECONDITION TOO_MANY_REFERENCE_PINS)",
    ),
    _most("MAX_SAMPLE_KEY_AGE_SECONDS", "seconds a sample key is honoured after its Sample"),
    _most("MAX_CACHED_SAMPLES", "samples the server keeps for their sample keys"),
    _most("MAX_SAMPLE_CACHE_BYTES", "bytes of tokens and logprobs the server keeps for sample keys"),
    _most(
        "MAX_NAME_CHARS", "characters of a model or checkpoint name ([A-Za-z0-9._-], first a letter or digit)"
    ),
    _default(
        "DEFAULT_LORA_RANK", "LoraConfig.rank when 0 (and the engine's create_model without lora_config)"
    ),
    _most("MAX_LORA_RANK", "LoraConfig.rank (also at most the base model's hidden size)"),
    _default("DEFAULT_HISTORY_PAGE_SIZE", "GetRunHistoryRequest.page_size when 0"),
    _most("MAX_HISTORY_PAGE_SIZE", "GetRunHistoryRequest.page_size"),
    _most(
        "MAX_ENGINE_PAGE_SIZE",
        "the engine's page size (limit) of list_sessions, list_training_runs and list_user_checkpoints",
    ),
    _most("MAX_ENGINE_LABELS", "the engine's entries of one user_metadata, and a session's tags"),
    _most(
        "MAX_ENGINE_LABEL_CHARS",
        "the engine's characters of a tag, display name, user_metadata key or value, or finish detail",
    ),
    _most(
        "MAX_ENGINE_SESSION_RECORDS",
        "sessions the engine keeps records of, past which the oldest ended ones are forgotten (never one "
        "with a training client or sampling session in memory, or a checkpoint)",
    ),
    _most(
        "MAX_ENGINE_FINISHED_SESSION_IDS",
        "finished session ids the engine remembers so their heartbeats answer 410 (the oldest forgotten)",
    ),
    _most(
        "MAX_ENGINE_RUN_RECORDS",
        "training runs the engine keeps records of, past which the least recently used idle ones (no "
        "checkpoint, no training client in memory) are forgotten",
    ),
    _most(
        "MAX_ENGINE_IDLE_RUN_SECONDS",
        "seconds the engine keeps the record of an idle training run (no checkpoint, no training client in "
        "memory) after its last request",
    ),
    _most("MAX_CHECKPOINT_TTL_SECONDS", "the engine's ttl_seconds of a checkpoint (save, copy, set ttl)"),
    _most("MAX_AGE_RECIPIENTS", "age_encryption_recipients of save_weights_external (at least 1 if given)"),
    _most("MAX_AGE_RECIPIENT_CHARS", "characters of one age recipient (age1... key or SSH public key)"),
    _most("MAX_WATCH_BACKLOG_EVENTS", "events a WatchModel stream falls behind by before it ends (ABORTED)"),
    _most("MAX_JSON_DEPTH", "nesting of JSON in a request (sidecar bodies, parameters_json, arguments_json)"),
    _most("MAX_JSON_ENTRIES", "entries of one JSON object or array in a request"),
    _most("MAX_JSON_NUMBER_CHARS", "characters of one JSON number literal (NaN and Infinity are refused)"),
)


@dataclass(frozen=True)
class ServerFlag:
    """A per-request limit that a `tinkerrpc serve` flag sets; `attribute` names it in the server's
    Limits and in GetServerInfo's ServerLimits (backend_timeout as backend_timeout_seconds)."""

    flag: str
    attribute: str
    default: int
    help: str


SERVER_FLAGS: tuple[ServerFlag, ...] = (
    ServerFlag(
        "--max-train-trajectories", "max_train_trajectories", 4096, "trajectories or examples per Train"
    ),
    ServerFlag(
        "--max-train-tokens", "max_train_tokens", 1_048_576, "tokens per Train step, prompts and completions"
    ),
    ServerFlag("--max-sample-n", "max_sample_n", 128, "completions per Sample (n)"),
    ServerFlag("--max-sample-tokens", "max_sample_tokens", 16_384, "max_tokens per Sample"),
    ServerFlag(
        "--backend-timeout", "backend_timeout", 3600, "seconds a call without a deadline waits on the backend"
    ),
    ServerFlag(
        "--keep-sampler-versions", "keep_sampler_versions", 16, "latest versions kept sampleable per model"
    ),
    ServerFlag(
        "--keep-state-checkpoints",
        "keep_state_checkpoints",
        4,
        "latest automatic state checkpoints per model",
    ),
)


def server_flag(attribute: str) -> ServerFlag:
    return next(flag for flag in SERVER_FLAGS if flag.attribute == attribute)


def number(value: float) -> str:
    """A bound as the docs write it: 1e6, 1e-30, 0.001, 131072."""
    if isinstance(value, int):
        return str(value)
    return f"{value:g}".replace("e+0", "e").replace("e+", "e").replace("e-0", "e-")


def markdown_table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> str:
    """A Markdown table; a `|` inside a cell is escaped so that it does not split the cell."""
    lines = [header, tuple("---" for _ in header), *rows]
    return "".join("| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |\n" for line in lines)


def limits_markdown() -> str:
    """The fixed bounds and the server's limit flags as Markdown tables (for the docs)."""
    bounds = [
        (
            f"`{limit.name}`",
            number(limit.value) if limit.kind == "constant" else f"{limit.kind} {number(limit.value)}",
            limit.bounds,
        )
        for limit in LIMITS
    ]
    flags = [(f"`{flag.flag}`", str(flag.default), flag.help) for flag in SERVER_FLAGS]
    return (
        markdown_table(("name", "value", "applies to"), bounds)
        + "\n"
        + markdown_table(("flag", "default", "limits per request"), flags)
    )
