"""Tinker wire formats the SDK's pydantic types do not cover, and requests into the engine's inputs.

The tinker SDK sends forward_backward as a protobuf `ForwardBackwardRequest` (maybe zstd-compressed) and
expects forward_backward and sample results as protobuf: this module decodes and encodes those. Every
other body is JSON and parses into `tinker.types` in the routes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pydantic
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.types.topk_logprobs import MASK_LOGPROB

from tinkerrpc.contract.limits import MAX_ENGINE_SOFT_TARGETS, MAX_ENGINE_TOPK_LOGPROBS
from tinkerrpc_server.engine.compute.prompt_targets import (
    NO_TARGET,
    CsrLayout,
    PromptTargetLogprobs,
    PromptTargets,
)
from tinkerrpc_server.engine.compute.samples import SampleJob, SampleOutput
from tinkerrpc_server.engine.provenance import DatumProvenance, parse_provenance
from tinkerrpc_server.engine.runtime import DatumArrays, ForwardResult

PROTOBUF_CONTENT_TYPE = "application/x-protobuf"

_NUMPY_DTYPES: dict[int, np.dtype[Any]] = {
    pb.DTYPE_FLOAT32: np.dtype(np.float32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_INT32: np.dtype(np.int32),
}

_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


class BadRequest(ValueError):
    """A request the engine cannot accept; the message is shown to the user."""


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int | None
    loss_fn: str
    loss_fn_config: dict[str, float] | None
    forward_only: bool
    data: list[DatumArrays]
    # Why the datums or config cannot be read, for the user; the request then fails in its model's turn,
    # so the model's later requests do not wait for its seq_id.
    problem: str | None = None
    # Each datum's provenance spans (None: it has none), checked in the model's turn (provenance.py).
    provenance: list[DatumProvenance | None] = field(default_factory=list)


def decode_body(body: bytes, content_encoding: str | None) -> bytes:
    """Undo the SDK's optional zstd compression of protobuf request bodies."""
    if not content_encoding or content_encoding == "identity":
        return body
    if content_encoding != "zstd":
        raise BadRequest(f"unsupported Content-Encoding {content_encoding!r}")
    try:
        return zstandard.ZstdDecompressor().decompressobj().decompress(body)
    except zstandard.ZstdError as exc:
        raise BadRequest(f"body is not valid zstd: {exc}") from exc


def _whole_array(field: str, what: str, data: bytes, dtype: np.dtype[Any]) -> np.ndarray:
    if len(data) % dtype.itemsize:
        raise BadRequest(f"{field}: {len(data)} bytes of {what} is not a whole {dtype} array")
    return np.frombuffer(data, dtype=dtype)


def _tensor_to_numpy(name: str, tensor: pb.Tensor, positions: int) -> np.ndarray:
    """A loss input of a datum of `positions` input tokens as a dense array; a sparse CSR one (`[N, K]`
    soft targets) is densified with 0 in every unlisted cell, as the SDK's `TensorData.to_numpy()` does."""
    field = f"loss_fn_inputs[{name!r}]"
    dtype = _NUMPY_DTYPES.get(tensor.dtype)
    if dtype is None:
        raise BadRequest(f"{field}: unsupported dtype {tensor.dtype}")
    if tensor.HasField("sparse_csr"):
        shape = list(tensor.shape)
        # Checked before it is densified: what it may take is N·K cells, whatever the body's size.
        if len(shape) != 2 or shape[0] != positions or not 1 <= shape[1] <= MAX_ENGINE_SOFT_TARGETS:
            raise BadRequest(
                f"{field}: a sparse CSR tensor must have shape [N, K] with N = {positions} (the model_input's "
                f"tokens) and K in [1, {MAX_ENGINE_SOFT_TARGETS}], got {shape}"
            )
        csr = tensor.sparse_csr
        values = _whole_array(field, "values", csr.values, dtype)
        layout = csr_layout(
            field,
            shape,
            _whole_array(field, "row pointers", csr.crow_indices, np.dtype(np.int64)),
            _whole_array(field, "column indices", csr.col_indices, np.dtype(np.int64)),
            values.size,
        )
        dense = np.zeros(shape, dtype=np.int64 if dtype == np.int32 else dtype)
        dense[layout.rows(), layout.col_indices] = values
        return dense
    array = _whole_array(field, "data", tensor.dense, dtype)
    if tensor.shape:
        if math.prod(tensor.shape) != array.size:
            raise BadRequest(f"{field}: shape {list(tensor.shape)} does not match {array.size} values")
        array = array.reshape(tuple(tensor.shape))
    # int32 widens to the runtime's int64 token convention; float stays float32.
    return array.astype(np.int64) if dtype == np.int32 else array.copy()


