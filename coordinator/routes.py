"""The coordinator's routes, one `APIRouter` per concern; `coordinator.app.create_app` mounts them.

Routes are thin: authenticate, call `CoordinatorService` for a change or its `Views` for a read,
return a `protocol.http` model. A read never applies the rules (rounds advance on writes and on
the service's tick): it answers with what was committed. Everything that touches the database (the signature check reads
the peer's key and records its nonce) runs on the database thread (`coordinator.db_worker`), one
hop per request, and the answer is serialised there too (`_json`): the event loop only reads
bodies, parks long-polls and writes bytes. The heavy reads - a run's status, a round's view with
its manifest, the metrics - run on a second thread with a read-only connection of their own
(`ReadSide`), so that a heartbeat never waits behind a status of hundreds of peers. Each factory is handed what its routes use:

- `ops_router`: ``/healthz`` (the process answers), ``/readyz`` (its database reads and writes),
  ``/metrics`` (with whether this replica leads) and the status page ``/`` (public).
- `runs_router`: create, list, read, close a run, and its status JSON (admin or public).
- `peers_router`: join, heartbeat and leave (signed by the peer).
- `rounds_router`: submit, the round long-poll, the applied report and the missing-packet
  report (signed, or public).

Paths, models and auth per route are tabled in `protocol.http`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections import Counter
from typing import Annotated, Callable, Literal

from fastapi import APIRouter, Header, Path, Query, Request, Response
from fastapi.responses import HTMLResponse, PlainTextResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, BeforeValidator

from coordinator import errors, metrics, page
from coordinator.auth import Authenticator
from coordinator.db_worker import DatabaseWorker, SharedReads
from coordinator.reachability import dial_back
from coordinator.service import CoordinatorService
from coordinator.storage import Storage
from coordinator.storage.cluster import Cluster
from coordinator.views import HISTORY_LIMIT, Views
from protocol.fields import ResponseModel
from protocol.http import (
    API_PREFIX,
    MAX_LONG_POLL_S,
    AppliedRequest,
    AppliedResponse,
    ErrorBody,
    Health,
    HeartbeatRequest,
    HeartbeatResponse,
    JoinChallenge,
    JoinRequest,
    JoinResponse,
    LeaveRequest,
    LeaveResponse,
    MissingRequest,
    MissingResponse,
    RoundView,
    RunCreated,
    RunInfo,
    RunList,
    RunStatus,
    SnapshotRecorded,
    SnapshotUploaded,
    SubmitRequest,
    SubmitResponse,
)
from protocol.run_config import RunConfig

log = logging.getLogger("locoswarm.coordinator")


def _decimal_digits(value: object) -> object:
    """Integers in a path or query are written in digits: "2.0", "+2" or " 2" are not one."""
    if isinstance(value, str) and not re.fullmatch(r"-?[0-9]+", value):
        raise ValueError("must be a whole number written in decimal digits")
    return value


Digits = BeforeValidator(_decimal_digits)
RunIdPath = Annotated[str, Path(pattern=r"^[a-z0-9][a-z0-9-]{0,63}$", max_length=64)]
RoundPath = Annotated[int, Path(ge=0, le=2**31), Digits]
ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ErrorBody} for status in (400, 401, 403, 404, 409, 413, 422, 429, 503)
}


class Ready(ResponseModel):
    """`/readyz`'s answer when the database took a read and a write (else 503 ErrorBody)."""

    status: Literal["ready"]


class ReadSide:
    """Where the heavy reads run: a read-only replica of `primary` (`Storage.replica`) with its own
    `Views`, on a database thread of its own whose identical reads share one call (`reads`). The
    replica opens on first use, on that thread, and `close` (the app's lifespan) closes both."""

    def __init__(self, primary: Storage):
        self.primary = primary
        self.reads = SharedReads(DatabaseWorker("coordinator-read"))
        self._views: Views | None = None

    @property
    def views(self) -> Views:
        if self._views is None:
            self._views = Views(self.primary.replica())
        return self._views

    @property
    def storage(self) -> Storage:
        return self.views.storage

    def close(self) -> None:
        self.reads.worker.stop()
        if self._views is not None:
            self._views.storage.close()
            self._views = None


