"""age-encrypted external weights (save_weights_external's `age_encryption_recipients`), as the SDK
defines them: every exported file encrypted to all the recipients (native `age1...` keys or SSH public
keys) and stored with a `.age` suffix, through `pyrage` (the age format's Python binding).

The plaintext adapter is written first and encrypted file by file, each `.age` file complete before its
plaintext goes; the data dir also holds the same weights unencrypted in the training run's own
checkpoints, so the encryption protects what leaves the engine (the downloads), not its own disk.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyrage  # type: ignore[import-untyped]

from tinkerrpc.contract.limits import MAX_AGE_RECIPIENT_CHARS, MAX_AGE_RECIPIENTS
from tinkerrpc_server.engine.runtime import EngineUserError
from tinkerrpc_server.engine.storage import regular_files

AGE_SUFFIX = ".age"
_FIELD = "age_encryption_recipients"


def parse_recipients(texts: list[str]) -> list[object]:
    """pyrage recipients of `texts`; EngineUserError naming the field and the first bad one."""
    if not 1 <= len(texts) <= MAX_AGE_RECIPIENTS:
        raise EngineUserError(f"{_FIELD}: give 1 to {MAX_AGE_RECIPIENTS} recipients, got {len(texts)}")
    recipients = []
    for index, text in enumerate(texts):
        if len(text) > MAX_AGE_RECIPIENT_CHARS:
            raise EngineUserError(f"{_FIELD}[{index}]: at most {MAX_AGE_RECIPIENT_CHARS} characters")
        kind = pyrage.x25519 if text.startswith("age1") else pyrage.ssh if text.startswith("ssh-") else None
        try:
            if kind is None:
                raise pyrage.RecipientError("neither an age1... key nor an SSH public key")
            recipients.append(kind.Recipient.from_str(text))
        except pyrage.RecipientError as error:
            raise EngineUserError(f"{_FIELD}[{index}] {text[:40]!r} is no age recipient: {error}") from error
    return recipients


def encrypt_in_place(directory: Path, recipients: list[object]) -> None:
    """Replace every regular file under `directory` by its encryption to `recipients`, `<file>.age`."""
    for relative in regular_files(directory):
        plain = directory / relative
        sealed = plain.with_name(plain.name + AGE_SUFFIX)
        pyrage.encrypt_file(str(plain), str(sealed), recipients)
        os.unlink(plain)
