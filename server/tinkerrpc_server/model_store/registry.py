"""Base model names to model directories: a model under the model dir, or a built-in model, built on
first use and laid out in the Hugging Face hub cache."""

from __future__ import annotations

from pathlib import Path

from tinkerrpc_server.model_store.gguf_models import build_gguf_model, gguf_file
from tinkerrpc_server.model_store.layout import offer_to_hf_cache
from tinkerrpc_server.model_store.names import (
    GGUF_MODELS,
    TINY_CHAT,
    TINY_MODEL_SHAPES,
    UnknownBaseModelError,
    builtin_model_names,
    is_model_name,
)
from tinkerrpc_server.model_store.tiny_models import build_tiny_model


def listed_builtin_models() -> list[str]:
    """The built-in models a server lists before they are built: the default one, and each GGUF
    model whose package is installed."""
    return sorted(
        [TINY_CHAT, *(name for name, source in GGUF_MODELS.items() if gguf_file(source) is not None)]
    )


def resolve_base_model(name: str, model_dir: Path) -> Path:
    """Map a base model name to its Hugging Face directory under `model_dir`, building a built-in model
    on first use (and laying it out in the hub cache). Only names are taken: a path (absolute, or
    climbing out) is an unknown model."""
    if not is_model_name(name):
        raise UnknownBaseModelError(name, model_dir)
    under_model_dir = model_dir / name
    shape = TINY_MODEL_SHAPES.get(name)
    source = GGUF_MODELS.get(name)
    if shape is not None:
        path = build_tiny_model(under_model_dir, shape)
    elif source is not None:
        path = build_gguf_model(name, under_model_dir, source)
    elif (under_model_dir / "config.json").is_file():
        return under_model_dir
    else:
        raise UnknownBaseModelError(name, model_dir)
    offer_to_hf_cache(name, path)
    return path


def prepare_builtin_models(model_dir: Path) -> None:
    """At a server's start: build the default built-in model, and lay out every built-in model
    already built in the Hugging Face cache, so clients can load them by name from then on."""
    resolve_base_model(TINY_CHAT, model_dir)
    for name in builtin_model_names():
        if (model_dir / name / "config.json").is_file():
            resolve_base_model(name, model_dir)
