"""The built-in tiny models, generated deterministically from a seed with no model hub: a byte-level BPE
tokenizer trained on a synthetic chat corpus (the yes / no / maybe task's answers and generic English)
with Qwen3's chat markers, and a random Qwen3 model of a TinyModelShape."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tinkerrpc_server.model_store.layout import build_once
from tinkerrpc_server.model_store.names import TINY_CHAT, TINY_MODEL_SHAPES, TinyModelShape
from tinkerrpc_server.recipes.yes_no_maybe.task import ANSWERS as ANSWER_WORDS

RECIPE_SEED = 1234
TOKENIZER_VOCAB_TARGET = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Not special (they show up in decoded text) but single tokens, as in Qwen3, so that
# tinker-cookbook's qwen3 renderer can frame thinking and tool calls.
ADDED_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

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


def build_tiny_model(
    path: Path, shape: TinyModelShape = TINY_MODEL_SHAPES[TINY_CHAT], *, seed: int = RECIPE_SEED
) -> Path:
    """Write the tiny-chat recipe (tokenizer + random Qwen3 model of `shape`) to `path` unless it is there."""

    def write(directory: Path) -> None:
        tokenizer = _build_tokenizer(seed)
        tokenizer.save_pretrained(directory)
        _build_model(directory, tokenizer, shape, seed)

    return build_once(path, write)


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