class RunEvents:
    """One `asyncio.Event` per run, replaced each time it fires: a waiter takes the current event
    *before* reading state, so a change committed after the read still wakes it. The events live
    on the event loop; `notify` may be called from any thread (the service commits on the
    database thread, another replica's change is heard on the link's thread) and hands the
    wake-up to the loop, where `before_wake` runs first. `notify_all` wakes every run's.

    A change committed by another replica may land while a shared read that began before it is
    still running here, and a waiter woken by it would join that read and miss the change:
    `before_wake` detaches the shared reads (`SharedReads.detach`), so the re-check starts afresh."""

    def __init__(self, before_wake: Callable[[], None] = lambda: None) -> None:
        self._events: dict[str, asyncio.Event] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.before_wake = before_wake
        self.num_waiting = 0  # long-polls parked right now (tests wait on it, metrics show it)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def current(self, run_id: str) -> asyncio.Event:
        self._loop = asyncio.get_running_loop()
        return self._events.setdefault(run_id, asyncio.Event())

    async def wait(self, event: asyncio.Event, timeout_s: float) -> None:
        self.num_waiting += 1
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), timeout=timeout_s)
        finally:
            self.num_waiting -= 1

    def notify(self, run_id: str) -> None:
        self._on_loop(self._wake, run_id)

    def notify_all(self) -> None:
        self._on_loop(self._wake_all)

    def _on_loop(self, wake: Callable[..., None], *args: str) -> None:
        loop = self._loop
        if loop is None:
            return  # nobody ever waited: nothing to wake
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            wake(*args)
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is left to wake
                loop.call_soon_threadsafe(wake, *args)

    def _wake(self, run_id: str) -> None:
        event = self._events.pop(run_id, None)
        if event is not None:
            self.before_wake()
            event.set()

    def _wake_all(self) -> None:
        events, self._events = self._events, {}
        self.before_wake()
        for event in events.values():
            event.set()


def json_number(text: str) -> int | float:
    """A JSON number with a fraction part or exponent (`json.loads`' parse_float): an int when it
    is whole, as JSON Schema counts it."""
    value = float(text)
    return int(value) if value.is_integer() else value


class _JsonNumbersRequest(Request):
    async def json(self) -> object:
        if not hasattr(self, "_json"):
            self._json = json.loads(await self.body(), parse_float=json_number)
        return self._json


