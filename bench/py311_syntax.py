"""Rewrites the Python 3.12-only syntax of a source file to Python 3.11, so that a package requiring 3.12
(ART 0.5.20+) can be imported here, where 3.12 cannot be installed (bench/art_0_5_23.py).

What it rewrites, and to what:

- PEP 695 type parameters, `def f[T: Bound](...)`, `async def`, `class C[T](Base)`: the bracket goes, and
  each parameter becomes a `typing` variable bound in the same scope just before the statement (before its
  decorators): `T = typing.TypeVar("T", bound="Bound")` (a bound or constraints as strings, so they stay
  lazy as PEP 695 keeps them), `*Ts` a TypeVarTuple, `**P` a ParamSpec; a class also gets
  `typing.Generic[...]` as its last positional base.
- PEP 695 aliases, `type X[T] = value`: `X = value` on the same line (its parameters bound before it on
  that line), evaluated at once where 3.12 evaluates lazily.

- `from typing import ...` naming what 3.11's typing lacks (`override`): from typing_extensions, which
  has every name typing has.

PEP 701 f-strings (a field holding the f-string's own quote, a backslash or a comment) are not rewritten:
ART 0.5.23 has none. What is left that 3.11 cannot parse is named by the compile check below.

The result is checked by compiling it on this interpreter; `rewrite_source` raises SyntaxError naming
what is left. Line numbers are kept wherever no parameter is bound on a line of its own.
"""

from __future__ import annotations

import io
import tokenize
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass

TYPING = "_pep695_typing"
_IMPORT = f"import typing as {TYPING}"


def rewrite_source(source: str, filename: str = "<source>") -> str:
    """The source with its 3.12-only syntax rewritten; SyntaxError if the result still does not compile."""
    rewritten = rewrite_type_params(source)
    compile(rewritten, filename, "exec", dont_inherit=True)
    return rewritten


@dataclass(frozen=True)
class TypeParam:
    """One PEP 695 parameter: `T`, `T: bound`, `T: (a, b)`, `*Ts` or `**P`."""

    name: str
    kind: str  # "TypeVar", "TypeVarTuple" or "ParamSpec"
    bound: str | None = None
    constraints: tuple[str, ...] = ()

    def definition(self) -> str:
        arguments = [repr(self.name)]
        if self.bound is not None:
            arguments.append(f"bound={self.bound!r}")
        arguments.extend(repr(c) for c in self.constraints)
        return f"{self.name} = {TYPING}.{self.kind}({', '.join(arguments)})"


def parse_type_params(text: str) -> list[TypeParam]:
    """The parameters of a PEP 695 bracket's inside, e.g. `T: int, *Ts, **P`."""
    params = []
    for item in _split_top_level(text, ","):
        item = " ".join(item.split())
        if not item:
            continue
        if item.startswith("**"):
            params.append(TypeParam(item[2:].strip(), "ParamSpec"))
        elif item.startswith("*"):
            params.append(TypeParam(item[1:].strip(), "TypeVarTuple"))
        elif ":" in item:
            name, bound = (part.strip() for part in item.split(":", 1))
            if bound.startswith("(") and bound.endswith(")"):
                constraints = tuple(c.strip() for c in _split_top_level(bound[1:-1], ",") if c.strip())
                params.append(TypeParam(name, "TypeVar", constraints=constraints))
            else:
                params.append(TypeParam(name, "TypeVar", bound=bound))
        else:
            params.append(TypeParam(item, "TypeVar"))
    for param in params:
        if not param.name.isidentifier() or "=" in param.name:
            raise SyntaxError(f"type parameter {param.name!r} is not supported (a 3.13 default?)")
    return params


