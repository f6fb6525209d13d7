"""The packet mirror (exchange.mirror) against an S3 server on 127.0.0.1 (tests/fixtures/s3.py:
moto's S3 behind a presigned-signature check as S3 makes it): the coordinator's presigned URLs,
its API answers with them, the publisher's upload, and the fetcher's mirror path with its
hostile-bytes checks. The fetcher runs for real (PacketFetcher, its store, its downloads); only
the DHT side it never reaches in these tests (host, announcer) is a recording stand-in."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import random
import subprocess
import sys

import httpx
import pytest

from coordinator.mirror import Mirror, MirrorUnavailable, object_key
from node.exchange import mirror as node_mirror
from node.exchange.base import MirrorCopy
from node.exchange.config import ExchangeConfig
from node.exchange.fetch import MIRROR, FetchState, PacketFetcher
from node.exchange.spool import Spool
from node.exchange.store import PacketStore
from protocol.run_config import MirrorSection, RunConfig
from tests.fixtures.coordinator import REPO_ROOT, SignedPeer, create_run, error_of, run_config

pytestmark = pytest.mark.timeout(60)

RUN, PEER = "run-1", "12D3KooWPeerA"


def in_loop(test):
    """An async test, run in a loop of its own (the project runs asyncio tests with asyncio.run)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return run


# -- the coordinator's signer --------------------------------------------------------------------


def test_presigned_put_then_get_round_trip(s3_store):
    bucket = s3_store.create_bucket()
    mirror = Mirror(s3_store.section(bucket, prefix="pk/"))
    data = random.Random(1).randbytes(10_000)
    put = httpx.put(mirror.put_url(RUN, 7, PEER, len(data)), content=data, trust_env=False)
    assert put.status_code == 200, put.text
    assert s3_store.keys(bucket) == [f"pk/{RUN}/00000007/{PEER}.pkt"] == [object_key("pk/", RUN, 7, PEER)]
    got = httpx.get(mirror.get_url(RUN, 7, PEER), trust_env=False)
    assert got.status_code == 200 and got.content == data
    assert s3_store.check.num_denied == 0


def test_a_put_of_other_than_the_signed_size_is_refused(s3_store):
    bucket = s3_store.create_bucket()
    mirror = Mirror(s3_store.section(bucket))
    url = mirror.put_url(RUN, 0, PEER, 100)
    assert "content-length" in httpx.URL(url).params["X-Amz-SignedHeaders"]
    for size in (101, 10_000, 99):
        assert httpx.put(url, content=b"x" * size, trust_env=False).status_code == 403, size
    assert s3_store.keys(bucket) == []
    assert httpx.put(url, content=b"x" * 100, trust_env=False).status_code == 200
    # a forged signature is refused as well: the check is S3's, not a size filter
    forged = url.replace("X-Amz-Signature=", "X-Amz-Signature=0")
    assert httpx.get(forged.replace("X-Amz-SignedHeaders=content-length", "X"), trust_env=False).status_code == 403


def test_urls_are_reused_while_younger_than_half_their_lifetime(s3_store):
    now = [1000.0]
    mirror = Mirror(s3_store.section("some-bucket", url_ttl_s=600), clock=lambda: now[0])
    first = mirror.get_url(RUN, 1, PEER)
    now[0] += 299
    assert mirror.get_url(RUN, 1, PEER) == first
    assert "X-Amz-Expires=600" in first
    now[0] += 2  # past half: signed anew
    mirror.get_url(RUN, 1, PEER)
    assert mirror._signed[("get_object", object_key("", RUN, 1, PEER), None)][1] == now[0]
    assert mirror.put_url(RUN, 1, PEER, 5) != mirror.put_url(RUN, 1, PEER, 6)  # the size is part of the signature
    with pytest.raises(ValueError):
        mirror.put_url(RUN, 1, PEER, 0)