class JsonSchemaRoute(APIRoute):
    """Reads JSON bodies with numbers as JSON Schema counts them, which is how the OpenAPI document
    describes them: ``2.0`` is the integer 2, so an integer field takes it, while ``2.5`` stays a
    fraction and is refused there. Everything else stays strict (no "2" for 2: request models)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def with_json_numbers(request: Request) -> Response:
            return await handler(_JsonNumbersRequest(request.scope, request.receive))

        return with_json_numbers


def _json(model: BaseModel | bytes) -> Response:
    """A response model as JSON, serialised on the database thread where the model was built (or
    the bytes a shared read made there once for all its requests). FastAPI would otherwise dump,
    re-validate and re-encode it on the event loop: for the status of a run with hundreds of
    peers, tens of milliseconds with every other request waiting."""
    content = model if isinstance(model, bytes) else _encoded(model)
    return Response(content, media_type="application/json")


def _encoded(model: BaseModel) -> bytes:
    return model.model_dump_json().encode()


async def _signer(auth: Authenticator, request: Request, public_key: bytes | None = None) -> Callable[[], str]:
    """Read the body here on the loop; the check returned runs on the database thread (it reads
    the peer's key and records the nonce) and gives the id of the peer that signed the request."""
    body = await request.body()
    method, path, headers = request.method, request.url.path, request.headers
    return lambda: auth.verify_peer(method, path, headers, body, public_key=public_key)


def ops_router(
    storage: Storage,
    service: CoordinatorService,
    worker: DatabaseWorker,
    read: ReadSide,
    response_counts: Counter[int],
    cluster: Cluster,
    events: RunEvents,
) -> APIRouter:
    router = APIRouter(tags=["ops"], route_class=JsonSchemaRoute)

    @router.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        """Liveness: the process answers. It never touches the database (see /readyz). With the
        coordinator's clock, which nodes check theirs against before they join."""
        return Health(status="ok", server_time=service.clock())

    @router.get("/readyz", response_model=Ready, responses={503: {"model": ErrorBody}})
    async def readyz() -> Ready:
        """Readiness: the database takes a read and a write now (`Storage.probe`); else 503
        ``storage_unavailable``."""
        try:
            await worker.run(storage.probe, service.clock())
        except errors.StorageUnavailable:
            raise
        except Exception as e:
            # Not ready either way, and a probe must never get the 500 path's dropped connection.
            log.exception("readiness probe failed")
            raise errors.StorageUnavailable(f"the readiness probe failed: {type(e).__name__}") from e
        return Ready(status="ready")

    @router.get("/metrics", response_class=PlainTextResponse)
    async def get_metrics() -> PlainTextResponse:
        counts = Counter(response_counts)  # a copy: the loop goes on counting meanwhile
        now = service.clock()
        waiting = events.num_waiting

        def text_now() -> str:
            return metrics.render(read.storage, read.views, now, counts, cluster, waiting)

        text = await read.reads.worker.run(text_now)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @router.get("/", response_class=HTMLResponse)
    async def status_page(run: Annotated[str | None, Query(max_length=64)] = None) -> HTMLResponse:
        return HTMLResponse(page.render_page(run or await read.reads.worker.run(lambda: read.views.latest_run_id())))

    return router


def runs_router(
    service: CoordinatorService, auth: Authenticator, worker: DatabaseWorker, reads: SharedReads, read: ReadSide
) -> APIRouter:
    router = APIRouter(prefix=API_PREFIX, tags=["runs"], route_class=JsonSchemaRoute)
    views = service.views

    @router.post("/runs", response_model=RunCreated, responses=ERROR_RESPONSES)
    async def create_run(config: RunConfig, authorization: Annotated[str | None, Header()] = None) -> RunCreated:
        auth.require_admin(authorization)
        return RunCreated(run_id=await worker.run(service.create_run, config))

    @router.get("/runs", response_model=RunList)
    async def list_runs() -> Response:
        return _json(await reads.run("runs", lambda: _encoded(views.list_runs())))

    @router.get("/runs/{run_id}", response_model=RunInfo, responses=ERROR_RESPONSES)
    async def get_run(run_id: RunIdPath) -> Response:
        return _json(await reads.run(("run", run_id), lambda: _encoded(views.run_info(run_id))))

    @router.post("/runs/{run_id}/close", response_model=RunInfo, responses=ERROR_RESPONSES)
    async def close_run(run_id: RunIdPath, authorization: Annotated[str | None, Header()] = None) -> Response:
        auth.require_admin(authorization)

        def answer() -> Response:
            service.close_run(run_id)
            return _json(views.run_info(run_id))

        return await worker.run(answer)

    @router.get("/runs/{run_id}/status", response_model=RunStatus, responses=ERROR_RESPONSES)
    async def run_status(
        run_id: RunIdPath,
        history: Annotated[int, Query(ge=0, le=HISTORY_LIMIT), Digits] = HISTORY_LIMIT,
    ) -> Response:
        """`history`: how many of the latest closed rounds to summarize (0: none, for a peer that
        needs only the members)."""
        status = await read.reads.run(
            ("status", run_id, history),
            lambda: _encoded(read.views.status(run_id, now=service.clock(), history_limit=history)),
        )
        return _json(status)

    return router


def peers_router(service: CoordinatorService, auth: Authenticator, worker: DatabaseWorker) -> APIRouter:
    router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}", tags=["peers"], route_class=JsonSchemaRoute)

    @router.get("/join-challenge", response_model=JoinChallenge, responses=ERROR_RESPONSES)
    async def join_challenge(run_id: RunIdPath) -> Response:
        """The proof of work a new key solves before joining (protocol/join_pow.py; bits 0: none)."""
        return await worker.run(lambda: _json(service.join_challenge(run_id)))

    @router.post("/join", response_model=JoinResponse, responses=ERROR_RESPONSES)
    async def join(run_id: RunIdPath, body: JoinRequest, request: Request) -> Response:
        signer = await _signer(auth, request, public_key=bytes.fromhex(body.public_key))
        # The direct peer's address: behind a proxy every join shares the proxy's (set its own limits).
        source = request.client.host if request.client else None
        reachable = None if body.reachable is False else await dial_back(source, body.listen_multiaddrs)
        return await worker.run(lambda: _json(service.join(run_id, signer(), body, source=source, reachable=reachable)))

    @router.post("/heartbeat", response_model=HeartbeatResponse, responses=ERROR_RESPONSES)
    async def heartbeat(run_id: RunIdPath, body: HeartbeatRequest, request: Request) -> Response:
        signer = await _signer(auth, request)
        return await worker.run(lambda: _json(service.heartbeat(run_id, signer(), body)))

    @router.post("/leave", response_model=LeaveResponse, responses=ERROR_RESPONSES)
    async def leave(run_id: RunIdPath, request: Request, body: LeaveRequest | None = None) -> Response:
        signer = await _signer(auth, request)
        return await worker.run(lambda: _json(service.leave(run_id, signer(), body or LeaveRequest())))

    return router