def _datum_tokens(index: int, datum: pb.Datum) -> np.ndarray:
    parts: list[np.ndarray] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise BadRequest(f"data[{index}]: model input chunk {kind!r} is not supported (text tokens only)")
        parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(parts).astype(np.int64)


def parse_forward_backward(raw: bytes) -> ForwardBackwardCall:
    request = pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(raw)
    except Exception as exc:  # protobuf raises its own DecodeError subclasses
        raise BadRequest(f"body is not a ForwardBackwardRequest protobuf: {exc}") from exc
    if not request.model_id:
        raise BadRequest("model_id is required")
    call = ForwardBackwardCall(
        model_id=request.model_id,
        # The SDK numbers a model's requests from 1; 0 means "not given".
        seq_id=request.seq_id or None,
        loss_fn=request.loss_fn,
        loss_fn_config=None,
        forward_only=request.forward_only,
        data=[],
        provenance=[parse_provenance(datum) for datum in request.data],
    )
    try:
        config: dict[str, float] = {}
        for key, value in request.loss_fn_config_v2.items():
            if value.WhichOneof("value") == "text":
                raise BadRequest(f"loss_fn_config[{key!r}]: text values are not supported, give a number")
            config[key] = float(value.number)
        for key, number in request.loss_fn_config.items():
            config.setdefault(key, float(number))
        call.loss_fn_config = config or None
        for i, datum in enumerate(request.data):
            tokens = _datum_tokens(i, datum)
            inputs = {
                name: _tensor_to_numpy(name, t, len(tokens)) for name, t in datum.loss_fn_inputs.items()
            }
            call.data.append(DatumArrays(input_tokens=tokens, loss_fn_inputs=inputs))
    except BadRequest as problem:
        call.problem = str(problem)
    return call


def encode_forward_result(result: ForwardResult) -> bytes:
    """ForwardBackwardOutput whose ArrayRecords' `logprobs` field holds every datum's array, in order: one
    record per run of datums with the same trailing shape (`[K]` for `[N, K]` soft targets, none for
    `[N]`), since the SDK reads a record's datums as rectangular."""
    arrays = [np.asarray(lp, dtype=np.float32) for lp in result.logprobs]
    runs: list[list[np.ndarray]] = []
    for array in arrays:
        if runs and runs[-1][0].shape[1:] == array.shape[1:]:
            runs[-1].append(array)
        else:
            runs.append([array])
    output = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for run in runs or [[]]:
        sizes = [a.nbytes for a in run]
        record = output.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=len(run))
        field = record.fields["logprobs"]
        field.data = b"".join(a.tobytes() for a in run)
        field.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tobytes()
        field.dtype = pb.DTYPE_FLOAT32
        if run:
            field.trailing_shape.extend(run[0].shape[1:])
    for key, value in result.metrics.items():
        output.metrics[key] = float(value)
    return bytes(output.SerializeToString())


