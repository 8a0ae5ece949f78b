"""The installed tinker SDK's public surface, enumerated by introspection, and what a registry entry is.

A row is one thing a user can call or set:

- `Client.method`: a public method of one of the five clients. `method_async` is the same row as
  `method` (the SDK's sync call runs the async one on its own loop); `sync_async_mismatches` names any
  pair whose parameters differ, so an option added to one variant only cannot hide behind the other.
  An `_async` method with no sync twin is a row of its own.
- `Client.method(param)`: a parameter of that method; `Client(param)` one of a client's constructor
  (the clients users construct themselves: ServiceClient, RestClient, AdminClient).
- `Client.method(param='value')`: one value of a parameter typed as a Literal of two or more values
  (the losses of `forward_backward`, the `kind` of a sampling client...).
- `Type` and `Type.field`: a request type the methods take (a class `tinker.types` exports, found by
  walking the parameters' annotations, with its subclasses: `DimuonParams` is an `OptimParamsBase`)
  and each field of its constructor; `Type.field='value'` as above. A base class whose subclasses are
  rows is not one itself (a user builds the subclass).

The registry (`sdk_registry.py`, its rows in `sdk_surface_rows.py` and `sdk_surface_types.py`) maps
each row to the tests that exercise it against a real engine; `tests/foundation/test_sdk_surface.py`
fails on a row without an entry, so the next SDK release's additions show up as failing tests.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import sys
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pydantic
import tinker
import tinker.types

CLIENTS = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient", "AdminClient")
ASYNC = "_async"
TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent

Status = Literal["works", "refused"]


@dataclass(frozen=True)
class Entry:
    """What the engine does with one row, and the tests (node ids from the repository root, without a
    parametrize suffix) that show it with the unmodified SDK against a real engine."""

    status: Status
    tests: tuple[str, ...]
    note: str = ""


def _namespace() -> dict[str, Any]:
    """Every name the SDK's modules define: its annotations are strings naming them."""
    names: dict[str, Any] = dict(vars(typing))
    for module_name, module in list(sys.modules.items()):
        if module is not None and (module_name == "tinker" or module_name.startswith("tinker.")):
            names.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
    return names


def _resolve(annotation: Any, names: dict[str, Any]) -> Any:
    if isinstance(annotation, str):
        try:
            return eval(annotation, names)
        except Exception:  # a TYPE_CHECKING-only name (torch, transformers): not a request type
            return None
    return annotation


