"""The `tinkerrpc` command: serve, engine, sidecar, export and demo."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tinkerrpc_server.engine.config import DEFAULT_SESSION_TIMEOUT_SECONDS
from tinkerrpc_server.processes.children import REPORT_FD_FLAG, report_ready
from tinkerrpc_server.service.limits import add_limit_arguments, limits_from_args
from tinkerrpc_server.settings import (
    AUTH_TOKEN_ENV,
    ENGINE_API_KEY_ENV,
    ENGINE_DEVICE_ENV,
    ENGINE_DTYPE_ENV,
    ENGINE_DTYPES,
    LOG_LEVELS,
    MODEL_DIR_ENV,
    SIDECAR_API_KEY_ENV,
    Settings,
    configure_logging,
    set_process_defaults,
    settings_of,
)

if TYPE_CHECKING:
    from tinkerrpc_server.engine.config import EngineConfig
    from tinkerrpc_server.local.launch import EmbeddedEngine

Command = Callable[[argparse.Namespace, Settings], int]


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535 (0: one the system picks), not {port}")
    return port


def _add_address(p: argparse.ArgumentParser, port: int) -> None:
    """--host, --port and --report-fd: what every server command takes."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port", type=_port, default=port, help="0: a free one the system picks (default: %(default)s)"
    )
    p.add_argument(
        REPORT_FD_FLAG,
        type=int,
        default=None,
        metavar="FD",
        help="once serving, write the ports listened on as one JSON line to this inherited file descriptor "
        "(for a parent that started it with --port 0)",
    )


def _add_address_and_dirs(
    p: argparse.ArgumentParser, settings: Settings, port: int, data_dir: str, models: str
) -> None:
    """--host, --port, --report-fd, --data-dir and --model-dir: what `serve` and `engine` both take."""
    _add_address(p, port)
    p.add_argument("--data-dir", type=Path, default=Path(data_dir))
    p.add_argument(
        "--model-dir",
        type=Path,
        default=settings.model_dir,
        help=f"{models} (default: ${MODEL_DIR_ENV} or ~/.cache/tinkerrpc/models)",
    )


def _reporter(args: argparse.Namespace) -> Callable[[dict[str, int]], None]:
    """What tells the parent the ports a server listens on (nothing without --report-fd)."""
    report_fd: int | None = args.report_fd

    def report(ports: dict[str, int]) -> None:
        if report_fd is not None:
            report_ready(report_fd, ports)

    return report


def _listen(command: str, host: str, port: int) -> socket.socket | None:
    """The server's listening socket, or None after one line saying why it cannot listen."""
    from tinkerrpc_server.processes.http_serving import listen

    try:
        return listen(host, port)
    except OSError as err:
        print(
            f"tinkerrpc {command}: cannot start: cannot listen on {host}:{port}: {err.strerror or err}",
            file=sys.stderr,
        )
        return None


def _add_serve(sub: argparse._SubParsersAction, settings: Settings) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="run the gRPC TrainerService")
    _add_address_and_dirs(p, settings, 50051, "tinkerrpc-data", "local base models for the embedded engine")
    p.add_argument("--max-message-mb", type=int, default=256, help="max gRPC send/receive message size")
    p.add_argument(
        "--tinker-url",
        default=None,
        help="Tinker service URL when TINKER_API_KEY is set (default: $TINKER_BASE_URL or the SDK's)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="save full training state every K steps (default: 1 on the embedded engine, 10 on Tinker); "
        "after a crash training resumes from the last one",
    )
    p.add_argument(
        "--auth-token",
        default=settings.auth_token,
        help=f"require `authorization: Bearer TOKEN` on every RPC (default: ${AUTH_TOKEN_ENV}, else none)",
    )
    p.add_argument("--auth-token-file", type=Path, default=None, help="read the auth token from this file")
    p.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain: serve TLS")
    p.add_argument("--tls-key", type=Path, default=None, help="PEM private key for --tls-cert")
    p.add_argument(
        "--sidecar-port", type=_port, default=None, help="also serve the OpenAI sidecar on this port"
    )
    p.add_argument(
        "--sidecar-api-key",
        default=settings.sidecar_api_key,
        help=f"bearer key the sidecar requires (default: ${SIDECAR_API_KEY_ENV}, else none; "
        "needed with an auth token)",
    )
    p.add_argument(
        "--sidecar-no-auth",
        action="store_true",
        help="serve the sidecar without a key although the server needs a token (anyone reaching it "
        "uses the server with the token)",
    )
    add_limit_arguments(p)
    p.set_defaults(func=_serve)


