"""The coordinator's HTTP surface: `create_app(storage, admin_token, clock=...)` builds it.

Routes are thin: authenticate, call `CoordinatorService`, return a `protocol.http` model. Service
calls are synchronous and run on the event loop itself, one at a time. That is deliberate: every
state change is a short local transaction (SQLite or a nearby PostgreSQL), and serialising them
makes the round rules race-free without locks. Only long-polls wait, and they wait on a per-run
`asyncio.Event` that the service fires after each commit that opens or closes a round or accepts
a submission, never by polling the database. A background task calls `service.tick()` so that
deadlines and heartbeat timeouts take effect with nobody asking.

Every refusal is ``{"error": code, "detail": text}`` with a 4xx status: typed service errors,
validation errors (422, or 400 for malformed JSON), bodies over `max_body_bytes` (413, checked
before any parsing), unknown routes and methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import Annotated, AsyncIterator, Callable

from fastapi import FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator import errors, metrics, page
from coordinator.auth import Authenticator
from coordinator.service import CoordinatorService
from coordinator.body_limit import BodyLimitMiddleware
from coordinator.storage import Storage
from coordinator.views import HISTORY_LIMIT
from protocol.http import API_PREFIX, MAX_LONG_POLL_S, AppliedRequest, AppliedResponse, ErrorBody, Health, HeartbeatRequest, HeartbeatResponse, JoinRequest, JoinResponse, LeaveRequest, LeaveResponse, RoundView, RunCreated, RunInfo, RunList, RunStatus, SubmitRequest, SubmitResponse
from protocol.run_config import RunConfig

log = logging.getLogger("locoswarm.coordinator")

RunIdPath = Annotated[str, Path(pattern=r"^[a-z0-9][a-z0-9-]{0,63}$", max_length=64)]
RoundPath = Annotated[int, Path(ge=0, le=2**31)]
ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ErrorBody} for status in (400, 401, 403, 404, 409, 413, 422, 429)
}


class RunEvents:
    """One `asyncio.Event` per run, replaced each time it fires: a waiter takes the current event
    *before* reading state, so a change committed after the read still wakes it."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}
        self.num_waiting = 0  # long-polls parked right now (tests wait on it, metrics show it)

    def current(self, run_id: str) -> asyncio.Event:
        return self._events.setdefault(run_id, asyncio.Event())

    async def wait(self, event: asyncio.Event, timeout_s: float) -> None:
        self.num_waiting += 1
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=timeout_s)
        finally:
            self.num_waiting -= 1

    def notify(self, run_id: str) -> None:
        event = self._events.pop(run_id, None)
        if event is not None:
            event.set()


