"""The one settings object (settings.Settings) and the environment children start with."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tinkerrpc_server import settings
from tinkerrpc_server.settings import KernelSettings, Settings, SettingsError, child_environment

pytestmark = pytest.mark.unit


def test_settings_read_every_variable_once_and_empty_is_unset() -> None:
    read = Settings.from_environment(
        {
            settings.LOG_LEVEL_ENV: "debug",
            settings.AUTH_TOKEN_ENV: " token ",
            settings.SIDECAR_API_KEY_ENV: "",
            settings.MODEL_DIR_ENV: "~/models",
            settings.ENGINE_DEVICE_ENV: "cpu",
            settings.ENGINE_DTYPE_ENV: "bfloat16",
            settings.TINKER_API_KEY_ENV: "tml-remote",
            settings.TINKER_BASE_URL_ENV: "https://tinker.example",
        }
    )
    assert read == Settings(
        log_level="DEBUG",
        auth_token="token",
        sidecar_api_key=None,
        engine_api_key=None,
        model_dir=Path("~/models").expanduser(),
        engine_device="cpu",
        engine_dtype="bfloat16",
        tinker_api_key="tml-remote",
        tinker_base_url="https://tinker.example",
    )
    assert Settings.from_environment({}) == Settings()
    assert Settings().model_dir == Path("~/.cache/tinkerrpc/models").expanduser()


def test_an_unknown_log_level_is_a_clear_error() -> None:
    with pytest.raises(SettingsError, match=r"\$TINKERRPC_LOG_LEVEL must be one of DEBUG, INFO"):
        Settings.from_environment({settings.LOG_LEVEL_ENV: "loud"})


def test_the_kernel_switch_build_dir_and_compiler_are_settings() -> None:
    read = Settings.from_environment(
        {
            settings.CPU_KERNELS_ENV: "0",
            settings.KERNELS_DIR_ENV: "~/kernels",
            settings.COMPILER_ENV: "clang++",
        }
    )
    assert read.kernels == KernelSettings(
        enabled=False, build_dir=Path("~/kernels").expanduser(), compiler="clang++"
    )
    assert Settings().kernels == KernelSettings(
        True, Path("~/.cache/tinkerrpc/cpu-kernels").expanduser(), "g++"
    )
    with pytest.raises(
        SettingsError, match=r"\$TINKERRPC_CPU_KERNELS must be 0 \(off\) or 1 \(on\), not 'yes'"
    ):
        Settings.from_environment({settings.CPU_KERNELS_ENV: "yes"})


def test_children_inherit_no_credential_but_what_they_are_handed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.AUTH_TOKEN_ENV, "server-token")
    monkeypatch.setenv(settings.SIDECAR_API_KEY_ENV, "sidecar-key")
    monkeypatch.setenv(settings.ENGINE_API_KEY_ENV, "tml-inherited")
    monkeypatch.setenv("TINKER_TELEMETRY", "1")
    monkeypatch.setenv("UNRELATED", "kept")
    env = child_environment({settings.ENGINE_API_KEY_ENV: "tml-handed"})
    assert env[settings.ENGINE_API_KEY_ENV] == "tml-handed"
    assert settings.AUTH_TOKEN_ENV not in env and settings.SIDECAR_API_KEY_ENV not in env
    assert env["UNRELATED"] == "kept"
    assert env["TINKER_TELEMETRY"] == "0"


REPO = Path(__file__).resolve().parents[2]
# settings.py is the server's one reader of the environment; the SDK may not import the server, so it
# has its own settings module.
ENVIRONMENT_READERS = {
    REPO / "server/tinkerrpc_server/settings.py",
    REPO / "client/tinkerrpc/settings.py",
}
ENVIRONMENT_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _environment_uses(path: Path) -> list[int]:
    """The lines of `path` that read or change the process environment: os.environ, os.getenv and the
    like, or those names imported from os."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            (isinstance(node, ast.Attribute) and node.attr in ENVIRONMENT_NAMES)
            or (isinstance(node, ast.Name) and node.id in ENVIRONMENT_NAMES)
            or (
                isinstance(node, ast.ImportFrom)
                and node.module == "os"
                and any(alias.name in ENVIRONMENT_NAMES for alias in node.names)
            )
        ):
            lines.append(node.lineno)
    return lines


def test_only_settings_reads_the_environment() -> None:
    sources = [*(REPO / "server/tinkerrpc_server").rglob("*.py"), *(REPO / "client/tinkerrpc").rglob("*.py")]
    assert len(sources) > 50
    found = {
        f"{path.relative_to(REPO)}:{line}"
        for path in sources
        if path not in ENVIRONMENT_READERS
        for line in _environment_uses(path)
    }
    assert not found, "the environment is read outside settings.py (settings.Settings holds each value)"
    assert all(_environment_uses(path) for path in ENVIRONMENT_READERS)
