"""The coordinator's routes, one `APIRouter` per concern; `coordinator.app.create_app` mounts them.

Routes are thin: authenticate, call `CoordinatorService` for a change or its `Views` for a read,
return a `protocol.http` model. Each factory is handed what its routes use:

- `ops_router`: ``/healthz`` (the process answers), ``/readyz`` (its database reads and writes),
  ``/metrics`` and the status page ``/`` (public).
- `runs_router`: create, list, read, close a run, and its status JSON (admin or public).
- `peers_router`: join, heartbeat and leave (signed by the peer).
- `rounds_router`: submit, the round long-poll, the applied report and the missing-packet
  report (signed, or public).

Paths, models and auth per route are tabled in `protocol.http`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import Annotated, Literal

from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.responses import HTMLResponse, PlainTextResponse

from coordinator import errors, metrics, page
from coordinator.auth import Authenticator
from coordinator.service import CoordinatorService
from coordinator.storage import Storage
from coordinator.views import HISTORY_LIMIT
from protocol.fields import ResponseModel
from protocol.http import API_PREFIX, MAX_LONG_POLL_S, AppliedRequest, AppliedResponse, ErrorBody, Health, HeartbeatRequest, HeartbeatResponse, JoinRequest, JoinResponse, LeaveRequest, LeaveResponse, MissingRequest, MissingResponse, RoundView, RunCreated, RunInfo, RunList, RunStatus, SubmitRequest, SubmitResponse
from protocol.run_config import RunConfig

log = logging.getLogger("locoswarm.coordinator")

RunIdPath = Annotated[str, Path(pattern=r"^[a-z0-9][a-z0-9-]{0,63}$", max_length=64)]
RoundPath = Annotated[int, Path(ge=0, le=2**31)]
ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ErrorBody} for status in (400, 401, 403, 404, 409, 413, 422, 429, 503)
}


class Ready(ResponseModel):
    """`/readyz`'s answer when the database took a read and a write (else 503 ErrorBody)."""

    status: Literal["ready"]


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


async def _signed_peer(auth: Authenticator, request: Request, public_key: bytes | None = None) -> str:
    body = await request.body()
    return auth.verify_peer(
        request.method, request.url.path, request.headers, body, public_key=public_key
    )


def ops_router(
    storage: Storage, service: CoordinatorService, response_counts: Counter[int]
) -> APIRouter:
    router = APIRouter(tags=["ops"])

    @router.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        """Liveness: the process answers. It never touches the database (see /readyz)."""
        return Health(status="ok")

    @router.get("/readyz", response_model=Ready, responses={503: {"model": ErrorBody}})
    async def readyz() -> Ready:
        """Readiness: the database takes a read and a write now (`Storage.probe`); else 503
        ``storage_unavailable``."""
        try:
            storage.probe(service.clock())
        except errors.StorageUnavailable:
            raise
        except Exception as e:
            # Not ready either way, and a probe must never get the 500 path's dropped connection.
            log.exception("readiness probe failed")
            raise errors.StorageUnavailable(f"the readiness probe failed: {type(e).__name__}") from e
        return Ready(status="ready")

    @router.get("/metrics", response_class=PlainTextResponse)
    async def get_metrics() -> PlainTextResponse:
        text = metrics.render(storage, service.views, service.clock(), response_counts)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @router.get("/", response_class=HTMLResponse)
    async def status_page(run: Annotated[str | None, Query(max_length=64)] = None) -> HTMLResponse:
        return HTMLResponse(page.render_page(run or service.views.latest_run_id()))

    return router


def runs_router(service: CoordinatorService, auth: Authenticator) -> APIRouter:
    router = APIRouter(prefix=API_PREFIX, tags=["runs"])
    views = service.views

    @router.post("/runs", response_model=RunCreated, responses=ERROR_RESPONSES)
    async def create_run(
        config: RunConfig, authorization: Annotated[str | None, Header()] = None
    ) -> RunCreated:
        auth.require_admin(authorization)
        return RunCreated(run_id=service.create_run(config))

    @router.get("/runs", response_model=RunList)
    async def list_runs() -> RunList:
        return views.list_runs()

    @router.get("/runs/{run_id}", response_model=RunInfo, responses=ERROR_RESPONSES)
    async def get_run(run_id: RunIdPath) -> RunInfo:
        service.advance(run_id)
        return views.run_info(run_id)

    @router.post("/runs/{run_id}/close", response_model=RunInfo, responses=ERROR_RESPONSES)
    async def close_run(
        run_id: RunIdPath, authorization: Annotated[str | None, Header()] = None
    ) -> RunInfo:
        auth.require_admin(authorization)
        service.close_run(run_id)
        return views.run_info(run_id)

    @router.get("/runs/{run_id}/status", response_model=RunStatus, responses=ERROR_RESPONSES)
    async def run_status(
        run_id: RunIdPath, history: Annotated[int, Query(ge=0, le=HISTORY_LIMIT)] = HISTORY_LIMIT,
    ) -> RunStatus:
        """`history`: how many of the latest closed rounds to summarize (0: none, for a peer that
        needs only the members)."""
        service.advance(run_id)
        return views.status(run_id, now=service.clock(), history_limit=history)

    return router


