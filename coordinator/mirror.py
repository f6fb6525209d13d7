"""The packet mirror: presigned URLs for a run's S3-compatible object store (`exchange.mirror`).

    mirror = Mirror(config.exchange.mirror)                 # MirrorUnavailable: no credentials here
    mirror.put_url(run_id, round, peer_id, size_bytes)      # for the publisher, once its submission is accepted
    mirror.get_url(run_id, round, peer_id)                  # for every fetcher, in round views
    mirror.snapshot_put_url(run_id, round, digest, size)    # for a voter of round - 1 (rules/snapshots.py)
    mirror.snapshot_get_url(run_id, round, digest)          # for joiners and peers catching up

Only the coordinator holds credentials (the AWS environment variables, or anything else boto3's
credential chain finds); peers get presigned URLs and nothing else. A PUT URL signs the
Content-Length the peer submitted, so the store refuses a body of any other size; a GET URL reads
one object. Each packet's key is `object_key`: ``{prefix}{run_id}/{round:08d}/{peer_id}.pkt``;
each snapshot's `snapshot_key`: ``{snapshot_prefix}{run_id}/{round:08d}-{params_digest}.snap``
for the parameters that start `round` (a prefix of its own, so a lifecycle rule of its own) (the digest in the key keeps an upload of a digest that
lost the vote from overwriting the agreed one). A snapshot is one PUT, so at most
`MAX_SNAPSHOT_BYTES` (S3's limit for a single PUT); a larger model's snapshots stay off the store.

Signing is computation (HMAC over the request), no network: the store is never contacted here.
URLs are signed for `url_ttl_s` and handed out while younger than half of it (`REUSE_FRACTION`),
so every URL a peer receives stays valid at least `url_ttl_s / 2` from then on, and a round view
served to many peers signs each entry once per half-lifetime.

boto3 is imported by this module only, and this module only where a run has a mirror
(coordinator/views.py imports it lazily), so a coordinator without one never loads boto3.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import boto3
from botocore.config import Config

from protocol.run_config import MirrorSection

REUSE_FRACTION = 0.5  # a signed URL is handed out until it is this share of its lifetime old
MAX_SNAPSHOT_BYTES = 5 * 2**30  # S3 takes at most 5 GiB in one PUT
MAX_CACHED = 20_000  # signed URLs kept for reuse (about 1 KB each); beyond it, those past reuse are dropped


class MirrorUnavailable(Exception):
    """The coordinator cannot sign for the mirror (no credentials in its environment)."""


def object_key(prefix: str, run_id: str, round: int, peer_id: str) -> str:
    """The object that holds `peer_id`'s packet of round `round` of run `run_id`."""
    return f"{prefix}{run_id}/{round:08d}/{peer_id}.pkt"


def snapshot_key(snapshot_prefix: str, run_id: str, round: int, params_digest: str) -> str:
    """The object that holds the snapshot of the parameters `params_digest` that start `round`."""
    return f"{snapshot_prefix}{run_id}/{round:08d}-{params_digest}.snap"


class Mirror:
    """Signs URLs for one run's mirror (see the module docstring); safe to share between threads."""

    def __init__(self, section: MirrorSection, clock: Callable[[], float] = time.time):
        self.section = section
        self._clock = clock
        session = boto3.session.Session()
        if session.get_credentials() is None:
            raise MirrorUnavailable(
                "exchange.mirror is set but the coordinator finds no AWS credentials"
                " (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile, or an instance role)"
            )
        self._client = session.client(
            "s3",
            endpoint_url=section.endpoint_url,
            region_name=section.region,
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
        )
        self._expires_in = math.ceil(section.url_ttl_s)
        self._lock = threading.Lock()
        self._signed: dict[tuple, tuple[str, float]] = {}  # (method, key, size) -> (url, signed at)

    def key(self, run_id: str, round: int, peer_id: str) -> str:
        return object_key(self.section.prefix, run_id, round, peer_id)

    def put_url(self, run_id: str, round: int, peer_id: str, size_bytes: int) -> str:
        """A URL to PUT exactly `size_bytes` bytes of the packet into its object."""
        if size_bytes < 1:
            raise ValueError(f"a packet has at least one byte, not {size_bytes}")
        return self._url("put_object", self.key(run_id, round, peer_id), size_bytes)

    def get_url(self, run_id: str, round: int, peer_id: str) -> str:
        """A URL to GET the packet's object."""
        return self._url("get_object", self.key(run_id, round, peer_id), None)

    def snapshot_put_url(self, run_id: str, round: int, params_digest: str, size_bytes: int) -> str:
        """A URL to PUT exactly `size_bytes` bytes of a snapshot of round `round`'s start."""
        if not 1 <= size_bytes <= MAX_SNAPSHOT_BYTES:
            raise ValueError(f"a snapshot PUT takes 1 to {MAX_SNAPSHOT_BYTES} bytes, not {size_bytes}")
        key = snapshot_key(self.section.snapshot_prefix, run_id, round, params_digest)
        return self._url("put_object", key, size_bytes)

    def snapshot_get_url(self, run_id: str, round: int, params_digest: str) -> str:
        """A URL to GET the snapshot of round `round`'s start with parameters `params_digest`."""
        return self._url("get_object", snapshot_key(self.section.snapshot_prefix, run_id, round, params_digest), None)

    def _url(self, method: str, key: str, size_bytes: int | None) -> str:
        now = self._clock()
        cache_key = (method, key, size_bytes)
        with self._lock:
            cached = self._signed.get(cache_key)
            if cached is not None and now - cached[1] < REUSE_FRACTION * self.section.url_ttl_s:
                return cached[0]
        params: dict = {"Bucket": self.section.bucket, "Key": key}
        if size_bytes is not None:
            params["ContentLength"] = size_bytes
        url = self._client.generate_presigned_url(method, Params=params, ExpiresIn=self._expires_in)
        with self._lock:
            if len(self._signed) >= MAX_CACHED:
                fresh = REUSE_FRACTION * self.section.url_ttl_s
                self._signed = {k: v for k, v in self._signed.items() if now - v[1] < fresh}
            self._signed[cache_key] = (url, now)
        return url
