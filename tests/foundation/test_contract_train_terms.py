"""The per-token terms table (tinkerrpc.contract.train_terms) is what every layer takes: each row names a
real gRPC field and SDK option, the server's validation and the SDK's checks accept exactly the table's
ranges, and the docs page holds the table."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import pytest

from tinkerrpc import Distillation, KLPenalty, PolicyRef
from tinkerrpc import _calls as calls
from tinkerrpc._train_terms import check_importance_ratio_cap
from tinkerrpc.contract import limits, train_terms_markdown
from tinkerrpc.contract.train_terms import (
    CAPPABLE_LOSSES,
    IMPORTANCE_RATIO_CAP_RANGE,
    KL_COEFFICIENT_RANGE,
    TRAIN_TERMS,
)
from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service.errors import Violations
from tinkerrpc_server.service.train_options import check_train_terms

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = {"TrainRequest": pb.TrainRequest, "SampledTurn": types_pb2.SampledTurn}


def test_each_row_names_a_grpc_field_and_an_sdk_option() -> None:
    train_keywords = set(inspect.signature(calls.train).parameters)
    for term in TRAIN_TERMS:
        message, field = term.grpc.split(" ")[0].split(".")
        assert field in MESSAGES[message].DESCRIPTOR.fields_by_name, term.grpc
        assert term.name in train_keywords or term.name == term.grpc, term.name


def test_the_docs_page_holds_the_table() -> None:
    assert train_terms_markdown().count("\n| `") == len(TRAIN_TERMS)
    assert "<!-- contract:train_terms -->" in (ROOT / "docs" / "reference" / "limits.md").read_text()


def _server_refuses(request: pb.TrainRequest) -> list[str]:
    violations = Violations()
    check_train_terms(violations, request)
    return [field for field, _ in violations.items]


def _kl(coefficient: float) -> pb.TrainRequest:
    request = pb.TrainRequest()
    request.groups.add()
    request.kl_penalty.coefficient = coefficient
    return request


def _cap(cap: float, loss: int = types_pb2.LOSS_FUNCTION_IMPORTANCE_SAMPLING) -> pb.TrainRequest:
    request = pb.TrainRequest(importance_ratio_cap=cap)
    request.groups.add()
    request.loss.function = loss  # type: ignore[assignment]
    return request


@pytest.mark.parametrize("coefficient", [limits.MAX_KL_COEFFICIENT, 1e-9, 0.0, -1.0, math.nan, 100.0001])
def test_the_coefficients_range_is_the_tables_on_the_server_and_in_the_sdk(coefficient: float) -> None:
    inside = coefficient in KL_COEFFICIENT_RANGE
    assert inside == (0 < coefficient <= limits.MAX_KL_COEFFICIENT)
    assert (_server_refuses(_kl(coefficient)) == []) == inside
    for make in (lambda: KLPenalty(coefficient), lambda: Distillation(PolicyRef.base("m"), coefficient)):
        if inside:
            make()
        else:
            with pytest.raises(ValueError, match="coefficient"):
                make()


@pytest.mark.parametrize("cap", [1.0, 2.0, 1e3, 0.999, 1000.5, math.inf])
def test_the_caps_range_is_the_tables_on_the_server_and_in_the_sdk(cap: float) -> None:
    inside = cap in IMPORTANCE_RATIO_CAP_RANGE
    assert (_server_refuses(_cap(cap)) == []) == inside
    if inside:
        check_importance_ratio_cap(cap)
    else:
        with pytest.raises(ValueError, match="importance_ratio_cap"):
            check_importance_ratio_cap(cap)


def test_a_cap_applies_to_the_tables_losses_only() -> None:
    for loss in types_pb2.LossFunction.values():
        name = types_pb2.LossFunction.Name(loss).removeprefix("LOSS_FUNCTION_").lower()
        if name in ("unspecified", "cross_entropy"):
            continue
        assert (_server_refuses(_cap(2.0, loss)) == []) == (name in CAPPABLE_LOSSES), name


def test_the_distillation_default_is_the_tables() -> None:
    assert Distillation(PolicyRef.base("m")).coefficient == limits.DEFAULT_DISTILLATION_COEFFICIENT
    assert Distillation(PolicyRef.version(3)).to_proto().teacher.version.policy_version == 3
    assert KLPenalty(0.5).to_proto().HasField("reference") is False
