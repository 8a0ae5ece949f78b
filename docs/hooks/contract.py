"""MkDocs hook: the "Limits and losses" tables, written at build time by `tinkerrpc.contract`.

The contract module is where every bound, loss and sampling option is defined (one rule, one place); a
page holding one of the placeholders below gets that module's Markdown in its place, so the page can
never disagree with the code that enforces it.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

log = logging.getLogger("mkdocs.hooks.contract")

# placeholder -> the tinkerrpc.contract function that writes its Markdown
PLACEHOLDERS = {
    "<!-- contract:limits -->": "limits_markdown",
    "<!-- contract:losses -->": "losses_markdown",
    "<!-- contract:sampling -->": "sampling_options_markdown",
}

PENDING = (
    '!!! note "Generated at build time"\n\n'
    "    (generated at build time) This table is written by `tinkerrpc.contract.{function}()`, which this "
    "build could not import.\n"
)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    present = [placeholder for placeholder in PLACEHOLDERS if placeholder in markdown]
    if not present:
        return markdown
    try:
        contract: Any = importlib.import_module("tinkerrpc.contract")
    except ImportError:
        # Lenient while tinkerrpc.contract is being written (issue 38): the page shows a visible note and
        # the build goes on. TODO(lead): once the module has landed, raise here so a missing table fails
        # `mkdocs build --strict` instead.
        contract = None
        log.info("tinkerrpc.contract is not importable yet: the Limits and losses tables are left as notes")
    for placeholder in present:
        function = PLACEHOLDERS[placeholder]
        write = getattr(contract, function, None)
        markdown = markdown.replace(placeholder, write() if write else PENDING.format(function=function))
    return markdown
