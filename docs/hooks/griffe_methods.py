"""griffe extension (mkdocstrings): the SDK's table-made methods, documented as the methods they are.

`client/tinkerrpc/_methods.py` writes each client and model method once, as a class attribute such as
`sample = Method(on_model(calls.sample))`, and makes it a real function per transport at run time.
Read statically (no import, so building the docs never imports the SDK's optional dependencies), such
an attribute has no signature or docstring. This extension replaces each one with a method whose
signature and docstring are those of the `_calls` function it wraps: `on_model` bodies lose their
first parameter (the model's name, which the handle supplies), and `Call[T]` results are shown as `T`.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

# `name = Method(on_model(calls.sample))`, `Watch(...)`, `OpensModel(on_client(calls.create_model))`
_TABLE_ENTRY = re.compile(r"(Method|Watch|OpensModel)\((on_model|on_client)\(calls\.(\w+)\)\)")
_RESULT_WRAPPERS = ("Call[", "StreamCall[", "WatchCall[")


class MethodTable(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != "tinkerrpc":
            return
        calls = pkg["_calls"]
        methods = pkg["_methods"]
        for cls in methods.classes.values():
            for name, member in list(cls.members.items()):
                if not isinstance(member, griffe.Attribute) or member.value is None:
                    continue
                entry = _TABLE_ENTRY.fullmatch(str(member.value))
                if entry is not None:
                    kind, owner, function = entry.groups()
                    cls.set_member(name, _method(name, calls[function], kind, owner == "on_model", member))


def _method(
    name: str, prepared: griffe.Function, kind: str, on_model: bool, attribute: griffe.Attribute
) -> griffe.Function:
    parameters = list(prepared.parameters)[1:] if on_model else list(prepared.parameters)
    self_parameter = griffe.Parameter("self", kind=griffe.ParameterKind.positional_or_keyword)
    method = griffe.Function(
        name,
        parameters=griffe.Parameters(self_parameter, *parameters),
        returns=_result(prepared.returns, kind),
        docstring=prepared.docstring,
        lineno=attribute.lineno,
        endlineno=attribute.endlineno,
    )
    method.labels.add("method")
    return method


def _result(returns: Any, kind: str) -> Any:
    """What the method returns to its caller: a Call's value; a model handle for `create_model`."""
    if kind == "OpensModel":
        return "Model"
    text = str(returns)
    for wrapper in _RESULT_WRAPPERS:
        if text.startswith(wrapper) and text.endswith("]"):
            return text.removeprefix(wrapper).removesuffix("]")
    return returns
