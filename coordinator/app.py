"""The coordinator's HTTP app: `create_app(storage, admin_token, clock=...)` assembles it.

`create_app` builds the service, the authenticator and the long-poll events, then the app around
them: the body-limit middleware, the error handlers below and the routers of `coordinator.routes`.
Service calls are synchronous and run one at a time on one database thread
(`coordinator.db_worker`), never on the event loop: every state change is a short transaction, and
serialising them makes the round rules race-free without locks, while the loop stays free to parse
requests and answer /healthz however busy the database is. The heavy reads (status, round views,
metrics) run on a second thread over a read-only replica connection (`routes.ReadSide`), closed
with the app's lifespan. Only long-polls wait, and they wait on a
per-run `asyncio.Event` (`routes.RunEvents`) that the service fires after each commit that opens
or closes a round or accepts a submission, never by polling the database. A background task has
the database thread call `service.tick()`, the coordinator's own clock: deadlines and heartbeat
timeouts take effect with nobody asking, and no read ever writes.

Replicas: several processes may serve one PostgreSQL database (`coordinator.storage.cluster`).
Their writes are serialised by the database's write lock, only the leader's background task
ticks, and each replica's long-polls also wake on the changes the others announce. One process on
SQLite is the leader of a cluster of one.

Every refusal is ``{"error": code, "detail": text}`` with a 4xx status: typed service errors,
validation errors (422, or 400 for malformed JSON), bodies over `max_body_bytes` (413, checked
before any parsing), unknown routes and methods (405 with ``Allow``). Each is a
`coordinator.errors` class, so its code is a `protocol.http.ErrorCode`. A failure of the database is the same body with 503
``storage_unavailable`` and ``Retry-After``, answered by the same handler as the refusals: the
handler for unhandled errors (500) re-raises after answering, which makes the server close the
connection, so no storage failure may reach it.

The OpenAPI document is the contract a schema fuzzer holds the app to (tests/integration/
test_schemathesis.py): every 422 is documented as that error body, not FastAPI's own, and no
body the schema admits is refused for its size: a route whose valid bodies can exceed
`max_body_bytes` gets a limit of its largest valid body (`body_limit.max_json_bytes`), for an
admin route only with the admin token (so nobody else can make the coordinator buffer megabytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import re
import time
from collections import Counter
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from coordinator import errors
from coordinator.auth import Authenticator
from coordinator.body_limit import BodyLimitMiddleware, max_json_bytes
from coordinator.db_worker import DatabaseWorker, SharedReads
from coordinator.routes import ReadSide, RunEvents, ops_router, peers_router, rounds_router, runs_router
from coordinator.rules.retention import DEFAULT_KEEP_ROUNDS
from coordinator.service import CoordinatorService
from coordinator.storage import Storage
from coordinator.storage.cluster import Cluster, open_cluster

log = logging.getLogger("locoswarm.coordinator")


def _refusal(
    error: errors.CoordinatorError, status: int | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    headers = dict(headers or {})
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    return JSONResponse(
        status_code=error.status if status is None else status,
        content={"error": error.code, "detail": error.detail},
        headers=headers or None,
    )


class _Paths:
    """The app's paths as its OpenAPI document lists them, matched against request paths; built
    on first use. The document, not the router, because it is the contract (and FastAPI's router
    internals differ between versions)."""

    def __init__(self, app: FastAPI):
        self.app = app
        self._compiled: list[tuple[re.Pattern[str], dict]] | None = None

    def item(self, path: str) -> dict | None:
        """The document's path item (method -> operation) for a request path, or None."""
        if self._compiled is None:
            self._compiled = [
                (re.compile("^" + re.sub(r"\\{[^/]+?\\}", "[^/]+", re.escape(template)) + "$"), item)
                for template, item in self.app.openapi().get("paths", {}).items()
            ]
        return next((item for pattern, item in self._compiled if pattern.match(path)), None)

    def allowed_methods(self, path: str) -> str:
        """What a 405 names in ``Allow``: every method the path takes (HEAD too, with GET)."""
        methods = {method.upper() for method in self.item(path) or {}}
        if "GET" in methods:
            methods.add("HEAD")
        return ", ".join(sorted(methods))


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
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # RFC 9110: a 405 says which methods the path does take
            headers["Allow"] = request.app.state.paths.allowed_methods(request.url.path)
        return _refusal(error, status=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _refusal(errors.Internal("internal error; see the coordinator log"))


def _openapi_with_error_bodies(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with its validation answer (HTTPValidationError) replaced by the
    ErrorBody this app really answers 422 with."""
    if app.openapi_schema is None:
        schema = FastAPI.openapi(app)  # builds and caches it in app.openapi_schema
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        if "ErrorBody" not in components:
            from protocol.http import ErrorBody

            components["ErrorBody"] = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}")
        error_body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
        for item in schema.get("paths", {}).values():
            for operation in item.values():
                answer = operation.get("responses", {}).get("422")
                if answer is not None and "HTTPValidationError" in str(answer.get("content")):
                    answer["content"] = error_body
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
    return app.openapi_schema


def _body_limits(app: FastAPI, paths: _Paths, max_body_bytes: int, auth: Authenticator) -> Callable[[dict], int]:
    """The body limit of a request: `max_body_bytes`, or the largest valid body of its operation
    when that is larger (an admin operation: only with the admin token)."""
    limits: dict[int, tuple[int, bool]] = {}  # id(operation) -> (limit, admin only)

    def limit_of(operation: dict) -> tuple[int, bool]:
        if id(operation) not in limits:
            body = operation.get("requestBody", {}).get("content", {}).get("application/json")
            definitions = app.openapi().get("components", {}).get("schemas", {})
            worst_bytes = max_json_bytes(body["schema"], definitions) if body else 0
            admin = any(
                p.get("in") == "header" and p.get("name", "").lower() == "authorization"
                for p in operation.get("parameters", [])
            )
            limits[id(operation)] = (
                math.ceil(worst_bytes) if max_body_bytes < worst_bytes < math.inf else max_body_bytes,
                admin,
            )
        return limits[id(operation)]

    def limit_for(scope: dict) -> int:
        method = str(scope.get("method", "")).lower()
        if method in ("get", "head", "options"):
            return max_body_bytes
        operation = (paths.item(scope.get("path", "")) or {}).get(method)
        if operation is None:
            return max_body_bytes
        limit_bytes, admin_only = limit_of(operation)
        if admin_only and limit_bytes > max_body_bytes:
            if not auth.is_admin(dict(scope.get("headers") or []).get(b"authorization")):
                return max_body_bytes
        return limit_bytes

    return limit_for


def tune_gc_for_serving() -> None:
    """Garbage collection for a long-running coordinator process (not for a test process that
    builds many apps): what is alive after start-up (the app, its models, its libraries) is
    frozen out of collection, and young collections wait for more allocations. A status of
    hundreds of peers lives for tens of milliseconds; with the interpreter's defaults its objects
    get promoted while alive, and every few seconds a full collection stops every thread for
    100 ms or more (bench_load, 500 peers: 8-9 full collections in 30 s, the heartbeats' p99).
    With these, one."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)


def create_app(
    storage: Storage,
    admin_token: str,
    clock: Callable[[], float] = time.time,
    tick_s: float | None = 0.2,
    max_body_bytes: int = 64 * 1024,
    rate_per_s: float = 20.0,
    rate_burst: float = 60.0,
    tune_gc: bool = False,
    keep_rounds: int = DEFAULT_KEEP_ROUNDS,
) -> FastAPI:
    """The coordinator app. `tick_s=None` runs no background task (rules then apply on writes,
    and when the caller calls ``app.state.service.tick()``), which keeps unit tests deterministic. `tune_gc`: the
    process serves only this app (`coordinator serve`): see `tune_gc_for_serving`, applied once
    the app has started. `keep_rounds`: rounds behind the current one whose per-peer rows are kept
    (coordinator/rules/retention.py; 0: all)."""
    worker = DatabaseWorker()
    reads = SharedReads(worker)
    read = ReadSide(storage)
    events = RunEvents(before_wake=lambda: (reads.detach(), read.reads.detach()))
    cluster = open_cluster(storage.db, on_change=events.notify, on_missed=events.notify_all)
    # The service commits on the database thread; `notify` hands the wake-up to the event loop.
    service = CoordinatorService(storage, clock=clock, on_change=events.notify, keep_rounds=keep_rounds)
    auth = Authenticator(service, admin_token, rate_per_s=rate_per_s, burst=rate_burst)
    response_counts: Counter[int] = Counter()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        events.bind(asyncio.get_running_loop())
        await asyncio.to_thread(cluster.start)
        await worker.run(service.resume, cluster.serving_since)
        ticker = asyncio.create_task(_tick_forever(worker, service, cluster, tick_s)) if tick_s else None
        if tune_gc:
            tune_gc_for_serving()
        try:
            yield
        finally:
            if ticker is not None:
                ticker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await ticker
            worker.stop()
            read.close()
            await asyncio.to_thread(cluster.stop)

    app = FastAPI(
        title="locoswarm coordinator",
        version="1",
        description="Runs, membership, rounds and manifests for SparseLoCo swarms.",
        lifespan=lifespan,
    )
    app.state.service = service
    app.state.events = events
    app.state.cluster = cluster
    app.state.worker = worker
    app.state.reads = reads
    app.state.read = read
    app.openapi = lambda: _openapi_with_error_bodies(app)  # type: ignore[method-assign]
    app.state.paths = _Paths(app)
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=max_body_bytes,
        response_counts=response_counts,
        limit_for=_body_limits(app, app.state.paths, max_body_bytes, auth),
    )
    _install_error_handlers(app)

    app.include_router(ops_router(storage, service, worker, read, response_counts, cluster, events))
    app.include_router(runs_router(service, auth, worker, reads, read))
    app.include_router(peers_router(service, auth, worker))
    app.include_router(rounds_router(service, auth, events, worker, reads, read))
    return app


async def _tick_forever(worker: DatabaseWorker, service: CoordinatorService, cluster: Cluster, tick_s: float) -> None:
    """The coordinator's clock: `service.tick` every `tick_s`, on the leading replica only."""
    failing_since: float | None = None  # monotonic time of the first failed tick of an outage
    while True:
        if not cluster.is_leader:
            await asyncio.sleep(tick_s)
            continue
        try:
            await worker.run(service.tick)
            cluster.ticked(service.clock())
            if failing_since is not None:
                log.warning(
                    "database usable again after %.0f s; deadlines and timeouts apply", time.monotonic() - failing_since
                )
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
