"""A node's side of the packet mirror: uploading its own packet to the presigned URL the
coordinator answered its submission with (`SubmitResponse.mirror_put_url`), and parameter
snapshots to and from it (docs/DESIGN.md, "The packet mirror").

    spawn(upload(url, packet, timeout_s=60))    # True once the store took it; never raises
    await upload_snapshot(url, snapshot, timeout_s=60)     # streamed unit by unit; never raises
    await download_snapshot(url, size_bytes, sink, timeout_s=60)   # into a SnapshotSink; never raises

The URL is signed for exactly the submitted size, so the store refuses any other body. The
upload runs in the background beside the round: it is bounded in time (`timeout_s` a try), tried
again once, and a failure is logged once and costs only the mirror's copy (peers still fetch the
packet from this node and from each other). Fetching packets from the mirror is
node/exchange/fetch.py.

A snapshot (node/training/snapshot.py's `Snapshot`, its `SnapshotSink`) moves as its stream: the
upload reads one verified unit at a time (prologue, then 4 MiB chunks) into the PUT body, whose
Content-Length is the layout's total (the URL signs it); the download checks the offered length
against the sink's layout before any body byte, hands the sink each unit as it completes (a unit
that does not verify ends the download: that copy is bad) and, when the connection breaks,
asks again from the sink's offset with a Range GET, `TRIES` times in all. Host memory is one unit
either way.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from protocol.errors import MalformedPacket, ProtocolError

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


async def upload_snapshot(url: str, snapshot, *, timeout_s: float = 60.0, label: str = "snapshot") -> bool:
    """PUT `snapshot`'s stream to the presigned `url`, read unit by unit as it is sent; True once
    the store answered 2xx. A source that moved on (`StaleSnapshot`) or a refusal: False, logged."""
    started, last = time.monotonic(), ""
    for attempt in range(TRIES):

        async def body():
            offset = 0
            while offset < snapshot.size_bytes:
                start, unit = await asyncio.to_thread(snapshot.read_unit, offset)
                yield bytes(unit[offset - start :])
                offset = start + len(unit)

        try:
            async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
                response = await client.put(url, content=body(), headers={"Content-Length": str(snapshot.size_bytes)})
            if 200 <= response.status_code < 300:
                log.info(
                    "%s: %d bytes in the mirror after %.2f s", label, snapshot.size_bytes, time.monotonic() - started
                )
                return True
            last = f"HTTP {response.status_code}: {response.text[:200]}"
        except (httpx.HTTPError, OSError) as e:
            last = repr(e)
        except Exception as e:  # the snapshot's source moved on (StaleSnapshot): another try reads the same
            log.warning("%s: not in the mirror: %s", label, e)
            return False
        if attempt + 1 < TRIES:
            await asyncio.sleep(RETRY_PAUSE_S)
    log.warning("%s: not in the mirror after %d tries (%s)", label, TRIES, last)
    return False


async def download_snapshot(
    url: str, size_bytes: int, sink, *, timeout_s: float = 60.0, label: str = "snapshot"
) -> bool:
    """Stream the mirror's snapshot at `url` into `sink` (which expects its digest already), each
    unit verified by the sink before it is written; True once the sink is done. False, logged:
    bytes that are not the snapshot (a wrong length, a unit that does not verify), or `TRIES`
    connections that broke off; a retry resumes from the sink's offset."""
    if size_bytes != sink.total_bytes:
        log.warning("%s: the mirror's copy has %d bytes, this model's snapshot %d", label, size_bytes, sink.total_bytes)
        return False
    last = ""
    for attempt in range(TRIES):
        try:
            await _download_from(url, sink, timeout_s)
            return True
        except ProtocolError as e:
            log.warning("%s: the mirror's copy refused at byte %d: %s", label, sink.offset, e)
            return False
        except (httpx.HTTPError, OSError, asyncio.TimeoutError) as e:
            last = repr(e)
        if attempt + 1 < TRIES:
            await asyncio.sleep(RETRY_PAUSE_S)
    log.warning("%s: not loaded from the mirror after %d tries (%s)", label, TRIES, last)
    return False


async def _download_from(url: str, sink, timeout_s: float) -> None:
    """One GET from the sink's offset (a Range GET past the start), unit by unit into the sink."""
    offset = sink.offset
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        async with client.stream("GET", url, headers=headers) as response:
            if response.status_code != (206 if offset else 200):
                raise httpx.HTTPStatusError(
                    f"the mirror answered {response.status_code}", request=response.request, response=response
                )
            length = int(response.headers.get("Content-Length", -1))
            if length != sink.total_bytes - offset:
                raise MalformedPacket(
                    f"the mirror offers {length} bytes from {offset}, the snapshot has {sink.total_bytes}"
                )
            pending = bytearray()
            async for piece in response.aiter_bytes():
                pending += piece
                while not sink.done and len(pending) >= (size := (unit := sink.next_unit()).end - unit.start):
                    await asyncio.to_thread(sink.accept, bytes(pending[:size]))
                    del pending[:size]
                if len(pending) > 0 and sink.done:
                    raise MalformedPacket("the mirror sent more bytes than it offered")
    if not sink.done:
        raise httpx.ReadError(f"the mirror's body ended at byte {sink.offset} of {sink.total_bytes}")
