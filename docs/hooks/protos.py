"""MkDocs hook: the gRPC reference, written at build time from the comments in protos/tinkerrpc/v1/*.proto.

A page holding `<!-- protos:reference -->` gets, in its place, one section per .proto file: the file's
own comment, then each service (its RPCs), message (a table of its fields) and enum (a table of its
values) with the comment above it. The protos are the one place these texts are written; this small
line parser reads the subset of proto3 the contract uses (services, messages, enums, oneofs, maps, no
nested messages) and fails the build on a line it does not understand, so nothing is silently dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PLACEHOLDER = "<!-- protos:reference -->"
PROTO_DIR = Path(__file__).resolve().parents[2] / "protos" / "tinkerrpc" / "v1"
# The files in the order a reader wants them: the service first, then what it carries.
FILE_ORDER = ("trainer_service.proto", "types.proto", "errors.proto")

_RPC = re.compile(r"rpc (\w+)\((stream )?([\w.]+)\) returns \((stream )?([\w.]+)\);")
_FIELD = re.compile(r"(optional |repeated )?(map<[\w.]+, ?[\w.]+>|[\w.]+) (\w+) = (\d+);")
_ENUM_VALUE = re.compile(r"(\w+) = (-?\d+);")
_OPEN = re.compile(r"(service|message|enum|oneof) (\w+) \{(\})?")


@dataclass
class Entry:
    """An RPC, a field or an enum value, with the comment above it."""

    name: str
    doc: list[str]
    number: str = ""
    type: str = ""
    label: str = ""  # optional / repeated / "oneof NAME" / "stream" markers
    request: str = ""
    response: str = ""


@dataclass
class Block:
    """A service, message or enum."""

    kind: str
    name: str
    doc: list[str]
    entries: list[Entry] = field(default_factory=list)


@dataclass
class ProtoFile:
    name: str
    doc: list[str]
    blocks: list[Block]


def parse(path: Path) -> ProtoFile:
    """The file's comment, and its blocks in file order."""
    comment: list[str] = []
    file_doc: list[str] = []
    blocks: list[Block] = []
    block: Block | None = None
    oneof: str | None = None
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if line.startswith("//"):
            comment.append(line[2:].removeprefix(" "))
            continue
        if not line:
            comment = []
            continue
        if line.startswith(("syntax ", "import ")):
            comment = []
            continue
        if line.startswith("package "):
            file_doc = comment  # the file's comment is the one right above its package line
            comment = []
            continue
        opened = _OPEN.fullmatch(line)
        if opened:
            kind, name, closed_at_once = opened.groups()
            if kind == "oneof":
                oneof = name
            else:
                block = Block(kind, name, comment)
                blocks.append(block)
                if closed_at_once:
                    block = None
            comment = []
            continue
        if line == "}":
            if oneof is not None:
                oneof = None
            else:
                block = None
            comment = []
            continue
        if block is None:
            raise ValueError(f"{path.name}:{number}: unexpected line outside a block: {line!r}")
        entry = _entry(block.kind, line, comment, oneof)
        if entry is None:
            raise ValueError(f"{path.name}:{number}: the protos hook cannot read {line!r}")
        block.entries.append(entry)
        comment = []
    return ProtoFile(path.name, file_doc, blocks)


def _entry(kind: str, line: str, doc: list[str], oneof: str | None) -> Entry | None:
    if kind == "service":
        rpc = _RPC.fullmatch(line)
        if rpc is None:
            return None
        name, stream_in, request, stream_out, response = rpc.groups()
        label = "server stream" if stream_out else ("client stream" if stream_in else "")
        return Entry(name, doc, request=request, response=response, label=label)
    if kind == "enum":
        value = _ENUM_VALUE.fullmatch(line)
        return None if value is None else Entry(value.group(1), doc, number=value.group(2))
    found = _FIELD.fullmatch(line)
    if found is None:
        return None
    label, type_name, name, number = found.groups()
    labels = [label.strip()] if label else []
    if oneof:
        labels.append(f"oneof `{oneof}`")
    return Entry(name, doc, number=number, type=type_name.replace(", ", ","), label=", ".join(labels))


def _escape(text: str) -> str:
    """Markdown-safe text outside code spans: `|` would end a table cell, `<` open an HTML tag."""
    pieces = re.split(r"(`[^`]*`)", text)
    return "".join(
        piece if piece.startswith("`") else piece.replace("|", r"\|").replace("<", "&lt;") for piece in pieces
    )


def _paragraphs(doc: list[str]) -> str:
    """A comment as Markdown: blank comment lines part paragraphs, `- ` lines are list items."""
    out: list[str] = []
    for line in doc:
        if not line.strip():
            out.append("")
        elif line.startswith("- ") or not out or not out[-1]:
            if line.startswith("- ") and out and out[-1] and not out[-1].startswith("- "):
                out.append("")
            out.append(_escape(line))
        else:
            out[-1] += " " + _escape(line.strip())
    return "\n".join(out)


def _cell(doc: list[str]) -> str:
    return " ".join(_escape(line.strip()) for line in doc if line.strip())


def _type_link(type_name: str, known: set[str]) -> str:
    """A message or enum of this package links to its section; other types stay code."""
    if type_name.startswith("map<"):
        key, value = type_name[4:-1].split(",")
        return f"map&lt;`{key}`, {_type_link(value, known)}&gt;"
    return f"[`{type_name}`](#{type_name.lower()})" if type_name in known else f"`{type_name}`"


def render(files: list[ProtoFile]) -> str:
    known = {block.name for file in files for block in file.blocks}
    out: list[str] = []
    for file in files:
        out += [f"## {file.name}", "", _paragraphs(file.doc), ""]
        for block in file.blocks:
            out += [f"### {block.name}", "", f"*{block.kind}*", "", _paragraphs(block.doc), ""]
            out += _render_entries(block, known)
    return "\n".join(out)


def _render_entries(block: Block, known: set[str]) -> list[str]:
    if not block.entries:
        return ["No fields.", ""]
    if block.kind == "service":
        rows = ["| RPC | request | response | what it does |", "|---|---|---|---|"]
        for rpc in block.entries:
            response = _type_link(rpc.response, known) + (f" ({rpc.label})" if rpc.label else "")
            rows.append(
                f"| `{rpc.name}` | {_type_link(rpc.request, known)} | {response} | {_cell(rpc.doc)} |"
            )
        return [*rows, ""]
    if block.kind == "enum":
        rows = ["| value | number | meaning |", "|---|---:|---|"]
        rows += [f"| `{value.name}` | {value.number} | {_cell(value.doc)} |" for value in block.entries]
        return [*rows, ""]
    rows = ["| field | type | number | meaning |", "|---|---|---:|---|"]
    for item in block.entries:
        label = f" ({item.label})" if item.label else ""
        rows.append(
            f"| `{item.name}` | {_type_link(item.type, known)}{label} | {item.number} | {_cell(item.doc)} |"
        )
    return [*rows, ""]


def _reading_order(path: Path) -> tuple[int, str]:
    return (FILE_ORDER.index(path.name) if path.name in FILE_ORDER else len(FILE_ORDER), path.name)


def reference() -> str:
    return render([parse(path) for path in sorted(PROTO_DIR.glob("*.proto"), key=_reading_order)])


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if PLACEHOLDER not in markdown:
        return markdown
    return markdown.replace(PLACEHOLDER, reference())


def on_serve(server: Any, config: Any, builder: Any) -> Any:
    """`mkdocs serve` rebuilds when a .proto changes."""
    server.watch(str(PROTO_DIR))
    return server
