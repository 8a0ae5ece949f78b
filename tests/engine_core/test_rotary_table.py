"""The decoder's rotary table (attention.RotaryTable) gives, bit for bit, the Rotary of transformers' rotary
embedding called on a pass's own positions, for the static rope types, across its growth; the dynamic rope
types get no table."""

from __future__ import annotations

import pytest
import torch
from decoder_parity import assert_decoder_logits_equal_transformers, decoder_of, run_forward
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from tinkerrpc_server.engine.compute.attention import Rotary, RotaryTable
from tinkerrpc_server.engine.runtime import BaseModelRuntime

pytestmark = pytest.mark.unit

SHAPE = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def embeddings() -> list[torch.nn.Module]:
    return [
        LlamaRotaryEmbedding(LlamaConfig(**SHAPE, rope_theta=100_000.0)),
        LlamaRotaryEmbedding(
            LlamaConfig(
                **SHAPE,
                rope_parameters={**LLAMA3, "rope_theta": 500_000.0, "original_max_position_embeddings": 256},
            )
        ),
        Qwen3RotaryEmbedding(Qwen3Config(**SHAPE, head_dim=32, rope_theta=1_000_000.0)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index", range(3))
def test_a_lookup_is_the_embeddings_own_call(index: int, dtype: torch.dtype) -> None:
    embedding = embeddings()[index]
    like = torch.zeros(1, dtype=dtype)
    table = RotaryTable.of(embedding, like)
    assert table is not None
    generator = torch.Generator().manual_seed(index)
    # A decode step's positions, then a left-padded prefill chunk's, then positions past the first table.
    for rows, length, bound in ((5, 1, 40), (3, 7, 64), (4, 1, 1000), (2, 3, 3000)):
        positions = torch.randint(0, bound, (rows, length), generator=generator)
        looked_up = table.rotary(positions, bound)
        called = Rotary.of(*embedding(like, positions))
        assert looked_up.cos.dtype == dtype
        assert torch.equal(looked_up.cos, called.cos) and torch.equal(looked_up.signed_sin, called.signed_sin)


def test_a_dynamic_rope_gets_no_table() -> None:
    config = LlamaConfig(
        **SHAPE, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10_000.0}
    )
    assert RotaryTable.of(LlamaRotaryEmbedding(config), torch.zeros(1)) is None


def test_the_decoder_takes_every_pass_s_rotary_from_its_table(
    runtime: BaseModelRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sampler's decoder looks each pass's rotary up (two prefill chunks and two decode steps: four
    lookups, the model's rotary embedding called only to fill the table), and its logits still equal
    transformers'."""
    lookups: list[int] = []
    real = RotaryTable.rotary

    def counted(table: RotaryTable, position_ids: torch.Tensor, bound: int) -> Rotary:
        lookups.append(bound)
        return real(table, position_ids, bound)

    monkeypatch.setattr(RotaryTable, "rotary", counted)
    run_forward(decoder_of(runtime, None), steps=2)
    assert len(lookups) == 4
    assert_decoder_logits_equal_transformers(runtime, None)
