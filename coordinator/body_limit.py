"""ASGI middleware: refuse request bodies over a size limit before anything parses them, and
count responses by status for `/metrics`.

The body is read here in full (it is small by construction) and replayed to the app, so the
limit holds for chunked uploads without a Content-Length too, and the app never sees a partial
body. A declared Content-Length over the limit is refused without reading anything.

The limit is `max_body_bytes`, unless `limit_for(scope)` says otherwise for a request: the app
raises it for a route whose valid bodies can be larger (`max_json_bytes` of the route's body
schema), so that no request the API schema admits is refused for its size.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any, Awaitable, Callable

try:  # the regular expression parser moved in Python 3.11
    import re._parser as regex_parser
except ImportError:  # pragma: no cover
    import sre_parse as regex_parser  # type: ignore[no-redef]

from coordinator import errors

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


# Characters a JSON encoder may spend on one character of a string: a character outside the Basic
# Multilingual Plane, escaped as a surrogate pair (json.dumps' default ensure_ascii).
MAX_BYTES_PER_CHAR = 12
MAX_NUMBER_CHARS = 24  # repr(-1.7976931348623157e+308); an integer is bounded by its schema


def max_json_bytes(schema: dict, definitions: dict, depth: int = 0) -> float:
    """The most bytes a JSON value valid under `schema` takes, as json.dumps writes it (", " and
    ": " separators, non-ASCII escaped); `math.inf` when the schema bounds it nowhere. Strings are
    bounded by maxLength or by their pattern's longest match, containers by maxItems and
    maxProperties, integers by their minimum and maximum."""
    if depth > 32:
        return math.inf  # a recursive schema
    if "$ref" in schema:
        return max_json_bytes(definitions[schema["$ref"].rsplit("/", 1)[-1]], definitions, depth + 1)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return max(max_json_bytes(option, definitions, depth + 1) for option in schema[key])
    if "const" in schema:
        return len(json.dumps(schema["const"]))
    if "enum" in schema:
        return max(len(json.dumps(value)) for value in schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        total = 2.0  # {}
        for name, value in schema.get("properties", {}).items():
            total += len(json.dumps(name)) + 2 + max_json_bytes(value, definitions, depth + 1) + 2
        extra = [value for value in schema.get("patternProperties", {}).values()]
        if isinstance(schema.get("additionalProperties"), dict):
            extra.append(schema["additionalProperties"])
        if extra:
            keys = [{"type": "string", "pattern": p} for p in schema.get("patternProperties", {})]
            key_bytes = max(max_json_bytes(k, definitions) for k in keys or [{"type": "string"}])
            if isinstance(schema.get("additionalProperties"), dict):
                key_bytes = max(key_bytes, max_json_bytes(schema.get("propertyNames", {"type": "string"}), definitions))
            value_bytes = max(max_json_bytes(v, definitions, depth + 1) for v in extra)
            total += schema.get("maxProperties", math.inf) * (key_bytes + 2 + value_bytes + 2)
        return total
    if kind == "array":
        if "prefixItems" in schema:
            return 2 + sum(max_json_bytes(item, definitions, depth + 1) + 2 for item in schema["prefixItems"])
        item_bytes = max_json_bytes(schema.get("items", {}), definitions, depth + 1)
        return 2 + schema.get("maxItems", math.inf) * (item_bytes + 2)
    if kind == "string":
        return 2 + MAX_BYTES_PER_CHAR * _max_chars(schema)
    if kind == "integer":
        bounds = [schema.get(k) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")]
        if (
            schema.get("minimum", schema.get("exclusiveMinimum")) is None
            or schema.get("maximum", schema.get("exclusiveMaximum")) is None
        ):
            return math.inf
        return max(len(str(int(b))) for b in bounds if b is not None) + 1
    if kind == "number":
        return MAX_NUMBER_CHARS
    if kind == "boolean":
        return 5
    if kind == "null":
        return 4
    return math.inf


def _max_chars(schema: dict) -> float:
    if "maxLength" in schema:
        return schema["maxLength"]
    if "pattern" in schema:
        _, longest = regex_parser.parse(schema["pattern"]).getwidth()
        return math.inf if longest >= regex_parser.MAXREPEAT else longest
    return math.inf


class BodyLimitMiddleware:
    def __init__(
        self,
        app: Any,
        max_body_bytes: int,
        response_counts: Counter[int],
        limit_for: Callable[[Scope], int] | None = None,
    ):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.response_counts = response_counts
        self.limit_for = limit_for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.response_counts[int(message["status"])] += 1
            await send(message)

        limit_bytes = self.max_body_bytes if self.limit_for is None else self.limit_for(scope)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit_bytes):
            await self._refuse(counting_send, declared.isdigit(), limit_bytes)
            return
        chunks: list[bytes] = []
        size_bytes = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size_bytes += len(chunk)
            if size_bytes > limit_bytes:
                await self._refuse(counting_send, True, limit_bytes)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            # After the body, the app only ever learns of a disconnect from the real channel.
            return await receive()

        await self.app(scope, replay, counting_send)

    async def _refuse(self, send: Send, too_large: bool, limit_bytes: int) -> None:
        error = (
            errors.BodyTooLarge(f"request bodies are limited to {limit_bytes} bytes")
            if too_large
            else errors.BadRequest("Content-Length is not a number")
        )
        payload = json.dumps({"error": error.code, "detail": error.detail}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": error.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})