def _auth_token(args: argparse.Namespace) -> str | None:
    if args.auth_token_file is not None:
        try:
            token: str = args.auth_token_file.read_text().strip()
        except OSError as err:
            raise SystemExit(
                f"tinkerrpc serve: cannot read {args.auth_token_file}: {err.strerror or err}"
            ) from err
        if not token:
            raise SystemExit(f"tinkerrpc serve: {args.auth_token_file} is empty")
        return token
    return str(args.auth_token) if args.auth_token else None


def _serve_usage_error(args: argparse.Namespace, auth_token: str | None) -> str | None:
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        return "--checkpoint-every must be >= 1"
    if (args.tls_cert is None) != (args.tls_key is None):
        return "--tls-cert and --tls-key go together"
    if args.sidecar_no_auth and args.sidecar_api_key:
        return f"--sidecar-no-auth contradicts --sidecar-api-key (or ${SIDECAR_API_KEY_ENV})"
    # The sidecar is never more open than the server it fronts, unless told.
    if auth_token and args.sidecar_port is not None and not args.sidecar_api_key and not args.sidecar_no_auth:
        return (
            f"--sidecar-port with an auth token needs --sidecar-api-key (or ${SIDECAR_API_KEY_ENV}); "
            "--sidecar-no-auth serves it without one"
        )
    return None


# Import names of the `server` extra's packages that `serve` needs (see pyproject.toml).
SERVER_EXTRA_MODULES = (
    "tinker",
    "tinker_cookbook",
    "torch",
    "transformers",
    "peft",
    "safetensors",
    "tokenizers",
    "numpy",
    "fastapi",
    "uvicorn",
    "httpx",
    "grpc_reflection",
    "grpc_status",
    "prometheus_client",
)


def _missing_server_extra() -> str | None:
    """The first module of the server extra this install lacks (a light `pip install tinkerrpc`)."""
    for module in SERVER_EXTRA_MODULES:
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except (ImportError, ValueError):
            return module
    return None


def _server_extra_message(module: str | None) -> str:
    return (
        f"tinkerrpc serve needs the server extra (no module {module!r} here): pip install 'tinkerrpc[server]'"
    )


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    # Before anything starts: the light client install has no server, and that is one line.
    missing = _missing_server_extra()
    if missing is not None:
        print(_server_extra_message(missing), file=sys.stderr)
        return 1
    from tinkerrpc_server.local.launch import EmbeddedEngine
    from tinkerrpc_server.processes.ownership import own_data_dir, port_taken, probe_data_dir

    auth_token = _auth_token(args)
    usage_error = _serve_usage_error(args, auth_token)
    if usage_error is not None:
        print(f"tinkerrpc serve: {usage_error}", file=sys.stderr)
        return 2
    # Before the heavy imports and the engine child: an unusable or owned data dir, or a port in use,
    # is one line in a fraction of a second.
    ports = [args.port] if args.sidecar_port is None else [args.port, args.sidecar_port]
    problem = (
        probe_data_dir(args.data_dir)
        or own_data_dir(args.data_dir)
        or next(filter(None, (port_taken(args.host, port) for port in ports)), None)
    )
    if problem is not None:
        print(f"tinkerrpc serve: cannot start: {problem}", file=sys.stderr)
        return 1
    # Without a Tinker key the embedded engine serves; it boots while the service modules import.
    engine = None if settings.tinker_api_key else EmbeddedEngine(args.data_dir / "engine", args.model_dir)
    try:
        return _run_server(args, settings, auth_token, engine)
    except ModuleNotFoundError as err:  # a dependency of the extra's packages that the check missed
        print(_server_extra_message(err.name), file=sys.stderr)
        return 1
    finally:
        if engine is not None:
            engine.stop()


