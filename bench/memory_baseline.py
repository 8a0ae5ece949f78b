"""The memory baseline: what a one-process script does instead of the demo's stack. It loads tiny-chat
with the demo's LoRA (rank 8, attention + MLP + unembedding), takes supervised steps on demo-sized
batches, and samples demo-sized groups with generate(). Run by bench/memory.py, which samples its PSS."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tinkerrpc_server.model_store import TINY_CHAT, resolve_base_model
from tinkerrpc_server.recipes.yes_no_maybe.recipe import YesNoMaybeRecipe
from tinkerrpc_server.recipes.yes_no_maybe.task import prompts as yes_no_maybe_prompts

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    demo = YesNoMaybeRecipe(out_dir=Path("unused"))
    path = resolve_base_model(TINY_CHAT, args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        LoraConfig(
            r=demo.lora_rank, lora_alpha=demo.lora_rank, lora_dropout=0.0, target_modules=LORA_TARGETS
        ),
    )
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=demo.sft_learning_rate
    )
    prompts = yes_no_maybe_prompts()
    for step in range(args.steps):
        conversations = [
            [{"role": "user", "content": prompts[(step * demo.sft_batch + i) % len(prompts)]},
             {"role": "assistant", "content": "maybe"}]
            for i in range(demo.sft_batch)
        ]  # fmt: skip
        batch = tokenizer.apply_chat_template(
            conversations, padding=True, return_tensors="pt", return_dict=True, tokenize=True
        )
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        model(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokenizer.padding_side = "left"
        group = tokenizer.apply_chat_template(
            [[{"role": "user", "content": p}] for p in prompts[: demo.rl_prompts_per_step]],
            add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True, tokenize=True,
        )  # fmt: skip
        tokenizer.padding_side = "right"
        with torch.no_grad():
            model.generate(
                **group, do_sample=True, top_k=0, top_p=1.0, max_new_tokens=demo.max_tokens,
                num_return_sequences=demo.rl_samples_per_prompt, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
    print(f"memory baseline: {args.steps} SFT + sampling steps done")


if __name__ == "__main__":
    main()
