"""Base model resolution and the built-in tiny chat recipe."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from tinker_cookbook.renderers import get_renderer
from tinker_cookbook.tokenizer_utils import get_tokenizer

from tinkerrpc_server import model_store
from tinkerrpc_server.engine.runtime import BaseModelRuntime, DatumArrays, EngineUserError, LoraSpec
from tinkerrpc_server.model_store import (
    QWEN3_0_6B_WIDTH,
    QWEN3_VOCAB_SIZE,
    TINY_CHAT,
    TINY_MODEL_SHAPES,
    TinyModelShape,
    UnknownBaseModelError,
    build_tiny_model,
    publish_to_hf_cache,
    resolve_base_model,
)


def test_tiny_chat_is_built_deterministically(tiny_model_path: Path, tmp_path: Path) -> None:
    rebuilt = resolve_base_model(TINY_CHAT, tmp_path / "models")
    assert rebuilt == tmp_path / "models" / TINY_CHAT
    names = sorted(p.name for p in tiny_model_path.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(names)
    assert names == sorted(p.name for p in rebuilt.iterdir())
    for name in names:
        assert (tiny_model_path / name).read_bytes() == (rebuilt / name).read_bytes(), name


def test_concurrent_builders_end_with_one_complete_model(tmp_path: Path) -> None:
    target = tmp_path / "race" / "tiny"
    errors: list[BaseException] = []

    def build() -> None:
        try:
            build_tiny_model(target, TinyModelShape(32, 1, 2, 1, 16, 64))
        except BaseException as error:  # reported below; a thread cannot fail the test itself
            errors.append(error)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors
    assert (target / "config.json").is_file() and (target / "model.safetensors").is_file()
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny"]  # no staging leftovers


def test_resolution_order_and_unknown_names(tiny_model_path: Path, tmp_path: Path) -> None:
    model_dir = tiny_model_path.parent.parent
    assert resolve_base_model(TINY_CHAT, model_dir) == tiny_model_path
    # Only names: a path to a model directory, or one climbing out of the model dir, is unknown.
    for path in (str(tiny_model_path), f"../{model_dir.name}/{TINY_CHAT}", "a/b/c", "..", "x\0"):
        with pytest.raises(UnknownBaseModelError, match="not a model name"):
            resolve_base_model(path, model_dir)
    with pytest.raises(UnknownBaseModelError) as caught:
        resolve_base_model("Qwen/Qwen3-0.6B", tmp_path / "empty")
    assert isinstance(caught.value, ValueError)
    assert "Qwen/Qwen3-0.6B" in str(caught.value) and str(tmp_path / "empty") in str(caught.value)
    assert not (tmp_path / "empty").exists()  # a failed lookup creates nothing


def test_tokenizer_works_with_the_cookbook_qwen3_renderer(tiny_model_path: Path) -> None:
    tokenizer = get_tokenizer(str(tiny_model_path))
    for word in ("yes", "no", "maybe"):
        assert len(tokenizer.encode(word, add_special_tokens=False)) == 1
    for marker in ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>"):
        assert len(tokenizer.encode(marker, add_special_tokens=False)) == 1, marker
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"

    renderer = get_renderer("qwen3", tokenizer)
    question = [{"role": "user", "content": "Respond with yes, no or maybe."}]
    prompt = tokenizer.decode(renderer.build_generation_prompt(question).to_ints())
    assert prompt == "<|im_start|>user\nRespond with yes, no or maybe.<|im_end|>\n<|im_start|>assistant\n"
    model_input, weights = renderer.build_supervised_example(
        [*question, {"role": "assistant", "content": "maybe"}]
    )
    trained = [t for t, w in zip(model_input.to_ints(), weights.tolist(), strict=True) if w > 0]
    assert tokenizer.decode(trained).endswith("maybe<|im_end|>")
    text = "The weather is fine, isn't it? 42 + ünïcode"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text

    chat = tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    assert chat == prompt


def test_qwen3_width_model_has_qwen3_0_6b_shape_and_vocabulary() -> None:
    shape = TINY_MODEL_SHAPES[QWEN3_0_6B_WIDTH]
    # Qwen3-0.6B's config.json, but 4 of its 28 layers.
    assert (shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (1024, 16, 8, 128)
    assert (shape.intermediate_size, shape.vocab_size, shape.tie_word_embeddings) == (3072, 151_936, True)
    assert shape.num_layers == 4


def test_a_wide_vocabulary_is_the_model_s_and_bounds_the_engine_token_checks(tmp_path: Path) -> None:
    """The Qwen3-width model's recipe at a small size: embedding and unembedding really have the wide
    vocabulary's rows (tied, bf16 on disk), the tokenizer stays the project's own, and the engine takes
    every id below the model's vocabulary, past the tokenizer's."""
    shape = TinyModelShape(
        32, 1, 2, 1, 16, 64, vocab_size=QWEN3_VOCAB_SIZE, tie_word_embeddings=True, saved_dtype="bfloat16"
    )
    path = build_tiny_model(tmp_path / "wide", shape)
    config = json.loads((path / "config.json").read_text())
    assert (config["vocab_size"], config["tie_word_embeddings"], config["dtype"]) == (
        QWEN3_VOCAB_SIZE,
        True,
        "bfloat16",
    )
    runtime = BaseModelRuntime(path, device="cpu")
    assert runtime.vocab_size == QWEN3_VOCAB_SIZE
    assert len(runtime.tokenizer) < QWEN3_VOCAB_SIZE
    runtime.create_adapter("wide", LoraSpec(rank=4, seed=0))
    tokens = np.array([1, len(runtime.tokenizer) + 5, QWEN3_VOCAB_SIZE - 1])
    datum = DatumArrays(tokens, {"target_tokens": tokens[::-1].copy(), "weights": np.ones(3, np.float32)})
    result = runtime.forward_backward("wide", [datum], "cross_entropy", None, backward=True)
    assert result.logprobs[0].shape == (3,) and np.all(result.logprobs[0] < 0)
    outside = DatumArrays(
        np.array([QWEN3_VOCAB_SIZE]), {"target_tokens": np.array([0]), "weights": np.ones(1)}
    )
    with pytest.raises(EngineUserError, match="outside the vocabulary"):
        runtime.forward_backward("wide", [outside], "cross_entropy", None, backward=True)


def test_a_model_laid_out_from_its_own_files_is_not_hashed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_tiny_model(tmp_path / "models" / "tiny", TinyModelShape(32, 1, 2, 1, 16, 64))
    cache = tmp_path / "cache"
    first = publish_to_hf_cache(TINY_CHAT, model, cache)

    def no_hashing(path: Path) -> str:
        raise AssertionError(f"hashed {path} again")

    monkeypatch.setattr(model_store, "_sha256", no_hashing)
    assert publish_to_hf_cache(TINY_CHAT, model, cache) == first
    # A copy of the files (other inodes) is hashed, as its content may differ.
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in model.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    with pytest.raises(AssertionError, match="hashed"):
        publish_to_hf_cache(TINY_CHAT, copy, cache)