def _run_server(
    args: argparse.Namespace, settings: Settings, auth_token: str | None, engine: EmbeddedEngine | None
) -> int:
    from tinkerrpc_server.service.torchless import hide_torch

    # Only the engine child computes: this process serves without torch.
    hide_torch()
    from tinkerrpc_server.server import ServerConfig, serve

    config = ServerConfig(
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        max_message_bytes=args.max_message_mb * 1024 * 1024,
        model_dir=args.model_dir,
        tinker_api_key=settings.tinker_api_key,
        tinker_url=args.tinker_url or settings.tinker_base_url,
        checkpoint_every=args.checkpoint_every,
        auth_token=auth_token,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        sidecar_port=args.sidecar_port,
        sidecar_api_key=args.sidecar_api_key,
        limits=limits_from_args(args),
        report_fd=args.report_fd,
    )
    return asyncio.run(serve(config, engine))


def _add_engine(sub: argparse._SubParsersAction, settings: Settings) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("engine", help="run the embedded Tinker-compatible engine (HTTP)")
    _add_address_and_dirs(p, settings, 8111, "tinkerrpc-engine-data", "local models")
    key = p.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help=f"the key every client must send (the tinker SDK's api_key, 'tml-...'; default: "
        f"${ENGINE_API_KEY_ENV}); without one the engine does not start",
    )
    key.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve without a key: anyone who reaches the port uses the engine (loopback --host only)",
    )
    p.add_argument(
        "--session-timeout",
        type=float,
        default=DEFAULT_SESSION_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help="finish a tinker session (unload its training clients, drop its ephemeral sampler weights) "
        "after this long without a heartbeat; the SDK heartbeats every 10 s (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        default=settings.engine_device,
        help=f"torch device: cpu, cuda or cuda:N (default: ${ENGINE_DEVICE_ENV}, else cuda when there is "
        "one, else cpu; docs/devices.md)",
    )
    p.add_argument(
        "--dtype",
        choices=ENGINE_DTYPES,
        default=settings.engine_dtype,
        help=f"dtype of the base weights; LoRA weights and optimizer state are float32 either way "
        f"(default: ${ENGINE_DTYPE_ENV}, else bfloat16 on cuda, float32 on cpu)",
    )
    p.set_defaults(func=_engine)


def _engine_config(args: argparse.Namespace, settings: Settings) -> EngineConfig | str:
    """The engine's configuration from the command line and the environment, or why it cannot start."""
    from tinkerrpc_server.engine.auth import api_key_problem
    from tinkerrpc_server.engine.config import EngineConfig, EngineConfigError

    key, source = settings.engine_api_key, f"${ENGINE_API_KEY_ENV}"
    if args.insecure_no_auth and key:
        return f"--insecure-no-auth contradicts ${ENGINE_API_KEY_ENV}"
    if args.api_key_file is not None:
        try:
            key, source = args.api_key_file.read_text().strip(), str(args.api_key_file)
        except (OSError, UnicodeDecodeError) as err:
            return f"cannot read --api-key-file {args.api_key_file}: {err}"
    elif key is None and not args.insecure_no_auth:
        return (
            f"no API key: give --api-key-file FILE or ${ENGINE_API_KEY_ENV} "
            "(or --insecure-no-auth on a loopback --host)"
        )
    problem = None if key is None else api_key_problem(key)
    if problem is not None:
        return f"{source}: {problem}"
    try:
        return EngineConfig(
            data_dir=args.data_dir,
            model_dir=args.model_dir,
            api_key=key,
            insecure_no_auth=args.insecure_no_auth,
            host=args.host,
            port=args.port,
            session_timeout=args.session_timeout,
            device=args.device,
            dtype=args.dtype,
            kernels=settings.kernels,
        )
    except EngineConfigError as err:
        return str(err)


def _engine(args: argparse.Namespace, settings: Settings) -> int:
    config = _engine_config(args, settings)
    if isinstance(config, str):
        print(f"tinkerrpc engine: {config}", file=sys.stderr)
        return 2
    from tinkerrpc_server.engine.main import engine_main

    return engine_main(config, on_serving=lambda port: _reporter(args)({"port": port}))


def _add_grpc_token_argument(p: argparse.ArgumentParser, flag: str, settings: Settings) -> None:
    """The bearer token a client command sends to the gRPC server."""
    p.add_argument(
        flag,
        default=settings.auth_token,
        help=f"bearer token for the gRPC server (default: ${AUTH_TOKEN_ENV})",
    )


