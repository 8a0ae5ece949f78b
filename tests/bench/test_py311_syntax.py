"""bench/py311_syntax.py: ART 0.5.23's 3.12-only syntax rewritten to 3.11, checked by running the result."""

from __future__ import annotations

import typing

import pytest

from bench.py311_syntax import parse_type_params, rewrite_source

pytestmark = pytest.mark.unit


def run(source: str) -> dict[str, typing.Any]:
    namespace: dict[str, typing.Any] = {}
    exec(compile(rewrite_source(source), "<test>", "exec"), namespace)
    return namespace


def test_generic_functions_keep_their_lines_decorators_and_bounds() -> None:
    source = (
        "import functools\n"
        "@functools.lru_cache\n"
        "def first[T](items: tuple[T, ...]) -> T:\n"
        "    return items[0]\n"
        "class Box:\n"
        "    async def get[ValueT: int, *Ts, **P](\n"
        "        self, value: ValueT\n"
        "    ) -> ValueT:\n"
        "        return value\n"
        "line = __import__('sys')._getframe().f_lineno\n"
    )
    namespace = run(source)
    assert namespace["first"]((3, 4)) == 3
    assert namespace["first"].cache_info().currsize == 1, "the decorator still wraps the function"
    t = namespace["T"]
    assert isinstance(t, typing.TypeVar) and t.__name__ == "T"
    box = namespace["Box"]
    assert isinstance(box.ValueT, typing.TypeVar), "a method's parameters are bound in its class"
    assert box.ValueT.__bound__ == typing.ForwardRef("int"), "the bound stays lazy"
    assert isinstance(box.Ts, typing.TypeVarTuple) and isinstance(box.P, typing.ParamSpec)
    # Two lines added: the import and T before the decorator; then the import and three in the class.
    assert namespace["line"] == 10 + 2 + 4


def test_generic_classes_get_generic_as_last_positional_base() -> None:
    namespace = run(
        "class Meta(type): pass\n"
        "class A[T]: pass\n"
        "class B[K, V](dict, metaclass=Meta): pass\n"
        "class C[T](A[T],): pass\n"
        "class D[T](): pass\n"
    )
    a, b, c, d = (namespace[name] for name in "ABCD")
    assert a[int].__origin__ is a and [p.__name__ for p in a.__parameters__] == ["T"]
    assert type(b) is namespace["Meta"] and dict in b.__mro__
    assert [p.__name__ for p in b.__parameters__] == ["K", "V"]
    assert a in c.__mro__ and d.__parameters__ == (namespace["T"],), "D's T is the last one bound"


def test_type_aliases_stay_on_their_line_and_substitute() -> None:
    namespace = run(
        "from typing import Annotated\n"
        "type Pair = tuple[int, int]\n"
        "type Tagged[T] = Annotated[list[T], 'tag']\n"
        "type Tree = int | list['Tree']\n"
        "type = 5\n"
        "line = __import__('sys')._getframe().f_lineno\n"
    )
    assert namespace["Pair"] == tuple[int, int]
    assert namespace["Tagged"][str] == typing.Annotated[list[str], "tag"]
    assert namespace["Tree"] == int | list["Tree"]  # noqa: F821 (a forward reference, as in the alias)
    assert namespace["type"] == 5, "`type` as a plain name is left alone"
    assert namespace["line"] == 6


def test_parameters_parse_bounds_constraints_and_star_forms() -> None:
    params = parse_type_params("T, U: dict[str, int], V: (int, str), *Ts, **P")
    assert [(p.name, p.kind, p.bound, p.constraints) for p in params] == [
        ("T", "TypeVar", None, ()),
        ("U", "TypeVar", "dict[str, int]", ()),
        ("V", "TypeVar", None, ("int", "str")),
        ("Ts", "TypeVarTuple", None, ()),
        ("P", "ParamSpec", None, ()),
    ]
    with pytest.raises(SyntaxError, match="default"):
        parse_type_params("T = int")


def test_what_is_left_unparseable_is_a_syntax_error() -> None:
    with pytest.raises(SyntaxError):
        rewrite_source('x = {"a": 1}\ny = f"{x["a"]}"\n')


def test_typing_imports_of_3_12_names_come_from_typing_extensions() -> None:
    namespace = run("from typing import (\n    Any,\n    override,\n)\nfrom typing import cast\n")
    assert namespace["override"].__module__ == "typing_extensions" and namespace["Any"] is typing.Any
    assert rewrite_source("from typing import cast\n") == "from typing import cast\n", "3.11's names left"
