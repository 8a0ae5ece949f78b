"""The contract's values are written once: no module of the SDK or the server assigns one of its names
again, the protos name only the bounds it defines, the ART backend passes every Train config key, and the
docs' tables (generated from it by docs/hooks/contract.py) have a row per entry. Checks on the source
text; tests/foundation/test_contract.py and test_contract_sidecar.py check each layer's behaviour against
the tables."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from tinkerrpc import _calls as calls
from tinkerrpc import contract
from tinkerrpc.contract import limits, limits_markdown, losses_markdown, sampling_options_markdown
from tinkerrpc.contract.losses import LOSSES, TRAIN_CONFIG_KEYS
from tinkerrpc.contract.sampling import SAMPLING_OPTIONS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _contract_values() -> set[str]:
    """The names of the contract's numbers and strings: its bounds, defaults and constants."""
    modules = (limits, contract.losses, contract.sampling)
    return {
        name
        for module in modules
        for name, value in vars(module).items()
        if re.fullmatch(r"[A-Z][A-Z0-9_]+", name) and isinstance(value, (int, float, str))
    }


def test_no_module_defines_a_contract_value_again() -> None:
    """A module-level assignment to one of the contract's names elsewhere is a second definition of its
    value (one that importing the contract's would have replaced)."""
    names = _contract_values()
    assert {"DEFAULT_LORA_RANK", "SIDECAR_CHAT_MAX_TOKENS", "DEFAULT_RL_LOSS"} <= names
    redefined = []
    for package in (ROOT / "client" / "tinkerrpc", ROOT / "server" / "tinkerrpc_server"):
        for path in sorted(package.rglob("*.py")):
            if {"contract", "v1"} & set(path.relative_to(package).parts):
                continue
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, ast.AnnAssign):
                    targets = [node.target]
                else:
                    continue
                redefined += [
                    f"{path.relative_to(ROOT)}: {target.id}"
                    for target in targets
                    if isinstance(target, ast.Name) and target.id in names
                ]
    assert redefined == []


def test_the_protos_name_only_bounds_the_contract_defines() -> None:
    named = set()
    for proto in (ROOT / "protos").rglob("*.proto"):
        named |= set(
            re.findall(r"\b(?:(?:MAX|MIN|DEFAULT)_[A-Z0-9_]+|[A-Z0-9_]+_EPSILON)\b", proto.read_text())
        )
    assert {"MAX_TOP_LOGPROBS", "ADVANTAGE_STD_EPSILON"} <= named
    assert sorted(name for name in named if not hasattr(limits, name)) == []


def test_the_art_backend_passes_every_train_config_key() -> None:
    source = (ROOT / "client" / "tinkerrpc" / "art" / "_backend.py").read_text()
    train_calls = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "train"
    ]
    assert len(train_calls) == 1
    passed = {keyword.arg for keyword in train_calls[0].keywords}
    assert {key.train_field for key in TRAIN_CONFIG_KEYS} <= passed
    assert passed <= set(inspect.signature(calls.train).parameters)
    assert "loss_fn: RLLossName" in source


def test_the_docs_tables_have_a_row_per_entry() -> None:
    assert limits_markdown().count("\n| `") == len(limits.LIMITS) + len(limits.SERVER_FLAGS)
    assert losses_markdown().count("\n| `") == len(LOSSES)
    assert sampling_options_markdown().count("\n| `") == len(SAMPLING_OPTIONS)
    reference = (ROOT / "docs" / "reference" / "limits.md").read_text()
    for table in ("limits", "losses", "sampling"):
        assert f"<!-- contract:{table} -->" in reference