def _error_response(status: int, code: str, detail: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": code, "detail": detail})


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(errors.CoordinatorError)
    async def coordinator_error(request: Request, exc: errors.CoordinatorError) -> JSONResponse:
        return _error_response(exc.status, exc.code, exc.detail)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = exc.errors()
        if any(p.get("type") == "json_invalid" for p in problems):
            return _error_response(400, "malformed_json", "the body is not valid JSON")
        parts = []
        for problem in problems[:10]:
            where = ".".join(str(p) for p in problem.get("loc", ()))
            parts.append(f"{where}: {problem.get('msg', 'invalid')}")
        return _error_response(422, "invalid_request", "; ".join(parts))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        return _error_response(exc.status_code, codes.get(exc.status_code, "http_error"),
                                str(exc.detail))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _error_response(500, "internal", "internal error; see the coordinator log")


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

    async def signed_peer(request: Request, public_key: bytes | None = None) -> str:
        body = await request.body()
        return auth.verify_peer(
            request.method, request.url.path, request.headers, body, public_key=public_key
        )

    # -- public and admin -------------------------------------------------------------------

    @app.get("/healthz", response_model=Health, tags=["ops"])
    async def healthz() -> Health:
        storage.schema_version()  # proves the database answers
        return Health(status="ok")

    @app.get("/metrics", response_class=PlainTextResponse, tags=["ops"])
    async def get_metrics() -> PlainTextResponse:
        text = metrics.render(storage, service, response_counts)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", response_class=HTMLResponse, tags=["ops"])
    async def status_page(run: Annotated[str | None, Query(max_length=64)] = None) -> HTMLResponse:
        return HTMLResponse(page.render_page(run or service.latest_run_id()))

    @app.post(f"{API_PREFIX}/runs", response_model=RunCreated, responses=ERROR_RESPONSES,
              tags=["runs"])
    async def create_run(
        config: RunConfig, authorization: Annotated[str | None, Header()] = None
    ) -> RunCreated:
        auth.require_admin(authorization)
        return RunCreated(run_id=service.create_run(config))

    @app.get(f"{API_PREFIX}/runs", response_model=RunList, tags=["runs"])
    async def list_runs() -> RunList:
        return service.list_runs()

    @app.get(f"{API_PREFIX}/runs/{{run_id}}", response_model=RunInfo, responses=ERROR_RESPONSES,
             tags=["runs"])
    async def get_run(run_id: RunIdPath) -> RunInfo:
        service.advance(run_id)
        return service.run_info(run_id)

    @app.post(f"{API_PREFIX}/runs/{{run_id}}/close", response_model=RunInfo,
              responses=ERROR_RESPONSES, tags=["runs"])
    async def close_run(
        run_id: RunIdPath, authorization: Annotated[str | None, Header()] = None
    ) -> RunInfo:
        auth.require_admin(authorization)
        service.close_run(run_id)
        return service.run_info(run_id)

    @app.get(f"{API_PREFIX}/runs/{{run_id}}/status", response_model=RunStatus,
             responses=ERROR_RESPONSES, tags=["runs"])
    async def run_status(
        run_id: RunIdPath, history: Annotated[int, Query(ge=0, le=HISTORY_LIMIT)] = HISTORY_LIMIT,
    ) -> RunStatus:
        """`history`: how many of the latest closed rounds to summarize (0: none, for a peer that
        needs only the members)."""
        service.advance(run_id)
        return service.status(run_id, now=clock(), history_limit=history)

    # -- peers ------------------------------------------------------------------------------

    @app.post(f"{API_PREFIX}/runs/{{run_id}}/join", response_model=JoinResponse,
              responses=ERROR_RESPONSES, tags=["peers"])
    async def join(run_id: RunIdPath, body: JoinRequest, request: Request) -> JoinResponse:
        signer = await signed_peer(request, public_key=bytes.fromhex(body.public_key))
        return service.join(run_id, signer, body)

    @app.post(f"{API_PREFIX}/runs/{{run_id}}/heartbeat", response_model=HeartbeatResponse,
              responses=ERROR_RESPONSES, tags=["peers"])
    async def heartbeat(
        run_id: RunIdPath, body: HeartbeatRequest, request: Request
    ) -> HeartbeatResponse:
        return service.heartbeat(run_id, await signed_peer(request), body)

    @app.post(f"{API_PREFIX}/runs/{{run_id}}/leave", response_model=LeaveResponse,
              responses=ERROR_RESPONSES, tags=["peers"])
    async def leave(
        run_id: RunIdPath, request: Request, body: LeaveRequest | None = None
    ) -> LeaveResponse:
        peer_id = await signed_peer(request)
        return service.leave(run_id, peer_id, body or LeaveRequest())

    # -- rounds -----------------------------------------------------------------------------

    @app.post(f"{API_PREFIX}/runs/{{run_id}}/rounds/{{round_index}}/submit",
              response_model=SubmitResponse, responses=ERROR_RESPONSES, tags=["rounds"])
    async def submit(
        run_id: RunIdPath, round_index: RoundPath, body: SubmitRequest, request: Request
    ) -> SubmitResponse:
        return service.submit(run_id, round_index, await signed_peer(request), body)

    @app.get(f"{API_PREFIX}/runs/{{run_id}}/rounds/{{round_index}}", response_model=RoundView,
             responses=ERROR_RESPONSES, tags=["rounds"])
    async def get_round(
        run_id: RunIdPath,
        round_index: RoundPath,
        wait_s: Annotated[float, Query(ge=0.0, le=MAX_LONG_POLL_S)] = 0.0,
        submitted_gt: Annotated[int | None, Query(ge=0)] = None,
    ) -> RoundView:
        """Long-poll: answers once round `round_index` is closed, or (with `submitted_gt`) once more
        than that many packets were submitted to it, or after `wait_s` seconds."""
        give_up_at = time.monotonic() + wait_s
        while True:
            event = events.current(run_id)
            service.advance(run_id)
            if service.round_is_settled(run_id, round_index):
                break
            if submitted_gt is not None and service.num_submitted(run_id, round_index) > submitted_gt:
                break
            remaining_s = give_up_at - time.monotonic()
            if remaining_s <= 0:
                break
            await events.wait(event, remaining_s)
        return service.round_view(run_id, round_index)

    @app.post(f"{API_PREFIX}/runs/{{run_id}}/rounds/{{round_index}}/applied",
              response_model=AppliedResponse, responses=ERROR_RESPONSES, tags=["rounds"])
    async def applied(
        run_id: RunIdPath, round_index: RoundPath, body: AppliedRequest, request: Request
    ) -> AppliedResponse:
        return service.applied(run_id, round_index, await signed_peer(request), body)

    return app


async def _tick_forever(service: CoordinatorService, tick_s: float) -> None:
    while True:
        try:
            service.tick()
        except Exception:
            # A failed tick (say, a database hiccup) must not stop deadlines for good.
            log.exception("coordinator tick failed")
        await asyncio.sleep(tick_s)
