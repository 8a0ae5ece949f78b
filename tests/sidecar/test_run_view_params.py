"""Where the run view's event stream starts (sidecar/runs/routes.py resume_version): from_version, or after
the Last-Event-ID a reconnecting EventSource sends; anything WatchModel cannot take (not a decimal version,
past int64, past Python's 4300-digit int conversion) is a 400 naming the field, never a 500 or a stream
that dies after its 200. Through the real sidecar: tests/hardening/test_campaign_sessions.py."""

from __future__ import annotations

import pytest

from tinkerrpc_server.sidecar.errors import OpenAIError
from tinkerrpc_server.sidecar.runs.routes import MAX_VERSION, _flag, resume_version

pytestmark = pytest.mark.unit

INT64_MAX = 2**63 - 1


@pytest.mark.parametrize(
    ("from_version", "last_event_id", "start"),
    [
        (None, None, None),
        (None, "", None),
        ("0", None, 0),
        ("7", None, 7),
        (str(INT64_MAX), None, INT64_MAX),
        ("007", None, 7),
        (None, "0", 1),
        (None, " 41 ", 42),
        (None, str(INT64_MAX - 1), INT64_MAX),
        ("3", "9", 10),  # a reconnect resumes after the last event it saw, whatever the address asked
    ],
)
def test_versions_watch_model_takes_are_accepted(
    from_version: str | None, last_event_id: str | None, start: int | None
) -> None:
    assert MAX_VERSION == INT64_MAX
    assert resume_version(from_version, last_event_id) == start


@pytest.mark.parametrize(
    ("from_version", "last_event_id", "field", "shown"),
    [
        ("-1", None, "from_version", "'-1'"),
        ("abc", None, "from_version", "'abc'"),
        ("1.5", None, "from_version", "'1.5'"),
        ("", None, "from_version", "''"),
        (str(INT64_MAX + 1), None, "from_version", "'9223372036854775808'"),
        ("9" * 5000, None, "from_version", "(5000 characters)"),
        ("\u0661\u0662", None, "from_version", "'\u0661\u0662'"),  # Arabic-Indic digits int() would take
        (None, "-1", "Last-Event-ID", "'-1'"),
        (None, "seven", "Last-Event-ID", "'seven'"),
        (None, "\u00b2", "Last-Event-ID", "'\u00b2'"),  # isdigit() says yes, int() says no
        (None, str(INT64_MAX), "Last-Event-ID", "'9223372036854775807'"),  # resuming after it overflows
        (None, "1" * 4301, "Last-Event-ID", "(4301 characters)"),
        ("abc", "5", "from_version", "'abc'"),
        ("5", "x", "Last-Event-ID", "'x'"),
    ],
)
def test_anything_else_is_a_400_naming_the_field(
    from_version: str | None, last_event_id: str | None, field: str, shown: str
) -> None:
    with pytest.raises(OpenAIError) as refused:
        resume_version(from_version, last_event_id)
    error = refused.value
    assert (error.status, error.param, error.error_type) == (400, field, "invalid_request_error")
    assert error.message.startswith(f"{field} must be ") and shown in error.message
    assert len(error.message) < 200, "a huge value is not echoed whole"


def test_the_state_routes_steps_flag_is_true_or_false() -> None:
    assert [_flag(text, "steps") for text in ("true", "TRUE", "1", "false", "False", "0")] == [True] * 3 + [
        False
    ] * 3
    for bad in ("", "maybe", "yes", "2", "x" * 5000):
        with pytest.raises(OpenAIError) as refused:
            _flag(bad, "steps")
        assert (refused.value.status, refused.value.param) == (400, "steps")
        assert len(refused.value.message) < 200
