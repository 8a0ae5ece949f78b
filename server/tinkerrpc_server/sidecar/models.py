"""`GET /v1/models` and `/v1/models/{id}`, and what a requested model id means everywhere.

A model id is `name` (the latest policy version) or `name@N` (pinned policy version N); responses
echo `name@N` for the version that sampled them, and the model list names both forms.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from fastapi import APIRouter

from tinkerrpc import ModelInfo
from tinkerrpc_server.sidecar.errors import model_not_found
from tinkerrpc_server.sidecar.models_protocol import ModelCard, ModelList

_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# ASCII digits only (`str.isdigit` also takes superscripts and other scripts' digits, which `int()`
# refuses or reads as a different number).
_POLICY_VERSION = re.compile(r"[0-9]+")
# Policy versions are int64 on the wire: a longer number names no version that can exist.
_MAX_VERSION = 2**63 - 1


@dataclass(frozen=True)
class ModelRef:
    """A requested model id: `name` (latest version) or `name@N` (pinned policy version N)."""

    requested: str
    name: str
    version: int | None

    def served_id(self, produced_version: int) -> str:
        return f"{self.name}@{produced_version}"


def parse_model_id(model: str) -> ModelRef:
    name, at, version_text = model.partition("@")
    if not _MODEL_NAME.fullmatch(name):
        raise model_not_found(model, "model ids are `name` or `name@<policy version>`")
    if not at:
        return ModelRef(model, name, None)
    if not _POLICY_VERSION.fullmatch(version_text):
        raise model_not_found(
            model, f"`{version_text}` is not a policy version (a non-negative integer in ASCII digits)"
        )
    # Bounded before int(): a version of thousands of digits is refused without converting it.
    if len(version_text) > len(str(_MAX_VERSION)) or int(version_text) > _MAX_VERSION:
        raise model_not_found(
            model, f"no policy version {version_text} (versions are at most {_MAX_VERSION})"
        )
    return ModelRef(model, name, int(version_text))


def model_cards(models: Sequence[ModelInfo]) -> ModelList:
    """Each model as `name` (its latest version) and `name@N` for every sampleable version."""
    cards: list[ModelCard] = []
    for info in models:
        created = int(info.create_time.timestamp()) if info.create_time is not None else 0
        max_len = info.max_context_length or None
        cards.append(
            ModelCard(
                id=info.name,
                created=created,
                parent=info.base_model,
                root=info.base_model,
                max_model_len=max_len,
                policy_version=info.policy_version,
            )
        )
        cards.extend(
            ModelCard(
                id=f"{info.name}@{version}",
                created=created,
                parent=info.name,
                root=info.base_model,
                max_model_len=max_len,
                policy_version=version,
            )
            for version in info.sampleable_versions
        )
    return ModelList(data=cards)


def find_card(cards: ModelList, model_id: str) -> ModelCard:
    for card in cards.data:
        if card.id == model_id:
            return card
    raise model_not_found(model_id, "no such model or sampleable version")


def create_router(fetch_models: Callable[[], Awaitable[Sequence[ModelInfo]]]) -> APIRouter:
    """The model routes over the app's `fetch_models` (which maps gRPC errors)."""
    router = APIRouter()

    @router.get("/v1/models")
    async def list_models() -> ModelList:
        return model_cards(await fetch_models())

    @router.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        return find_card(model_cards(await fetch_models()), model_id)

    return router