def _literal_values(annotation: Any) -> tuple[Any, ...]:
    """The values of a Literal annotation (through Optional and Annotated), or ()."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return typing.get_args(annotation)
    if origin is typing.Annotated:
        return _literal_values(typing.get_args(annotation)[0])
    if origin in (typing.Union, __import__("types").UnionType):
        values: tuple[Any, ...] = ()
        for arg in typing.get_args(annotation):
            values += _literal_values(arg)
        return values
    return ()


_EXPORTED = {id(v) for v in vars(tinker.types).values() if isinstance(v, type)}


def _is_sdk_model(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "tinker" and (
        issubclass(cls, pydantic.BaseModel) or dataclasses.is_dataclass(cls)
    )


def _is_request_type(cls: type) -> bool:
    return id(cls) in _EXPORTED and _is_sdk_model(cls)


def _classes_in(annotation: Any) -> Iterator[type]:
    """The SDK's model classes an annotation names (an unexported base among them: its subclasses
    are what a user builds)."""
    if isinstance(annotation, type):
        if _is_sdk_model(annotation):
            yield annotation
        return
    if typing.get_origin(annotation) is Literal:
        return
    for arg in typing.get_args(annotation):
        yield from _classes_in(arg)


def public_methods(cls: type) -> dict[str, Any]:
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if not name.startswith("_") and callable(member) and not isinstance(member, type)
    }


def _parameters(function: Any) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(function).parameters.values() if p.name not in ("self", "cls")]


def _constructor(cls: type) -> list[inspect.Parameter]:
    """A client users construct themselves (no required parameter): its public keyword options."""
    parameters = [p for p in _parameters(cls.__init__) if p.kind is not p.VAR_KEYWORD]
    if any(p.default is p.empty for p in parameters):
        return []  # made by another client (a holder is required)
    return [p for p in parameters if not p.name.startswith("_")]


def _method_rows() -> Iterator[tuple[str, list[inspect.Parameter]]]:
    for client in CLIENTS:
        constructor = _constructor(getattr(tinker, client))
        if constructor:
            yield client, constructor
        methods = public_methods(getattr(tinker, client))
        for name, function in methods.items():
            if name.endswith(ASYNC) and name.removesuffix(ASYNC) in methods:
                continue
            yield f"{client}.{name}", _parameters(function)


def required_parameters() -> set[str]:
    """The `Client.method(param)` rows of parameters without a default."""
    return {
        f"{method}({p.name})"
        for method, parameters in _method_rows()
        for p in parameters
        if p.default is p.empty
    }


def sync_async_mismatches() -> list[str]:
    """`Client.method` pairs whose sync and async variants take different parameters."""
    found = []
    for client in CLIENTS:
        methods = public_methods(getattr(tinker, client))
        for name, function in methods.items():
            twin = methods.get(f"{name}{ASYNC}")
            if twin is None:
                continue
            sync = [(p.name, p.kind, p.default) for p in _parameters(function)]
            if sync != [(p.name, p.kind, p.default) for p in _parameters(twin)]:
                found.append(f"{client}.{name}")
    return found


def _value_rows(prefix: str, annotation: Any, suffix: str = "") -> list[str]:
    values = _literal_values(annotation)
    return [f"{prefix}={value!r}{suffix}" for value in values] if len(values) > 1 else []


def _fields(cls: type) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(cls).parameters.values() if p.kind is not p.VAR_KEYWORD]


def _request_types(roots: set[type], names: dict[str, Any]) -> list[type]:
    seen: dict[type, None] = {}
    todo = list(roots)
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen[cls] = None
        todo.extend(sub for sub in cls.__subclasses__() if _is_sdk_model(sub))
        if not _is_request_type(cls):
            continue  # an unexported base or handle (LossHandle): the SDK fills its fields, not users
        for field in _fields(cls):
            todo.extend(_classes_in(_resolve(field.annotation, names)))
    return sorted((c for c in seen if _is_request_type(c)), key=lambda c: c.__name__)


def surface() -> list[str]:
    """Every row of the installed SDK, in a stable order: methods with their options, then types."""
    names = _namespace()
    rows: list[str] = []
    roots: set[type] = set()
    for method, parameters in sorted(_method_rows(), key=lambda m: (CLIENTS.index(m[0].split(".")[0]), m[0])):
        rows.append(method)
        for parameter in parameters:
            annotation = _resolve(parameter.annotation, names)
            rows.append(f"{method}({parameter.name})")
            rows.extend(_value_rows(f"{method}({parameter.name}", annotation, ")"))
            roots.update(_classes_in(annotation))
    for cls in _request_types(roots, names):
        if any(_is_request_type(sub) for sub in cls.__subclasses__()):
            continue  # a base: its subclasses are the rows
        rows.append(cls.__name__)
        for field in _fields(cls):
            annotation = _resolve(field.annotation, names)
            if len(_literal_values(annotation)) == 1:
                continue  # a discriminator (`type`): the class's own row covers it
            rows.append(f"{cls.__name__}.{field.name}")
            rows.extend(_value_rows(f"{cls.__name__}.{field.name}", annotation))
    return rows


@functools.cache
def test_functions(path: Path) -> frozenset[str]:
    """The test functions a test module defines (`test_x`, `TestClass::test_x`), read from its source."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            found.add(node.name)
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.name.startswith("test"):
                    found.add(f"{node.name}::{item.name}")
    return frozenset(found)


def missing_tests(node_ids: set[str]) -> list[str]:
    """The node ids that name no test function in the repository's test files."""
    missing = []
    for node_id in sorted(node_ids):
        path, _, function = node_id.partition("::")
        file = REPO / path
        if not (path.startswith("tests/") and file.is_file() and function in test_functions(file)):
            missing.append(node_id)
    return missing
