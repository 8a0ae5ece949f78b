"""The model list's cards: openai's Model with vLLM's and the RL fields."""

from __future__ import annotations

from typing import Literal

from openai.types.model import Model
from pydantic import BaseModel


class ModelCard(Model):
    # openai's Model also declares shutdown_date, so every card carries a null one.
    object: Literal["model"] = "model"
    owned_by: str = "tinkerrpc"
    parent: str
    root: str
    max_model_len: int | None
    policy_version: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