def encode_sample_output(result: SampleOutput) -> bytes:
    response = pb.SampleResponse()
    for seq in result.sequences:
        encoded = response.sequences.add(
            stop_reason=_STOP_REASONS[seq.stop_reason],
            tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes(),
        )
        if seq.topk_logprobs is not None:
            _encode_topk(
                encoded.topk_sampled_logprobs, seq.topk_logprobs.token_ids, seq.topk_logprobs.logprobs
            )
    if result.prompt_logprobs is not None:
        # The wire marks positions without a logprob (the first token) as NaN.
        values = [math.nan if lp is None else lp for lp in result.prompt_logprobs]
        response.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    if result.topk_prompt_logprobs is not None:
        rows = result.topk_prompt_logprobs
        k = max((len(row) for row in rows if row), default=0)
        if k:
            # Positions without an entry hold the SDK's sentinel (id 0, MASK_LOGPROB), which it reads as None.
            ids = np.zeros((len(rows), k), dtype=np.int32)
            lps = np.full((len(rows), k), MASK_LOGPROB, dtype=np.float32)
            for i, row in enumerate(rows):
                for j, (token, logprob) in enumerate(row or []):
                    ids[i, j] = token
                    lps[i, j] = logprob
            _encode_topk(response.topk_prompt_logprobs, ids, lps)
    if result.target_prompt_logprobs is not None:
        _encode_target_logprobs(response.target_prompt_logprobs, result.target_prompt_logprobs)
    if result.prompt_alt_tokens is not None:
        _encode_dense(response.prompt_alt_tokens.tokens, pb.DTYPE_INT64, result.prompt_alt_tokens.tokens)
        _encode_dense(
            response.prompt_alt_tokens.logprobs, pb.DTYPE_FLOAT32, result.prompt_alt_tokens.logprobs
        )
    response.prompt_cache_hit_tokens = result.prompt_cache_hit_tokens
    return bytes(response.SerializeToString())


def _encode_dense(message: pb.Tensor, dtype: int, values: np.ndarray) -> None:
    message.dtype = dtype  # type: ignore[assignment]
    message.shape.extend(values.shape)
    message.dense = np.ascontiguousarray(values, dtype=_NUMPY_DTYPES[dtype]).tobytes()


def _encode_target_logprobs(message: pb.Tensor, answer: PromptTargetLogprobs) -> None:
    message.dtype = pb.DTYPE_FLOAT32
    message.shape.extend(answer.logprobs.shape)
    if answer.layout is None:
        message.dense = answer.listed().tobytes()
        return
    message.sparse_csr.values = answer.listed().astype(np.float32).tobytes()
    message.sparse_csr.crow_indices = answer.layout.crow_indices.astype(np.int64).tobytes()
    message.sparse_csr.col_indices = answer.layout.col_indices.astype(np.int64).tobytes()


def _encode_topk(message: pb.TopkLogprobs, token_ids: np.ndarray, logprobs: np.ndarray) -> None:
    message.length, message.k = token_ids.shape
    message.token_ids = token_ids.astype(np.int32).tobytes()
    message.logprobs = logprobs.astype(np.float32).tobytes()


def prompt_tokens(prompt: types.ModelInput) -> list[int]:
    tokens: list[int] = []
    for chunk in prompt.chunks:
        if not isinstance(chunk, types.EncodedTextChunk):
            raise BadRequest(f"prompt chunk {chunk.type!r} is not supported (text tokens only)")
        tokens.extend(chunk.tokens)
    return tokens


def sample_job(request: types.SampleRequest) -> SampleJob:
    """Translate a SampleRequest into the engine's SampleJob.

    The runtime checks the values; this checks only what the wire encodes differently. An unset
    max_tokens becomes -1: the worker fills in "until the context is full" once the model is loaded.
    tinker's top_k -1 (off) becomes the engine's 0.
    Stop semantics: `stop` None keeps the model's default EOS stop; any list, including [], is the
    complete set of stops and replaces EOS: token ids stop on those ids, strings stop when the decoded
    text contains one of them.
    """
    for name, k in (
        ("topk_sample_logprobs", request.topk_sample_logprobs),
        ("topk_prompt_logprobs", request.topk_prompt_logprobs),
        ("prompt_alt_tokens_k", request.prompt_alt_tokens_k),
    ):
        if not 0 <= k <= MAX_ENGINE_TOPK_LOGPROBS:
            raise BadRequest(f"{name} must be in [0, {MAX_ENGINE_TOPK_LOGPROBS}], got {k}")
    params = request.sampling_params
    tokens = prompt_tokens(request.prompt)
    targets = request.target_prompt_logprobs
    if params.max_tokens is not None and params.max_tokens < 0:
        raise BadRequest(f"max_tokens must be >= 0, got {params.max_tokens}")
    if params.top_k < -1:
        raise BadRequest(f"top_k must be -1 (off) or positive, got {params.top_k}")
    stop = [params.stop] if isinstance(params.stop, str) else params.stop
    return SampleJob(
        prompt_tokens=tokens,
        num_samples=request.num_samples,
        max_tokens=-1 if params.max_tokens is None else params.max_tokens,
        temperature=params.temperature,
        top_k=0 if params.top_k == -1 else params.top_k,
        top_p=params.top_p,
        stop_token_ids=None if stop is None else [s for s in stop if isinstance(s, int)],
        stop_strings=[] if stop is None else [s for s in stop if isinstance(s, str)],
        seed=params.seed,
        include_prompt_logprobs=bool(request.prompt_logprobs) or request.topk_prompt_logprobs > 0,
        topk_prompt_logprobs=request.topk_prompt_logprobs,
        topk_sample_logprobs=request.topk_sample_logprobs,
        target_prompt_logprobs=None if targets is None else _prompt_targets(targets, len(tokens)),
        prompt_alt_tokens_k=request.prompt_alt_tokens_k,
        record_stability_info=bool(request.record_stability_info),
        prompt_logprobs_last_n=request.prompt_logprobs_last_n,
    )


