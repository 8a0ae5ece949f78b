"""The RL options of `train()` that bring another policy in: a KL penalty against a reference and on-policy
distillation from a teacher, each naming a policy on the server (`PolicyRef`). Their ranges and what they
do to each sampled token are the contract's (tinkerrpc.contract.train_terms); checked here before any
call, and again by the server."""

from __future__ import annotations

from dataclasses import dataclass

from tinkerrpc.contract.limits import DEFAULT_DISTILLATION_COEFFICIENT
from tinkerrpc.contract.train_terms import IMPORTANCE_RATIO_CAP_RANGE, KL_COEFFICIENT_RANGE
from tinkerrpc.v1 import types_pb2 as pb


@dataclass(frozen=True)
class PolicyRef:
    """A policy the server can score tokens with; it must share the trained model's tokenizer. Make one
    with `PolicyRef.base(name)`, `PolicyRef.version(n)` or `PolicyRef.checkpoint(name)` (`model`: another
    model's; None: the trained model's)."""

    base_model: str | None = None
    policy_version: int | None = None
    checkpoint_name: str | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        given = [
            self.base_model is not None,
            self.policy_version is not None,
            self.checkpoint_name is not None,
        ]
        if sum(given) != 1:
            raise ValueError("a PolicyRef names exactly one of base_model, policy_version, checkpoint_name")
        if self.base_model is not None and (not self.base_model or self.model is not None):
            raise ValueError("PolicyRef.base(name) takes a non-empty base model name and no model")
        if self.policy_version is not None and self.policy_version < 0:
            raise ValueError(f"policy_version must be >= 0, got {self.policy_version}")
        if self.checkpoint_name == "":
            raise ValueError("checkpoint_name must not be empty")

    @classmethod
    def base(cls, base_model: str) -> PolicyRef:
        """A base model the server serves, without an adapter."""
        return cls(base_model=base_model)

    @classmethod
    def version(cls, policy_version: int, model: str | None = None) -> PolicyRef:
        """A model's policy at a version it can still sample (None: the trained model)."""
        return cls(policy_version=policy_version, model=model)

    @classmethod
    def checkpoint(cls, name: str, model: str | None = None) -> PolicyRef:
        """A model's named checkpoint (None: the trained model's)."""
        return cls(checkpoint_name=name, model=model)

    def to_proto(self) -> pb.PolicyReference:
        if self.base_model is not None:
            return pb.PolicyReference(base_model=self.base_model)
        if self.policy_version is not None:
            return pb.PolicyReference(
                version=pb.PolicyVersionReference(model=self.model or "", policy_version=self.policy_version)
            )
        return pb.PolicyReference(
            checkpoint=pb.CheckpointReference(model=self.model or "", name=self.checkpoint_name or "")
        )


def _check_coefficient(name: str, value: float) -> None:
    if value not in KL_COEFFICIENT_RANGE:
        raise ValueError(f"{name} must be a finite number {KL_COEFFICIENT_RANGE.rule()}, got {value}")


@dataclass(frozen=True)
class KLPenalty:
    """Each sampled token's advantage gains coefficient·(m − d), d = sampler − reference logprob and m its
    mean over the step (tinker-cookbook's and ART's form); reference None: the model's base model."""

    coefficient: float
    reference: PolicyRef | None = None

    def __post_init__(self) -> None:
        _check_coefficient("KLPenalty.coefficient", self.coefficient)

    def to_proto(self) -> pb.KLPenalty:
        return pb.KLPenalty(
            coefficient=self.coefficient,
            reference=self.reference.to_proto() if self.reference is not None else None,
        )


@dataclass(frozen=True)
class Distillation:
    """On-policy distillation: each sampled token's advantage gains coefficient·(teacher − sampler logprob)."""

    teacher: PolicyRef
    coefficient: float = DEFAULT_DISTILLATION_COEFFICIENT

    def __post_init__(self) -> None:
        _check_coefficient("Distillation.coefficient", self.coefficient)

    def to_proto(self) -> pb.Distillation:
        return pb.Distillation(teacher=self.teacher.to_proto(), coefficient=self.coefficient)


def check_importance_ratio_cap(cap: float | None) -> None:
    if cap is not None and cap not in IMPORTANCE_RATIO_CAP_RANGE:
        raise ValueError(
            f"importance_ratio_cap must be a finite number {IMPORTANCE_RATIO_CAP_RANGE.rule()}, got {cap}"
        )
