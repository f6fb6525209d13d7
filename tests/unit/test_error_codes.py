"""The coordinator's refusal codes are exactly `protocol.http.ErrorCode`, the codes nodes branch on.

Every code the coordinator answers with is the `code` of a class in `coordinator.errors` (the
HTTP layer's own refusals included), so comparing those classes with the literal covers both
directions: no code on the wire that the protocol does not list, no listed code nobody sends.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import get_args

import pytest
from pydantic import ValidationError

from coordinator import errors
from coordinator.body_limit import BodyLimitMiddleware
from protocol.http import ErrorBody, ErrorCode

pytestmark = pytest.mark.timeout(30)


def coordinator_codes() -> set[str]:
    return {
        value.code
        for value in vars(errors).values()
        if isinstance(value, type) and issubclass(value, errors.CoordinatorError)
    }


def test_every_coordinator_code_is_an_error_code_and_back():
    listed = get_args(ErrorCode)
    assert len(listed) == len(set(listed)), "a code listed twice"
    assert coordinator_codes() == set(listed)


def test_a_class_with_an_unlisted_code_fails_at_definition():
    with pytest.raises(TypeError, match="not in protocol.http.ErrorCode"):
        type("Typo", (errors.Conflict,), {"code": "stale_rund"})


def test_error_body_takes_only_listed_codes():
    assert ErrorBody(error="peer_gone", detail="rejoin").error == "peer_gone"
    with pytest.raises(ValidationError):
        ErrorBody(error="no_such_code", detail="x")


def test_http_layer_refusals_carry_listed_codes(tmp_path):
    from fastapi.testclient import TestClient

    from coordinator.app import create_app
    from coordinator.storage import open_storage
    from tests.fixtures.coordinator import ADMIN_TOKEN

    storage = open_storage(f"sqlite:///{tmp_path / 'c.db'}")
    app = create_app(storage, ADMIN_TOKEN, tick_s=None)
    with TestClient(app, raise_server_exceptions=False) as client:
        storage.close()  # every database call now raises a bug's error (not a storage failure)
        response = client.get("/v1/runs")
        assert client.get("/healthz").json()["status"] == "ok", "liveness never reads the database"
        not_ready = client.get("/readyz")
    assert response.status_code == 500
    assert response.json() == {"error": "internal", "detail": "internal error; see the coordinator log"}
    assert not_ready.status_code == 503 and not_ready.headers["Retry-After"] == "5"
    assert not_ready.json() == {
        "error": "storage_unavailable",
        "detail": "the readiness probe failed: ProgrammingError",
    }

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def never_called(scope, receive, send) -> None:
        raise AssertionError("the body limit let the request through")

    limit = BodyLimitMiddleware(never_called, max_body_bytes=10, response_counts=Counter())
    scope = {"type": "http", "headers": [(b"content-length", b"ten")]}
    asyncio.run(limit(scope, None, send))
    assert sent[0]["status"] == 400
    assert json.loads(sent[1]["body"]) == {"error": "bad_request", "detail": "Content-Length is not a number"}
