"""MkDocs hook: the limits, losses, estimators and sampling-options tables, written at build time by `tinkerrpc.contract`.

The contract module is where every bound, loss and sampling option is defined (one rule, one place); a
page holding one of the placeholders below gets that module's Markdown in its place, so the page can
never disagree with the code that enforces it. The build fails when the module cannot be imported.
"""

from __future__ import annotations

from typing import Any

from tinkerrpc import contract

# placeholder -> the tinkerrpc.contract function that writes its Markdown
PLACEHOLDERS = {
    "<!-- contract:limits -->": contract.limits_markdown,
    "<!-- contract:losses -->": contract.losses_markdown,
    "<!-- contract:estimators -->": contract.estimators_markdown,
    "<!-- contract:train_terms -->": contract.train_terms_markdown,
    "<!-- contract:sampling -->": contract.sampling_options_markdown,
}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    for placeholder, write in PLACEHOLDERS.items():
        if placeholder in markdown:
            markdown = markdown.replace(placeholder, write())
    return markdown