def test_no_credentials_is_a_typed_refusal(monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(MirrorUnavailable):
        Mirror(MirrorSection(bucket="abc"))


def test_mirror_section_bounds_and_no_secrets():
    config = RunConfig.model_validate(run_config({"exchange.mirror": {"bucket": "my-bucket", "prefix": "p/"}}))
    assert config.exchange.mirror is not None and config.exchange.mirror.url_ttl_s == 900
    assert RunConfig.model_validate(run_config()).exchange.mirror is None
    for bad in (
        {"bucket": "my-bucket", "url_ttl_s": 8 * 86400},
        {"bucket": "my-bucket", "url_ttl_s": 1},
        {"bucket": "My_Bucket"},
        {"bucket": "my-bucket", "endpoint_url": "ftp://x"},
        {"bucket": "my-bucket", "aws_secret_access_key": "x"},
    ):
        with pytest.raises(ValueError):
            RunConfig.model_validate(run_config({"exchange.mirror": bad}))


def test_the_coordinator_without_a_mirror_never_imports_boto3():
    code = (
        "import sys; import coordinator.app, coordinator.cli, coordinator.service;"
        " assert 'boto3' not in sys.modules and 'botocore' not in sys.modules, 'boto3 imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# -- the coordinator's API -----------------------------------------------------------------------


def test_submit_answers_a_put_url_and_views_carry_get_urls(s3_store, coordinator_client, fake_clock):
    client = coordinator_client
    bucket = s3_store.create_bucket()
    mirror = {"endpoint_url": s3_store.endpoint_url, "bucket": bucket, "prefix": "x/"}
    run_id = create_run(client, {"exchange.mirror": mirror, "membership.min_peers": 2})
    peers = [SignedPeer(client, clock=fake_clock) for _ in range(2)]
    for peer in peers:
        assert peer.join(run_id).status_code == 200
    answer = peers[0].submit(run_id, 0, packet_size_bytes=64)
    assert answer.status_code == 200, answer.text
    put_url = answer.json()["mirror_put_url"]
    assert put_url and f"/{bucket}/x/{run_id}/00000000/{peers[0].peer_id}.pkt?" in put_url
    assert httpx.put(put_url, content=b"y" * 64, trust_env=False).status_code == 200

    view = client.get(f"/v1/runs/{run_id}/rounds/0").json()
    [entry] = view["submitted"]
    assert httpx.get(entry["mirror_url"], trust_env=False).content == b"y" * 64
    assert peers[1].submit(run_id, 0, packet_size_bytes=64).status_code == 200  # the last: the round closes
    view = client.get(f"/v1/runs/{run_id}/rounds/0").json()
    assert view["state"] == "closed" and all(e["mirror_url"] for e in view["manifest"])

    plain = create_run(client, {"membership.min_peers": 1})
    other = SignedPeer(client, clock=fake_clock)
    assert other.join(plain).status_code == 200
    assert other.submit(plain, 0).json()["mirror_put_url"] is None
    assert client.get(f"/v1/runs/{plain}/rounds/0").json()["manifest"][0]["mirror_url"] is None


def test_a_run_with_a_mirror_needs_credentials_on_the_coordinator(coordinator_client, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    from tests.fixtures.coordinator import ADMIN_HEADERS

    response = coordinator_client.post(
        "/v1/runs", json=run_config({"exchange.mirror": {"bucket": "abc"}}), headers=ADMIN_HEADERS
    )
    assert error_of(response) == "invalid_config"


# -- the publisher's upload ------------------------------------------------------------------------


@in_loop
async def test_upload_puts_the_packet_and_a_refusal_is_logged_once(s3_store, caplog):
    bucket = s3_store.create_bucket()
    mirror = Mirror(s3_store.section(bucket))
    data = b"z" * 300
    assert await node_mirror.upload(mirror.put_url(RUN, 2, PEER, 300), data, timeout_s=10)
    assert s3_store.client.get_object(Bucket=bucket, Key=mirror.key(RUN, 2, PEER))["Body"].read() == data
    caplog.set_level("WARNING")
    assert not await node_mirror.upload(mirror.put_url(RUN, 3, PEER, 299), data, timeout_s=10)
    assert [r.levelno for r in caplog.records if "packet mirror" in r.getMessage()] == [logging.WARNING]


# -- the fetcher's mirror path ---------------------------------------------------------------------


class _Host:
    """A host that dials nobody: every peer holder fails at once."""

    holder_id = "12D3KooWSelf"

    async def connect(self, peer, maddrs):
        raise ConnectionRefusedError("no peer is reachable here")


class _Announcer:
    """The DHT side of the fetcher, which finds no peer here: every packet must come from the mirror."""

    def __init__(self):
        self.announced: list[tuple] = []

    async def lookup(self, keys, round, deadline):
        return {}, {}

    async def announcements(self, round):
        return {}

    async def holders(self, round, publisher):
        return []

    def announce_holder(self, round, publisher, digest, size_bytes):
        self.announced.append((round, publisher, digest, size_bytes))


def _fetcher(**config) -> tuple[PacketFetcher, PacketStore, _Announcer]:
    cfg = ExchangeConfig(run_id=RUN, **({"mirror_after_s": 0.05, "holder_refresh_s": 0.1} | config))
    store, announcer = PacketStore(Spool(None)), _Announcer()
    return PacketFetcher(cfg, _Host(), store, announcer, random.Random(0)), store, announcer


@in_loop
async def test_fetch_takes_a_packet_no_peer_serves_from_the_mirror(s3_store):
    bucket = s3_store.create_bucket()
    mirror = Mirror(s3_store.section(bucket))
    data = random.Random(2).randbytes(50_000)
    digest = hashlib.sha256(data).hexdigest()
    s3_store.client.put_object(Bucket=bucket, Key=mirror.key(RUN, 4, PEER), Body=data)
    fetcher, store, announcer = _fetcher()
    got = await fetcher.fetch(
        4, {PEER: digest}, timeout_s=10, mirrors={PEER: MirrorCopy(mirror.get_url(RUN, 4, PEER), len(data))}
    )
    assert bytes(got[PEER]) == data
    assert bytes(store.held[(4, PEER)].data) == data  # kept, and served from now on
    assert announcer.announced == [(4, PEER, digest, len(data))]  # announced as a holder
    assert store.traffic(4).num_fetched == 1 and store.traffic(4).downloaded_bytes == len(data)


@in_loop
async def test_the_mirror_is_asked_at_once_when_every_peer_holder_failed(s3_store):
    """mirror_after_s is 30 s, but the only holder named (the publisher) cannot be dialled."""
    bucket = s3_store.create_bucket()
    mirror = Mirror(s3_store.section(bucket))
    data = b"behind NAT" * 100
    s3_store.client.put_object(Bucket=bucket, Key=mirror.key(RUN, 8, PEER), Body=data)
    fetcher, _, _ = _fetcher(mirror_after_s=30.0)
    publisher = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWJYTQz2gw1w1kbgDtvpK5pB8WSEZV3ti4Ko1PsJ8jWYDu"
    loop = asyncio.get_running_loop()
    started = loop.time()
    got = await fetcher.fetch(
        8,
        {PEER: hashlib.sha256(data).hexdigest()},
        {PEER: [publisher]},
        timeout_s=20,
        mirrors={PEER: MirrorCopy(mirror.get_url(RUN, 8, PEER), len(data))},
    )
    assert bytes(got[PEER]) == data and loop.time() - started < 10


@pytest.mark.parametrize("fault", ["short", "long", "digest", "oversized"])
@in_loop
async def test_the_mirror_is_banned_for_a_wrong_size_or_digest(s3_store, fault):
    bucket = s3_store.create_bucket()
    mirror = Mirror(s3_store.section(bucket))
    data = random.Random(3).randbytes(4096)
    digest = hashlib.sha256(data).hexdigest()
    stored = {
        "short": data[:-1],
        "long": data + b"!",
        "digest": data[:-1] + bytes([data[-1] ^ 1]),
        "oversized": data,
    }[fault]
    s3_store.client.put_object(Bucket=bucket, Key=mirror.key(RUN, 5, PEER), Body=stored)
    fetcher, store, announcer = _fetcher(max_packet_bytes=4095 if fault == "oversized" else 1 << 20)
    state = FetchState(5, PEER, digest, None)
    loop = asyncio.get_running_loop()
    copy = MirrorCopy(mirror.get_url(RUN, 5, PEER), len(data))
    assert await fetcher._from_mirror(state, copy, loop.time() + 10) is None
    assert MIRROR in state.banned
    assert (5, PEER) not in store.held and announcer.announced == []
    if fault != "oversized":  # refused before buffering: nothing past the header was kept
        assert store.traffic(5).downloaded_bytes <= len(data)


@in_loop
async def test_a_missing_object_is_asked_again_until_it_is_uploaded(s3_store):
    """The publisher uploads after its submission: a fetcher may ask first (404), then gets it."""
    bucket = s3_store.create_bucket()
    mirror = Mirror(s3_store.section(bucket))
    data = b"late" * 1000
    fetcher, store, _ = _fetcher()

    async def upload_later():
        await asyncio.sleep(0.3)
        assert await node_mirror.upload(mirror.put_url(RUN, 6, PEER, len(data)), data, timeout_s=10)

    uploading = asyncio.create_task(upload_later())
    got = await fetcher.fetch(
        6,
        {PEER: hashlib.sha256(data).hexdigest()},
        timeout_s=10,
        mirrors={PEER: MirrorCopy(mirror.get_url(RUN, 6, PEER), len(data))},
    )
    await uploading
    assert bytes(got[PEER]) == data


@in_loop
async def test_a_suspects_packet_arriving_slowly_from_the_mirror_is_not_given_up():
    """A suspect's packet is given up once no copy of it is arriving (node/exchange/fetch.py); a
    body coming from the mirror is one: 3 s of it, six times the stall time-out, is fetched whole."""
    data = random.Random(4).randbytes(20 * 1000)

    async def serve_slowly(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode())
        for start in range(0, len(data), 1000):
            writer.write(data[start : start + 1000])
            await writer.drain()
            await asyncio.sleep(0.15)
        writer.close()

    server = await asyncio.start_server(serve_slowly, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    fetcher, store, _ = _fetcher(stall_timeout_s=0.5)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        got = await fetcher.fetch(
            2,
            {PEER: hashlib.sha256(data).hexdigest()},
            timeout_s=20,
            mirrors={PEER: MirrorCopy(f"http://127.0.0.1:{port}/packet", len(data))},
            suspects={PEER},
        )
    finally:
        server.close()
        await server.wait_closed()
    assert bytes(got[PEER]) == data and loop.time() - started > 2.5


@in_loop
async def test_without_a_mirror_copy_a_packet_nobody_serves_is_left_out():
    fetcher, store, _ = _fetcher()
    assert await fetcher.fetch(1, {PEER: "ab" * 32}, timeout_s=0.3) == {}


def test_the_sample_run_config_s_mirror_loads_once_uncommented(tmp_path):
    from protocol.run_config import load_run_config

    text = (REPO_ROOT / "deploy" / "run.toml").read_text()
    assert "\n# mirror = {" in text
    (tmp_path / "run.toml").write_text(text.replace("\n# mirror = {", "\nmirror = {"))
    section = load_run_config(tmp_path / "run.toml").exchange.mirror
    assert section is not None and section.bucket == "my-locoswarm-packets" and section.prefix == "packets/"


@in_loop
async def test_the_memory_exchange_takes_a_withheld_packet_from_its_mirror():
    from tests.doubles.memory_exchange import MemorySwarm

    swarm = MemorySwarm()
    publisher, fetcher = swarm.exchange("a"), swarm.exchange("b")
    data = b"packet" * 10
    digest = (await publisher.publish(0, "a", data)).digest
    swarm.withhold(0, "a")
    assert await fetcher.fetch(0, {"a": digest}, timeout_s=0.01) == {}
    swarm.mirrored["http://store/a"] = data
    wrong_size = {"a": MirrorCopy("http://store/a", len(data) + 1)}
    assert await fetcher.fetch(0, {"a": digest}, timeout_s=0.01, mirrors=wrong_size) == {}
    got = await fetcher.fetch(0, {"a": digest}, timeout_s=0.01, mirrors={"a": MirrorCopy("http://store/a", len(data))})
    assert got == {"a": data} and "b" in {h.holder for h in await fetcher.holders(0, "a")}
