"""The model list's cards: OpenAI's Model shape (`openai_shapes`) with vLLM's and the RL fields."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from tinkerrpc_server.sidecar.openai_shapes import Model


class ModelCard(Model):
    # OpenAI's Model also declares shutdown_date, so every card carries a null one.
    object: Literal["model"] = "model"
    owned_by: str = "tinkerrpc"
    parent: str
    root: str
    max_model_len: int | None
    policy_version: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
