"""ASGI middleware: refuse request bodies over a size limit before anything parses them, and
count responses by status for `/metrics`.

The body is read here in full (it is small by construction) and replayed to the app, so the
limit holds for chunked uploads without a Content-Length too, and the app never sees a partial
body. A declared Content-Length over the limit is refused without reading anything.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Awaitable, Callable

from coordinator import errors

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyLimitMiddleware:
    def __init__(self, app: Any, max_body_bytes: int, response_counts: Counter[int]):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.response_counts = response_counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.response_counts[int(message["status"])] += 1
            await send(message)

        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await self._refuse(counting_send, declared.isdigit())
            return
        chunks: list[bytes] = []
        size_bytes = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size_bytes += len(chunk)
            if size_bytes > self.max_body_bytes:
                await self._refuse(counting_send, True)
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

    async def _refuse(self, send: Send, too_large: bool) -> None:
        error = (
            errors.BodyTooLarge(f"request bodies are limited to {self.max_body_bytes} bytes")
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