def _split_top_level(text: str, separator: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == separator and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return parts


@dataclass
class _Edit:
    start: int  # offsets into the source
    end: int
    text: str


def rewrite_type_params(source: str) -> str:
    """PEP 695 parameter lists and `type` statements rewritten (see the module's docstring)."""
    line_starts = [0]
    for line in source.splitlines(keepends=True):
        line_starts.append(line_starts[-1] + len(line))

    def offset(position: tuple[int, int]) -> int:
        return line_starts[position[0] - 1] + position[1]

    edits: list[_Edit] = []
    for statement, decorated_from in _logical_lines(source):
        names = [t.string for t in statement if t.type == tokenize.NAME]
        first = statement[0]
        if [t.string for t in statement[:3]] == ["from", "typing", "import"]:
            imported = {t.string for t in statement[3:] if t.type == tokenize.NAME} - {"as"}
            if any(not hasattr(typing, name) for name in imported):
                edits.append(_Edit(offset(statement[1].start), offset(statement[1].end), "typing_extensions"))
            continue
        if len(statement) > 2 and first.string == "type" and statement[1].type == tokenize.NAME:
            if statement[2].string not in ("=", "["):
                continue
            params: list[TypeParam] = []
            value_from = 2
            if statement[2].string == "[":
                close = _matching_bracket(statement, 2)
                params = parse_type_params(source[offset(statement[2].end) : offset(statement[close].start)])
                value_from = close + 1
            prefix = "".join(f"{p.definition()}; " for p in params)
            head = f"{_IMPORT}; {prefix}" if params else ""
            edits.append(
                _Edit(
                    offset(first.start), offset(statement[value_from].start), f"{head}{statement[1].string} "
                )
            )
            continue
        keyword_at = 1 if names[:1] == ["async"] else 0
        if len(statement) <= keyword_at + 2 or statement[keyword_at].string not in ("def", "class"):
            continue
        bracket = keyword_at + 2
        if statement[bracket].string != "[":
            continue
        close = _matching_bracket(statement, bracket)
        params = parse_type_params(source[offset(statement[bracket].end) : offset(statement[close].start)])
        indent = " " * decorated_from.start[1]
        definitions = "".join(f"{indent}{p.definition()}\n" for p in params)
        at = offset((decorated_from.start[0], 0))
        edits.append(_Edit(at, at, f"{indent}{_IMPORT}\n{definitions}"))
        generic = f"{TYPING}.Generic[{', '.join(_unpacked(p) for p in params)}]"
        if statement[keyword_at].string == "def":
            edits.append(_Edit(offset(statement[bracket].start), offset(statement[close].end), ""))
        elif statement[close + 1].string == "(":
            edits.append(_Edit(offset(statement[bracket].start), offset(statement[close].end), ""))
            edits.append(_class_base_edit(statement, close + 1, generic, offset))
        else:
            edits.append(
                _Edit(offset(statement[bracket].start), offset(statement[close].end), f"({generic})")
            )
    for edit in sorted(edits, key=lambda e: e.start, reverse=True):
        source = source[: edit.start] + edit.text + source[edit.end :]
    return source


def _unpacked(param: TypeParam) -> str:
    return f"{TYPING}.Unpack[{param.name}]" if param.kind == "TypeVarTuple" else param.name


def _class_base_edit(
    statement: list[tokenize.TokenInfo], open_at: int, generic: str, offset: Callable[[tuple[int, int]], int]
) -> _Edit:
    """Generic[...] as the last positional base: before the first keyword (like metaclass=), else last."""
    close = _matching_bracket(statement, open_at)
    depth = 0
    for index in range(open_at + 1, close):
        token = statement[index]
        if token.type == tokenize.OP and token.string in "([{":
            depth += 1
        elif token.type == tokenize.OP and token.string in ")]}":
            depth -= 1
        elif depth == 0 and token.string == "=" and statement[index - 1].type == tokenize.NAME:
            keyword = statement[index - 1].start
            return _Edit(offset(keyword), offset(keyword), f"{generic}, ")
    last = statement[close - 1]
    separator = "" if last.string in ("(", ",") else ", "
    return _Edit(offset(last.end), offset(last.end), f"{separator}{generic}")


def _matching_bracket(tokens: list[tokenize.TokenInfo], open_at: int) -> int:
    depth = 0
    for index in range(open_at, len(tokens)):
        if tokens[index].type != tokenize.OP:
            continue
        if tokens[index].string in "([{":
            depth += 1
        elif tokens[index].string in ")]}":
            depth -= 1
            if depth == 0:
                return index
    raise SyntaxError(f"unclosed bracket at line {tokens[open_at].start[0]}")


def _logical_lines(source: str) -> Iterator[tuple[list[tokenize.TokenInfo], tokenize.TokenInfo]]:
    """Each logical line's tokens (comments and blank lines left out), with the first token of the
    decorator that precedes it, or of the line itself when undecorated."""
    line: list[tokenize.TokenInfo] = []
    decorated_from: tokenize.TokenInfo | None = None
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in skipped and not line:
            continue
        if token.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            if line:
                if line[0].string == "@":
                    decorated_from = decorated_from or line[0]
                else:
                    yield line, decorated_from or line[0]
                    decorated_from = None
            line = []
            continue
        if token.type not in (tokenize.COMMENT, tokenize.NL):
            line.append(token)
    if decorated_from is not None:
        raise SyntaxError("decorators with no statement after them")