def _prompt_targets(tensor: Any, prompt_length: int) -> PromptTargets:
    """The SDK's `target_prompt_logprobs` grid (its TensorData) checked for shape and layout; the runtime
    checks the ids against the vocabulary."""
    field = "target_prompt_logprobs"
    shape = tensor.shape or []
    if tensor.dtype != "int64":
        raise BadRequest(f"{field} must be an int64 tensor of token ids, got {tensor.dtype}")
    if len(shape) != 2 or shape[0] != prompt_length - 1 or not 1 <= shape[1] <= MAX_ENGINE_TOPK_LOGPROBS:
        raise BadRequest(
            f"{field} must have shape [len(prompt) - 1, K] = [{prompt_length - 1}, K] with K in "
            f"[1, {MAX_ENGINE_TOPK_LOGPROBS}], got {shape}"
        )
    rows, k = shape
    values = np.asarray(tensor.data, dtype=np.int64)
    if tensor.sparse_crow_indices is None and tensor.sparse_col_indices is None:
        if values.size != rows * k:
            raise BadRequest(f"{field}: {values.size} values do not fill shape {shape}")
        return PromptTargets(values.reshape(rows, k))
    layout = csr_layout(
        field,
        shape,
        np.asarray(tensor.sparse_crow_indices or [], dtype=np.int64),
        np.asarray(tensor.sparse_col_indices or [], dtype=np.int64),
        values.size,
    )
    ids = np.full((rows, k), NO_TARGET, dtype=np.int64)
    ids[layout.rows(), layout.col_indices] = values
    return PromptTargets(ids, layout)


def csr_layout(field: str, shape: list[int], crow: np.ndarray, col: np.ndarray, listed: int) -> CsrLayout:
    """The layout of a sparse CSR tensor of 2-D `shape` with `listed` values, checked as torch's
    `check_invariants` would; raises BadRequest naming `field`."""
    rows, k = shape
    if (
        rows < 0
        or len(crow) != rows + 1
        or crow[0] != 0
        or np.any(np.diff(crow) < 0)
        or crow[-1] != len(col)
        or len(col) != listed
    ):
        raise BadRequest(
            f"{field}: not a valid sparse CSR tensor of shape {shape} (row pointers: {rows + 1}, "
            "from 0, non-decreasing, ending at the number of column indices and values)"
        )
    layout = CsrLayout(crow, col)
    row_of_cell = layout.rows()
    same_row = row_of_cell[1:] == row_of_cell[:-1]
    if np.any((col < 0) | (col >= k)) or np.any(same_row & (np.diff(col) <= 0)):
        raise BadRequest(f"{field}: sparse column indices must be in [0, {k}) and increasing within a row")
    return layout


class WeightsInfoRequest(pydantic.BaseModel):
    """The body of weights_info, which the SDK sends as a plain dict."""

    tinker_path: str


class CheckpointTtlRequest(pydantic.BaseModel):
    """The body of set_checkpoint_ttl, which the SDK sends as a plain dict."""

    ttl_seconds: int | None
