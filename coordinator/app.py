"""The coordinator's HTTP app: `create_app(storage, admin_token, clock=...)` assembles it.

`create_app` builds the service, the authenticator and the long-poll events, then the app around
them: the body-limit middleware, the error handlers below and the routers of `coordinator.routes`.
Service calls are synchronous and run on the event loop itself, one at a time. That is deliberate:
every state change is a short local transaction (SQLite or a nearby PostgreSQL), and serialising
them makes the round rules race-free without locks. Only long-polls wait, and they wait on a
per-run `asyncio.Event` (`routes.RunEvents`) that the service fires after each commit that opens
or closes a round or accepts a submission, never by polling the database. A background task calls
`service.tick()` so that deadlines and heartbeat timeouts take effect with nobody asking.

Every refusal is ``{"error": code, "detail": text}`` with a 4xx status: typed service errors,
validation errors (422, or 400 for malformed JSON), bodies over `max_body_bytes` (413, checked
before any parsing), unknown routes and methods. Each is a `coordinator.errors` class, so its code
is a `protocol.http.ErrorCode`. A failure of the database is the same body with 503
``storage_unavailable`` and ``Retry-After``, answered by the same handler as the refusals: the
handler for unhandled errors (500) re-raises after answering, which makes the server close the
connection, so no storage failure may reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator import errors
from coordinator.auth import Authenticator
from coordinator.body_limit import BodyLimitMiddleware
from coordinator.routes import RunEvents, ops_router, peers_router, rounds_router, runs_router
from coordinator.service import CoordinatorService
from coordinator.storage import Storage

log = logging.getLogger("locoswarm.coordinator")


def _refusal(error: errors.CoordinatorError, status: int | None = None) -> JSONResponse:
    return JSONResponse(
        status_code=error.status if status is None else status,
        content={"error": error.code, "detail": error.detail},
        headers=None if error.retry_after_s is None else {"Retry-After": str(error.retry_after_s)},
    )


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(errors.CoordinatorError)
    async def coordinator_error(request: Request, exc: errors.CoordinatorError) -> JSONResponse:
        return _refusal(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = exc.errors()
        if any(p.get("type") == "json_invalid" for p in problems):
            return _refusal(errors.MalformedJson("the body is not valid JSON"))
        parts = []
        for problem in problems[:10]:
            where = ".".join(str(p) for p in problem.get("loc", ()))
            parts.append(f"{where}: {problem.get('msg', 'invalid')}")
        return _refusal(errors.InvalidRequest("; ".join(parts)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {404: errors.NotFound, 405: errors.MethodNotAllowed}
        error = kinds.get(exc.status_code, errors.HttpError)(str(exc.detail))
        return _refusal(error, status=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _refusal(errors.Internal("internal error; see the coordinator log"))


def create_app(
    storage: Storage,
    admin_token: str,
    clock: Callable[[], float] = time.time,
    tick_s: float | None = 0.2,
    max_body_bytes: int = 64 * 1024,
    rate_per_s: float = 20.0,
    rate_burst: float = 60.0,
) -> FastAPI:
    """The coordinator app. `tick_s=None` runs no background task (rules then apply when a
    request touches a run), which keeps some unit tests fully deterministic."""
    events = RunEvents()
    service = CoordinatorService(storage, clock=clock, on_change=events.notify)
    auth = Authenticator(service, admin_token, rate_per_s=rate_per_s, burst=rate_burst)
    response_counts: Counter[int] = Counter()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.resume()
        ticker = asyncio.create_task(_tick_forever(service, tick_s)) if tick_s else None
        try:
            yield
        finally:
            if ticker is not None:
                ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ticker

    app = FastAPI(
        title="locoswarm coordinator",
        version="1",
        description="Runs, membership, rounds and manifests for SparseLoCo swarms.",
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.events = events
    app.add_middleware(
        BodyLimitMiddleware, max_body_bytes=max_body_bytes, response_counts=response_counts
    )
    _install_error_handlers(app)

    app.include_router(ops_router(storage, service, response_counts))
    app.include_router(runs_router(service, auth))
    app.include_router(peers_router(service, auth))
    app.include_router(rounds_router(service, auth, events))
    return app


async def _tick_forever(service: CoordinatorService, tick_s: float) -> None:
    failing_since: float | None = None  # monotonic time of the first failed tick of an outage
    while True:
        try:
            service.tick()
            if failing_since is not None:
                log.warning("database usable again after %.0f s; deadlines and timeouts apply",
                            time.monotonic() - failing_since)
                failing_since = None
        except errors.StorageUnavailable as e:
            # Logged once per outage, not five times a second; /readyz says 503 meanwhile.
            if failing_since is None:
                failing_since = time.monotonic()
                log.error("%s: deadlines and timeouts wait for the database", e.detail)
        except Exception:
            # A failed tick must not stop deadlines for good.
            log.exception("coordinator tick failed")
        await asyncio.sleep(tick_s)