def peers_router(service: CoordinatorService, auth: Authenticator) -> APIRouter:
    router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}", tags=["peers"])

    @router.post("/join", response_model=JoinResponse, responses=ERROR_RESPONSES)
    async def join(run_id: RunIdPath, body: JoinRequest, request: Request) -> JoinResponse:
        signer = await _signed_peer(auth, request, public_key=bytes.fromhex(body.public_key))
        return service.join(run_id, signer, body)

    @router.post("/heartbeat", response_model=HeartbeatResponse, responses=ERROR_RESPONSES)
    async def heartbeat(
        run_id: RunIdPath, body: HeartbeatRequest, request: Request
    ) -> HeartbeatResponse:
        return service.heartbeat(run_id, await _signed_peer(auth, request), body)

    @router.post("/leave", response_model=LeaveResponse, responses=ERROR_RESPONSES)
    async def leave(
        run_id: RunIdPath, request: Request, body: LeaveRequest | None = None
    ) -> LeaveResponse:
        peer_id = await _signed_peer(auth, request)
        return service.leave(run_id, peer_id, body or LeaveRequest())

    return router


def rounds_router(service: CoordinatorService, auth: Authenticator, events: RunEvents) -> APIRouter:
    router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}/rounds", tags=["rounds"])
    views = service.views

    @router.post("/{round_index}/submit", response_model=SubmitResponse, responses=ERROR_RESPONSES)
    async def submit(
        run_id: RunIdPath, round_index: RoundPath, body: SubmitRequest, request: Request
    ) -> SubmitResponse:
        return service.submit(run_id, round_index, await _signed_peer(auth, request), body)

    @router.get("/{round_index}", response_model=RoundView, responses=ERROR_RESPONSES)
    async def get_round(
        run_id: RunIdPath,
        round_index: RoundPath,
        wait_s: Annotated[float, Query(ge=0.0, le=MAX_LONG_POLL_S)] = 0.0,
        submitted_gt: Annotated[int | None, Query(ge=0)] = None,
        version_gt: Annotated[int | None, Query(ge=0, le=2**31)] = None,
    ) -> RoundView:
        """Long-poll: answers once round `round_index` is closed, or (with `submitted_gt`) once more
        than that many packets were submitted to it, or (with `version_gt`, for a closed round)
        once its manifest version exceeds that, or after `wait_s` seconds."""
        give_up_at = time.monotonic() + wait_s
        while True:
            event = events.current(run_id)
            service.advance(run_id)
            settled = views.round_is_settled(run_id, round_index)
            if version_gt is None and settled:
                break
            if version_gt is not None:
                version = views.manifest_version(run_id, round_index)
                if (version is None and settled) or (version or 0) > version_gt:
                    break  # a round that never ran answers its refusal at once
            if submitted_gt is not None and views.num_submitted(run_id, round_index) > submitted_gt:
                break
            remaining_s = give_up_at - time.monotonic()
            if remaining_s <= 0:
                break
            await events.wait(event, remaining_s)
        return views.round_view(run_id, round_index)

    @router.post("/{round_index}/applied", response_model=AppliedResponse, responses=ERROR_RESPONSES)
    async def applied(
        run_id: RunIdPath, round_index: RoundPath, body: AppliedRequest, request: Request
    ) -> AppliedResponse:
        return service.applied(run_id, round_index, await _signed_peer(auth, request), body)

    @router.post("/{round_index}/missing", response_model=MissingResponse, responses=ERROR_RESPONSES)
    async def missing(
        run_id: RunIdPath, round_index: RoundPath, body: MissingRequest, request: Request
    ) -> MissingResponse:
        """Report manifest entries of a closed round whose packets could not be fetched; the
        coordinator amends the manifest when they are due (protocol.http, "Amended manifests")."""
        return service.report_missing(run_id, round_index, await _signed_peer(auth, request), body)

    return router