def _add_sidecar(sub: argparse._SubParsersAction, settings: Settings) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("sidecar", help="run the OpenAI-compatible inference server over a tinkerrpc server")
    p.add_argument("--grpc-target", default="127.0.0.1:50051", help="the tinkerrpc gRPC server")
    _add_address(p, 8000)
    p.add_argument(
        "--api-key",
        default=settings.sidecar_api_key,
        help=f"require `Authorization: Bearer KEY` (default: ${SIDECAR_API_KEY_ENV}, else no auth)",
    )
    _add_grpc_token_argument(p, "--grpc-token", settings)
    p.add_argument(
        "--grpc-tls-ca",
        type=Path,
        default=None,
        help="PEM certificates that verify a TLS server (its own certificate, if self-signed): dial TLS",
    )
    p.add_argument(
        "--grpc-server-name",
        default=None,
        help="the host name the server's certificate carries, when --grpc-target's host is not it",
    )
    p.set_defaults(func=_sidecar)


def _sidecar(args: argparse.Namespace, settings: Settings) -> int:
    from tinkerrpc_server.processes.http_serving import bound_port
    from tinkerrpc_server.sidecar.app import GrpcUpstream, run_sidecar

    if args.grpc_server_name is not None and args.grpc_tls_ca is None:
        print("tinkerrpc sidecar: --grpc-server-name needs --grpc-tls-ca", file=sys.stderr)
        return 2
    try:
        tls_roots = args.grpc_tls_ca.read_bytes() if args.grpc_tls_ca is not None else None
    except OSError as err:
        print(f"tinkerrpc sidecar: cannot read {args.grpc_tls_ca}: {err.strerror or err}", file=sys.stderr)
        return 2
    sock = _listen("sidecar", args.host, args.port)
    if sock is None:
        return 1
    upstream = GrpcUpstream(args.grpc_target, args.grpc_token, tls_roots, args.grpc_server_name)
    report = _reporter(args)
    run_sidecar(upstream, sock, args.api_key or None, on_serving=lambda: report({"port": bound_port(sock)}))
    return 0


def _add_export(sub: argparse._SubParsersAction, settings: Settings) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "export", help="download a model's LoRA adapter from a tinkerrpc server as a PEFT directory"
    )
    p.add_argument("model", help="model name")
    p.add_argument("out", type=Path, help="directory to create (must not exist or be empty)")
    p.add_argument("--target", default="127.0.0.1:50051", help="the tinkerrpc gRPC server")
    p.add_argument(
        "--policy-version", type=int, default=None, help="an earlier version to export (default: current)"
    )
    _add_grpc_token_argument(p, "--token", settings)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole download")
    p.set_defaults(func=_export)


def _export(args: argparse.Namespace, settings: Settings) -> int:
    import tinkerrpc

    try:
        with tinkerrpc.Client(args.target, token=args.token) as client:
            exported = client.model(args.model).export_weights(
                args.out, policy_version=args.policy_version, progress=True, timeout=args.timeout
            )
    except (tinkerrpc.RPCError, FileExistsError) as err:
        print(f"tinkerrpc export: {err}", file=sys.stderr)
        return 1
    sizes = ", ".join(f"{p} ({(exported.directory / p).stat().st_size} B)" for p in exported.files)
    print(
        f"exported {exported.model}@{exported.policy_version} (base {exported.base_model}) to {exported.directory}: {sizes}"
    )
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from tinkerrpc_server import demo

    p = sub.add_parser(
        "demo",
        help="RL on a pretrained model (or --recipe yes-no-maybe: the tiny one) through the whole local stack",
    )
    demo.add_arguments(p)
    p.set_defaults(func=lambda args, settings: demo.main(args))


def main(argv: list[str] | None = None) -> int:
    settings = settings_of("tinkerrpc")
    if settings is None:
        return 2
    set_process_defaults()
    parser = argparse.ArgumentParser(prog="tinkerrpc", description=__doc__)
    parser.add_argument("--log-level", default=settings.log_level, type=str.upper, choices=LOG_LEVELS)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_serve, _add_engine, _add_sidecar, _add_export):
        add(sub, settings)
    _add_demo(sub)
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    command: Command = args.func
    return int(command(args, settings))


if __name__ == "__main__":
    sys.exit(main())
