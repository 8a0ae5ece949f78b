"""The built-in models in the Hugging Face hub cache: Hugging Face's own loaders find them by name offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from smollm2_support import SMOLLM2, gguf_tokenizer, smollm2_model_dir
from transformers import AutoConfig, AutoTokenizer

from tinkerrpc_server import model_store
from tinkerrpc_server.model_store import TINY_CHAT, publish_to_hf_cache, resolve_base_model

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_base_model(TINY_CHAT, tmp_path_factory.mktemp("models"))


def test_layout_is_the_hub_cache_s_and_loads_by_name_offline(tiny_chat: Path, tmp_path: Path) -> None:
    snapshot = publish_to_hf_cache(TINY_CHAT, tiny_chat, tmp_path)
    repo = tmp_path / "models--tinkerrpc--tiny-chat"
    assert (repo / "refs" / "main").read_text() == snapshot.name and len(snapshot.name) == 40
    for file in tiny_chat.iterdir():
        linked = snapshot / file.name
        assert linked.is_symlink() and linked.read_bytes() == file.read_bytes()
        assert linked.resolve().parent == (repo / "blobs").resolve()
    tokenizer = AutoTokenizer.from_pretrained(TINY_CHAT, cache_dir=tmp_path, local_files_only=True)
    assert tokenizer.eos_token == "<|im_end|>"
    assert AutoConfig.from_pretrained(TINY_CHAT, cache_dir=tmp_path, local_files_only=True).vocab_size > 0


def test_idempotent_and_independent_of_the_model_dir(tiny_chat: Path, tmp_path: Path) -> None:
    first = publish_to_hf_cache(TINY_CHAT, tiny_chat, tmp_path)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert publish_to_hf_cache(TINY_CHAT, tiny_chat, tmp_path) == first
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    # Blobs are links or copies of the files, not references to them: the entry outlives the model dir.
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in tiny_chat.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    cache = tmp_path / "other-cache"
    snapshot = publish_to_hf_cache(TINY_CHAT, copy, cache)
    for file in copy.iterdir():
        file.unlink()
    assert AutoTokenizer.from_pretrained(TINY_CHAT, cache_dir=cache, local_files_only=True) is not None
    assert snapshot.name == first.name  # same content, same revision


def test_new_content_moves_refs_main(tiny_chat: Path, tmp_path: Path) -> None:
    changed = tmp_path / "changed"
    changed.mkdir()
    for file in tiny_chat.iterdir():
        (changed / file.name).write_bytes(file.read_bytes())
    (changed / "generation_config.json").write_text('{"do_sample": false}')
    cache = tmp_path / "cache"
    old = publish_to_hf_cache(TINY_CHAT, tiny_chat, cache)
    new = publish_to_hf_cache(TINY_CHAT, changed, cache)
    assert new != old and old.is_dir()
    assert (cache / "models--tinkerrpc--tiny-chat" / "refs" / "main").read_text() == new.name


def test_an_unwritable_cache_costs_only_the_layout(
    tiny_chat: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if os.geteuid() == 0:
        read_only = Path("/proc/tinkerrpc-hub-cache")  # root writes anywhere a mode allows; /proc refuses
    else:
        read_only = tmp_path / "read-only"
        read_only.mkdir(mode=0o500)
    monkeypatch.setattr(model_store.layout, "hf_hub_cache", lambda: read_only)
    monkeypatch.setattr(model_store.layout, "_published", set())
    assert resolve_base_model(TINY_CHAT, tiny_chat.parent.parent) == tiny_chat
    assert "cannot lay out tinkerrpc/tiny-chat in the Hugging Face cache" in caplog.text


def test_smollm2_loads_by_name_offline_with_its_fixed_tokenizer(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the cookbook's get_tokenizer loads it: AutoTokenizer by name, with the hub offline."""
    monkeypatch.setattr(model_store.layout, "hf_hub_cache", lambda: tmp_path)
    monkeypatch.setattr(model_store.layout, "_published", set())
    model_dir = smollm2_model_dir(tmp_path_factory)
    resolve_base_model(SMOLLM2, model_dir)
    assert (tmp_path / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "refs" / "main").is_file()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2, cache_dir=tmp_path, local_files_only=True)
    text = "Hello  world\n\tcafé 😀 <|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == gguf_tokenizer().encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert "You are a helpful AI assistant named SmolLM" in tokenizer.chat_template
    config = AutoConfig.from_pretrained(SMOLLM2, cache_dir=tmp_path, local_files_only=True)
    assert (config.model_type, config.tie_word_embeddings) == ("llama", True)
