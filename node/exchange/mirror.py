"""The publisher's side of the packet mirror: uploading its own packet to the presigned URL the
coordinator answered its submission with (`SubmitResponse.mirror_put_url`).

    spawn(upload(url, packet, timeout_s=60))    # True once the store took it; never raises

The URL is signed for exactly the submitted size, so the store refuses any other body. The
upload runs in the background beside the round: it is bounded in time (`timeout_s` a try), tried
again once, and a failure is logged once and costs only the mirror's copy (peers still fetch the
packet from this node and from each other). Fetching from the mirror is node/exchange/fetch.py.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

log = logging.getLogger(__name__)

TRIES = 2  # the upload and one retry
RETRY_PAUSE_S = 1.0


async def upload(url: str, data: bytes, *, timeout_s: float = 60.0, label: str = "packet") -> bool:
    """PUT `data` to the presigned `url`; True once the store answered 2xx (see the module docstring)."""
    started, last = time.monotonic(), ""
    for attempt in range(TRIES):
        try:
            async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
                response = await asyncio.wait_for(
                    client.put(url, content=bytes(data), headers={"Content-Length": str(len(data))}), timeout_s
                )
            if 200 <= response.status_code < 300:
                log.debug("%s: %d bytes in the mirror after %.2f s", label, len(data), time.monotonic() - started)
                return True
            last = f"HTTP {response.status_code}: {response.text[:200]}"
        except (httpx.HTTPError, asyncio.TimeoutError, OSError) as e:
            last = repr(e)
        if attempt + 1 < TRIES:
            await asyncio.sleep(RETRY_PAUSE_S)
    log.warning("%s: not in the packet mirror after %d tries (%s); peers still serve it", label, TRIES, last)
    return False
