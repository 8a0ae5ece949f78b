"""What every RPC goes through: the `rpc` decorator maps errors to statuses, and the engine supervisor
tracks the calls in flight so that losing the backend fails them UNAVAILABLE, new calls wait for it to
come back (within their deadline), and every model reloads from its recovery point. The backend is lost
when the embedded engine dies (it is restarted) or when the backend finishes this server's Tinker
session (a new one is opened): the session is checked every SESSION_CHECK_SECONDS, and at once when a
call fails on the backend, so a finished session is answered UNAVAILABLE (retryable), never as the
caller's error."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import grpc
import tinker

from tinkerrpc_server.service import deadlines, errors
from tinkerrpc_server.service.backend import Backend, StartError
from tinkerrpc_server.service.errors import ServiceError
from tinkerrpc_server.service.models import ModelRegistry

log = logging.getLogger("tinkerrpc.service")

# Restarts of a dead engine in a row before the server gives up and stops.
ENGINE_RESTART_ATTEMPTS = 3
# How often the backend is asked whether this server's session is still open.
SESSION_CHECK_SECONDS = 5.0
# Between tries to open a new session while the backend refuses one.
SESSION_RETRY_SECONDS = 2.0
# Longest a call waits for a restarting engine when it has no deadline of its own.
ENGINE_RESTART_WAIT_SECONDS = 240.0
# A call's backend futures fail DEADLINE_EXCEEDED at its deadline (deadlines.bounded); the call as a
# whole is cut this much later, for work outside them.
CALL_DEADLINE_GRACE_SECONDS = 1.0

Request = TypeVar("Request")
Response = TypeVar("Response")
Result = TypeVar("Result")


def _backend_lost() -> ServiceError:
    return ServiceError(
        grpc.StatusCode.UNAVAILABLE,
        "the Tinker backend was lost during this call (the embedded engine stopped, or the backend finished "
        "this server's session) and is being reconnected: retry it (a Train retried with its idempotency "
        "key is applied at most once)",
    )


ReportServing = Callable[[bool], Awaitable[None]]


async def _not_reported(serving: bool) -> None:
    return None


class EngineSupervisor:
    """Calls in flight (cancelled when the backend is lost), those cancelled that way, and a generation
    that counts reconnections (engine restarts, new sessions). While one runs, new calls wait."""

    def __init__(self, backend: Backend, models: ModelRegistry, backend_timeout: float) -> None:
        self._backend = backend
        self._models = models
        self._backend_timeout = backend_timeout
        self._calls: set[asyncio.Task[Any]] = set()
        self._interrupted: set[asyncio.Task[Any]] = set()
        self.generation = 0
        self._ready = asyncio.Event()
        self._ready.set()
        # One reconnection at a time: an engine restart opens a new session itself.
        self._reconnecting = asyncio.Lock()
        self._renewal: asyncio.Task[None] | None = None
        self._report_serving: ReportServing = _not_reported

    @property
    def supervises_engine(self) -> bool:
        return self._backend.engine is not None

    def _engine_exited(self) -> bool:
        engine = self._backend.engine
        return engine is not None and engine.exit_code() is not None

    def engine_down(self) -> bool:
        return not self._ready.is_set() or self._engine_exited()

    async def enter(self, task: asyncio.Task[Any], context: grpc.aio.ServicerContext[Any, Any]) -> float:
        """Start the call's deadline (see deadlines), wait (within it) while the engine restarts, then
        track the call. The seconds the call has."""
        seconds = deadlines.start_call(context.time_remaining(), self._backend_timeout)
        if not self._ready.is_set():
            remaining = context.time_remaining()
            wait = (
                ENGINE_RESTART_WAIT_SECONDS
                if remaining is None
                else min(remaining, ENGINE_RESTART_WAIT_SECONDS)
            )
            try:
                await asyncio.wait_for(self._ready.wait(), wait)
            except TimeoutError:
                raise ServiceError(
                    grpc.StatusCode.UNAVAILABLE,
                    "the Tinker backend is being reconnected (an engine restart or a new session); "
                    "retry shortly",
                ) from None
        self._calls.add(task)
        return seconds

    def leave(self, task: asyncio.Task[Any]) -> None:
        self._calls.discard(task)
        self._interrupted.discard(task)

    def interrupted(self, task: asyncio.Task[Any]) -> bool:
        """Whether the supervisor (not the client) cancelled this call."""
        return task in self._interrupted

    async def supervise(self, report_serving: ReportServing) -> None:
        """Runs for the server's lifetime (embedded engine only): restarts the engine child whenever it
        exits, reporting not serving for the restart window. Returns only after ENGINE_RESTART_ATTEMPTS
        failed restarts in a row (the server then stops)."""
        engine = self._backend.engine
        assert engine is not None, "only the embedded engine is supervised"
        while True:
            exit_code = await engine.exited()
            log.error("embedded engine (pid %s) exited with code %d; restarting it", engine.pid, exit_code)
            await report_serving(False)
            for attempt in range(1, ENGINE_RESTART_ATTEMPTS + 1):
                try:
                    async with self._reconnecting:
                        await self._restart_engine()
                    await report_serving(True)
                    break
                except StartError as err:
                    log.error("engine restart %d/%d failed: %s", attempt, ENGINE_RESTART_ATTEMPTS, err)
            else:
                return

    def _interrupt_calls(self) -> None:
        """The backend is lost: new calls wait, those in flight are cancelled (they fail UNAVAILABLE)."""
        self._ready.clear()
        self.generation += 1
        for task in self._calls - self._interrupted:
            self._interrupted.add(task)
            task.cancel()
        self._models.drop_sampling_clients()

    async def _restart_engine(self) -> None:
        started = time.monotonic()
        self._interrupt_calls()
        await self._backend.restart_engine()
        models = await self._models.reload_all()
        self._ready.set()
        log.warning(
            "embedded engine restarted (pid %s) in %.1fs; %d models reload from their recovery points",
            self._backend.engine.pid if self._backend.engine else None,
            time.monotonic() - started,
            models,
        )

    async def watch_session(self, report_serving: ReportServing) -> None:
        """Runs for the server's lifetime: asks the backend every SESSION_CHECK_SECONDS whether the
        session is still open, and opens a new one when it is not (see session_lost)."""
        self._report_serving = report_serving
        while True:
            await asyncio.sleep(SESSION_CHECK_SECONDS)
            await self.session_lost()

    async def session_lost(self) -> bool:
        """Whether calls on the backend fail because the session they ran in is gone: the backend
        finished it (a new one is then being opened, reported not serving until it is), or it is being
        replaced already."""
        if self.engine_down():
            return True
        service = self._backend.service
        if not await self._backend.session_finished(service):
            return False
        if self._backend.service is service and (self._renewal is None or self._renewal.done()):
            self._renewal = asyncio.create_task(self._renew_session(service))
        return True

    async def _renew_session(self, finished: tinker.ServiceClient) -> None:
        async with self._reconnecting:
            if self._backend.service is not finished:
                return  # an engine restart opened a new session meanwhile
            started = time.monotonic()
            log.warning("the Tinker backend finished this server's session; opening a new one")
            await self._report_serving(False)
            self._interrupt_calls()
            while True:
                try:
                    await self._backend.renew_session()
                    break
                except StartError as err:
                    if self._engine_exited():
                        return  # the engine supervisor restarts it, with a new session
                    log.warning("%s; trying again in %.0f s", err, SESSION_RETRY_SECONDS)
                    await asyncio.sleep(SESSION_RETRY_SECONDS)
            models = await self._models.reload_all()
            self._ready.set()
            await self._report_serving(True)
            log.warning(
                "new Tinker session %s in %.1fs; %d models reload from their recovery points",
                self._backend.session_id(),
                time.monotonic() - started,
                models,
            )


class SupervisedService(Protocol):
    @property
    def supervisor(self) -> EngineSupervisor: ...


Service = TypeVar("Service", bound=SupervisedService)


def rpc(
    method: Callable[[Service, Request, grpc.aio.ServicerContext[Request, Response]], Awaitable[Result]],
) -> Callable[[Service, Request, grpc.aio.ServicerContext[Request, Response]], Awaitable[Result]]:
    """Turns ServiceError and tinker SDK errors into the call's status with google.rpc details; a call
    cut short by the engine child dying fails UNAVAILABLE (retryable), whatever error it was in.
    A unary RPC returns its response; a streaming RPC's preparation step returns what it streams."""

    @functools.wraps(method)
    async def handler(
        self: Service, request: Request, context: grpc.aio.ServicerContext[Request, Response]
    ) -> Result:
        supervisor = self.supervisor
        task = asyncio.current_task()
        assert task is not None
        generation = supervisor.generation
        call_time: asyncio.Timeout | None = None
        try:
            seconds = await supervisor.enter(task, context)
            async with asyncio.timeout(seconds + CALL_DEADLINE_GRACE_SECONDS) as call_time:
                return await method(self, request, context)
        except ServiceError as err:
            error = err
        except asyncio.CancelledError:
            if not supervisor.interrupted(task):
                raise  # the client cancelled, or its deadline passed: nobody waits for an answer
            task.uncancel()
            error = _backend_lost()
        except Exception as err:
            # Out of the calls a reconnection cancels: the session check below may await (an interrupted
            # call never gets there: its generation is behind).
            supervisor.leave(task)
            if isinstance(err, TimeoutError) and call_time is not None and call_time.expired():
                error = errors.deadline_exceeded(
                    f"{method.__name__} did not finish before its deadline (its gRPC deadline, or "
                    "--backend-timeout when it set none)"
                )
            elif (
                supervisor.generation != generation
                or supervisor.engine_down()
                or (isinstance(err, tinker.TinkerError) and await supervisor.session_lost())
            ):
                error = _backend_lost()
            elif isinstance(err, tinker.TinkerError):
                error = errors.from_tinker(err) or ServiceError(
                    grpc.StatusCode.INTERNAL, f"Tinker error: {err}"
                )
            else:
                log.exception("%s failed", method.__name__)
                error = ServiceError(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")
        finally:
            supervisor.leave(task)
        # grpc-stubs' aio.ServicerContext lacks abort_with_status (grpc.aio has it since 1.38).
        await context.abort_with_status(error.to_status())  # type: ignore[attr-defined]
        raise AssertionError("abort_with_status returned")  # pragma: no cover - it always raises

    return handler