def rounds_router(
    service: CoordinatorService,
    auth: Authenticator,
    events: RunEvents,
    worker: DatabaseWorker,
    reads: SharedReads,
    read: ReadSide,
) -> APIRouter:
    router = APIRouter(prefix=f"{API_PREFIX}/runs/{{run_id}}/rounds", tags=["rounds"], route_class=JsonSchemaRoute)
    views = service.views

    @router.post("/{round_index}/submit", response_model=SubmitResponse, responses=ERROR_RESPONSES)
    async def submit(run_id: RunIdPath, round_index: RoundPath, body: SubmitRequest, request: Request) -> Response:
        signer = await _signer(auth, request)
        return await worker.run(lambda: _json(service.submit(run_id, round_index, signer(), body)))

    @router.get("/{round_index}", response_model=RoundView, responses=ERROR_RESPONSES)
    async def get_round(
        run_id: RunIdPath,
        round_index: RoundPath,
        wait_s: Annotated[float, Query(ge=0.0, le=MAX_LONG_POLL_S)] = 0.0,
        submitted_gt: Annotated[int | None, Query(ge=0), Digits] = None,
        version_gt: Annotated[int | None, Query(ge=0, le=2**31), Digits] = None,
    ) -> Response:
        """Long-poll: answers once round `round_index` is closed, or (with `submitted_gt`) once more
        than that many packets were submitted to it, or (with `version_gt`, for a closed round)
        once its manifest version exceeds that, or after `wait_s` seconds."""

        def answered() -> bool:
            over = views.round_is_over(run_id, round_index)
            if version_gt is None and over:
                return True
            if version_gt is not None:
                version = views.manifest_version(run_id, round_index)
                if (version is None and over) or (version or 0) > version_gt:
                    return True  # a round that never ran answers its refusal at once
            return submitted_gt is not None and views.num_submitted(run_id, round_index) > submitted_gt

        # Every peer parks here, and a submission wakes them all: they share the checks and the view.
        give_up_at = time.monotonic() + wait_s
        while True:
            event = events.current(run_id)
            if await reads.run(("round-answered", run_id, round_index, submitted_gt, version_gt), answered):
                break
            remaining_s = give_up_at - time.monotonic()
            if remaining_s <= 0:
                break
            await events.wait(event, remaining_s)
        view = await read.reads.run(
            ("round", run_id, round_index), lambda: _encoded(read.views.round_view(run_id, round_index))
        )
        return _json(view)

    @router.post("/{round_index}/applied", response_model=AppliedResponse, responses=ERROR_RESPONSES)
    async def applied(run_id: RunIdPath, round_index: RoundPath, body: AppliedRequest, request: Request) -> Response:
        signer = await _signer(auth, request)
        return await worker.run(lambda: _json(service.applied(run_id, round_index, signer(), body)))

    @router.post("/{round_index}/missing", response_model=MissingResponse, responses=ERROR_RESPONSES)
    async def missing(run_id: RunIdPath, round_index: RoundPath, body: MissingRequest, request: Request) -> Response:
        """Report manifest entries of a closed round whose packets could not be fetched; the
        coordinator amends the manifest when they are due (protocol.http, "Amended manifests")."""
        signer = await _signer(auth, request)
        return await worker.run(lambda: _json(service.report_missing(run_id, round_index, signer(), body)))

    @router.post("/{round_index}/snapshot", response_model=SnapshotRecorded, responses=ERROR_RESPONSES)
    async def snapshot(run_id: RunIdPath, round_index: RoundPath, body: SnapshotUploaded, request: Request) -> Response:
        """Report the snapshot of round r+1's start put into the packet mirror at the URL the answer
        to this peer's applied report of round r handed it (protocol.http, "Snapshots in the packet mirror")."""
        signer = await _signer(auth, request)
        return await worker.run(lambda: _json(service.snapshot_uploaded(run_id, round_index, signer(), body)))

    return router
