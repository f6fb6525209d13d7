"""Snapshots in the packet mirror (exchange.mirror.snapshot_every_rounds) against an S3 server on
127.0.0.1 (tests/fixtures/s3.py: moto's S3 behind a presigned-signature check as S3 makes it): who
the coordinator hands a snapshot PUT URL, what it offers joiners, the node's streamed upload and
download with their hostile-bytes checks, and a catch-up that loads the agreed state from the
store when no peer serves it. Snapshots are real (`Snapshot`, `SnapshotSink` over a tiny model)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

from coordinator.mirror import Mirror, snapshot_key
from node.exchange import mirror as node_mirror
from node.training.snapshot import Snapshot, SnapshotSink, snapshot_size
from protocol.digest import CHUNK_BYTES
from protocol.http import SNAPSHOT_UPLOADERS
from tests.fixtures.coordinator import SignedPeer, create_run, error_of

pytestmark = pytest.mark.timeout(60)

RUN = "run-1"
DIGEST = "d" * 64


def _params(seed: int) -> dict[str, torch.Tensor]:
    """Two tensors, together over a chunk: a stream of a prologue and two chunks."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(CHUNK_BYTES // 4 + 1000, generator=g), "b": torch.randn(7, generator=g)}


def _zeros_like(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.zeros_like(t) for n, t in params.items()}


# -- the coordinator: who uploads, what is offered ---------------------------------------------


def _snapshot_run(
    client, clock, s3_store, bucket: str, every: int = 2, scoring: bool = True
) -> tuple[str, list[SignedPeer]]:
    mirror = {"endpoint_url": s3_store.endpoint_url, "bucket": bucket, "snapshot_every_rounds": every}
    overrides = {"exchange.mirror": mirror, "membership.min_peers": 3, "scoring.enabled": scoring}
    run_id = create_run(client, overrides)
    peers = [SignedPeer(client, clock=clock) for _ in range(3)]
    for peer in peers:
        assert peer.join(run_id).status_code == 200
    return run_id, peers


def _close_round(run_id: str, peers: list[SignedPeer], round_index: int) -> None:
    for peer in peers:
        assert peer.submit(run_id, round_index).status_code == 200
    assert peers[0].client.get(f"/v1/runs/{run_id}/rounds/{round_index}").json()["state"] == "closed"


def _applied(peer: SignedPeer, run_id: str, round_index: int, digest: str, **fields):
    payload = {"params_digest": digest, **fields}
    response = peer.post(f"/v1/runs/{run_id}/rounds/{round_index}/applied", payload)
    assert response.status_code == 200, response.text
    return response.json()


def _uploaded(peer: SignedPeer, run_id: str, round_index: int, snapshot_digest: str, size_bytes: int):
    payload = {"snapshot_digest": snapshot_digest, "size_bytes": size_bytes}
    return peer.post(f"/v1/runs/{run_id}/rounds/{round_index}/snapshot", payload)


def test_the_first_votes_of_a_due_round_upload_and_the_agreed_upload_is_offered(
    s3_store, coordinator_client, fake_clock
):
    client = coordinator_client
    bucket = s3_store.create_bucket()
    run_id, peers = _snapshot_run(client, fake_clock, s3_store, bucket)
    size = 1000
    _close_round(run_id, peers, 0)
    answers = [_applied(p, run_id, 0, DIGEST, snapshot_bytes=size) for p in peers]
    urls = [a["snapshot_put_url"] for a in answers]
    assert SNAPSHOT_UPLOADERS == 2 and urls[2] is None and all(urls[:2]), urls
    assert f"/{bucket}/{snapshot_key('snapshots/', run_id, 1, DIGEST)}?" in urls[0]
    assert answers[2]["agreed_digest"] == DIGEST
    status = client.get(f"/v1/runs/{run_id}/status").json()
    assert status["snapshot_mirror"] is None  # nothing reported uploaded yet

    # Only the peers handed a URL may report, of the size it signed; the store refuses another size.
    assert error_of(_uploaded(peers[2], run_id, 0, "e" * 64, size)) == "no_snapshot_url"
    assert error_of(_uploaded(peers[0], run_id, 0, "e" * 64, size + 1)) == "no_snapshot_url"
    assert httpx.put(urls[0], content=b"s" * (size + 1), trust_env=False).status_code == 403
    assert httpx.put(urls[0], content=b"s" * size, trust_env=False).status_code == 200
    recorded = _uploaded(peers[0], run_id, 0, "e" * 64, size)
    assert recorded.status_code == 200 and recorded.json() == {"round": 0, "recorded": True}
    assert _uploaded(peers[0], run_id, 0, "e" * 64, size).status_code == 200  # a repeat changes nothing
    assert error_of(_uploaded(peers[0], run_id, 0, "f" * 64, size)) == "no_snapshot_url"

    offered = client.get(f"/v1/runs/{run_id}/status").json()["snapshot_mirror"]
    assert {k: offered[k] for k in ("round", "params_digest", "snapshot_digest", "size_bytes")} == {
        "round": 1,
        "params_digest": DIGEST,
        "snapshot_digest": "e" * 64,
        "size_bytes": size,
    }
    assert httpx.get(offered["url"], trust_env=False).content == b"s" * size
    late = SignedPeer(client, clock=fake_clock)
    joined = late.join(run_id).json()
    assert joined["params"]["round"] == 1 and joined["params"]["mirror"]["snapshot_digest"] == "e" * 64

    # Round 1 is not due (every 2 rounds: after rounds 0, 2, ...): nobody is handed a URL.
    _close_round(run_id, peers, 1)
    assert all(_applied(p, run_id, 1, "c" * 64, snapshot_bytes=size)["snapshot_put_url"] is None for p in peers)
    assert error_of(_uploaded(peers[0], run_id, 1, "e" * 64, size)) == "no_snapshot_url"
    assert s3_store.keys(bucket) == [snapshot_key("snapshots/", run_id, 1, DIGEST)]


def test_an_upload_of_a_digest_that_lost_the_vote_is_never_offered(s3_store, coordinator_client, fake_clock):
    """A liar reports first (the majority of one) and is handed a URL; its upload lies under its
    own digest's key and is never offered. The second URL goes to an honest vote."""
    client = coordinator_client
    bucket = s3_store.create_bucket()
    run_id, peers = _snapshot_run(client, fake_clock, s3_store, bucket, every=1, scoring=False)
    _close_round(run_id, peers, 0)
    liar = _applied(peers[0], run_id, 0, "a" * 64, snapshot_bytes=10)
    assert liar["snapshot_put_url"] and "-" + "a" * 64 in liar["snapshot_put_url"]
    honest = [_applied(p, run_id, 0, DIGEST, snapshot_bytes=10) for p in peers[1:]]
    assert honest[1]["agreed_digest"] == DIGEST
    [uploader] = [p for p, a in zip(peers[1:], honest) if a["snapshot_put_url"]]
    assert httpx.put(liar["snapshot_put_url"], content=b"x" * 10, trust_env=False).status_code == 200
    assert _uploaded(peers[0], run_id, 0, "e" * 64, 10).status_code == 200
    assert client.get(f"/v1/runs/{run_id}/status").json()["snapshot_mirror"] is None
    assert _uploaded(uploader, run_id, 0, "b" * 64, 10).status_code == 200
    assert client.get(f"/v1/runs/{run_id}/status").json()["snapshot_mirror"]["snapshot_digest"] == "b" * 64


def test_without_snapshots_no_url_is_handed_out(s3_store, coordinator_client, fake_clock):
    bucket = s3_store.create_bucket()
    run_id, peers = _snapshot_run(coordinator_client, fake_clock, s3_store, bucket, every=0)
    _close_round(run_id, peers, 0)
    assert all(_applied(p, run_id, 0, DIGEST, snapshot_bytes=10)["snapshot_put_url"] is None for p in peers)


# -- the node: streamed upload and download -------------------------------------------------------


def _stored_snapshot(s3_store, seed: int = 1) -> tuple[Mirror, str, Snapshot]:
    bucket = s3_store.create_bucket()
    mirror = Mirror(s3_store.section(bucket))
    snapshot = Snapshot.from_tensors(_params(seed))
    return mirror, bucket, snapshot


def test_a_snapshot_goes_up_and_comes_back_unit_by_unit(s3_store):
    async def main():
        mirror, bucket, snapshot = _stored_snapshot(s3_store)
        assert snapshot.size_bytes == snapshot_size(_params(1), None) > CHUNK_BYTES
        url = mirror.snapshot_put_url(RUN, 5, snapshot.params_digest, snapshot.size_bytes)
        assert await node_mirror.upload_snapshot(url, snapshot, timeout_s=20)
        target = _zeros_like(_params(1))
        sink = SnapshotSink(target, None, snapshot.params_digest)
        sink.expect(snapshot.digest)
        get = mirror.snapshot_get_url(RUN, 5, snapshot.params_digest)
        assert await node_mirror.download_snapshot(get, snapshot.size_bytes, sink, timeout_s=20)
        assert sink.done and all(torch.equal(target[n], t) for n, t in _params(1).items())
        # A PUT URL signed for another size is refused by the store: the upload reports failure.
        wrong = mirror.snapshot_put_url(RUN, 6, snapshot.params_digest, snapshot.size_bytes - 1)
        assert not await node_mirror.upload_snapshot(wrong, snapshot, timeout_s=20)

    asyncio.run(main())


def test_a_download_resumes_from_the_sink_s_offset_with_a_range_get(s3_store):
    async def main():
        mirror, bucket, snapshot = _stored_snapshot(s3_store)
        key = snapshot_key("snapshots/", RUN, 5, snapshot.params_digest)
        s3_store.client.put_object(Bucket=bucket, Key=key, Body=b"".join(_stream(snapshot)))
        target = _zeros_like(_params(1))
        sink = SnapshotSink(target, None, snapshot.params_digest)
        sink.expect(snapshot.digest)
        for _ in range(2):  # the prologue and the first chunk came from a peer that then failed
            sink.accept(snapshot.read_unit(sink.offset)[1])
        resumed_at = sink.offset
        get = mirror.snapshot_get_url(RUN, 5, snapshot.params_digest)
        assert await node_mirror.download_snapshot(get, snapshot.size_bytes, sink, timeout_s=20)
        assert resumed_at > 0 and sink.done and torch.equal(target["w"], _params(1)["w"])

    asyncio.run(main())


class _BreakingStore:
    """A store on 127.0.0.1 (port 0) that serves one object and breaks the first GET's connection
    after `break_at` bytes of the body; it records each request's Range header."""

    def __init__(self, body: bytes, break_at: int):
        import http.server
        import threading

        store = self
        self.ranges: list[str | None] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                header = self.headers.get("Range")
                store.ranges.append(header)
                start = int(header.removeprefix("bytes=").rstrip("-")) if header else 0
                self.send_response(206 if header else 200)
                self.send_header("Content-Length", str(len(body) - start))
                self.end_headers()
                if len(store.ranges) == 1:
                    self.wfile.write(body[start:break_at])
                    self.wfile.flush()
                    self.connection.shutdown(2)  # the body ends early: a broken connection
                    return
                self.wfile.write(body[start:])

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/snapshot"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def test_a_body_that_breaks_off_midway_resumes_from_the_first_unverified_byte():
    async def main():
        snapshot = Snapshot.from_tensors(_params(1))
        body = b"".join(_stream(snapshot))
        store = _BreakingStore(body, break_at=snapshot.layout.prologue_bytes + CHUNK_BYTES + 100)
        try:
            target = _zeros_like(_params(1))
            sink = SnapshotSink(target, None, snapshot.params_digest)
            sink.expect(snapshot.digest)
            assert await node_mirror.download_snapshot(store.url, snapshot.size_bytes, sink, timeout_s=20)
        finally:
            store.close()
        resumed_at = snapshot.layout.prologue_bytes + CHUNK_BYTES  # the prologue and chunk 0 verified
        assert store.ranges == [None, f"bytes={resumed_at}-"]
        assert sink.done and all(torch.equal(target[n], t) for n, t in _params(1).items())

    asyncio.run(main())


def _stream(snapshot: Snapshot) -> list[bytes]:
    out, offset = [], 0
    while offset < snapshot.size_bytes:
        start, unit = snapshot.read_unit(offset)
        out.append(bytes(unit))
        offset = start + len(unit)
    return out


@pytest.mark.parametrize("fault", ["flipped", "short", "other_params"])
def test_a_corrupted_snapshot_in_the_store_is_refused_and_nothing_wrong_is_written(s3_store, fault):
    async def main():
        mirror, bucket, snapshot = _stored_snapshot(s3_store)
        body = bytearray(b"".join(_stream(snapshot)))
        if fault == "flipped":  # a byte of the second chunk: the first chunk verifies and is written
            body[snapshot.layout.prologue_bytes + CHUNK_BYTES + 10] ^= 1
        elif fault == "short":
            body = body[:-1]
        else:  # a whole, valid snapshot of other parameters: its prologue does not name the agreed digest
            body = bytearray(b"".join(_stream(Snapshot.from_tensors(_params(2)))))
        s3_store.client.put_object(
            Bucket=bucket, Key=snapshot_key("snapshots/", RUN, 5, snapshot.params_digest), Body=bytes(body)
        )
        target = _zeros_like(_params(1))
        sink = SnapshotSink(target, None, snapshot.params_digest)
        sink.expect(snapshot.digest)
        get = mirror.snapshot_get_url(RUN, 5, snapshot.params_digest)
        assert not await node_mirror.download_snapshot(get, snapshot.size_bytes, sink, timeout_s=20)
        assert not sink.done
        assert sink.written_bytes == {"flipped": CHUNK_BYTES, "short": 0, "other_params": 0}[fault]
        written = 0  # every value written is the snapshot's own (the rest is still zero)
        for name, source in _params(1).items():
            mask = target[name] != 0
            assert torch.equal(target[name][mask], source[mask]), name
            written += int(mask.sum()) * source.element_size()
        assert written == sink.written_bytes

    asyncio.run(main())


# -- catch-up: the agreed state from the store when no peer serves it ---------------------------


class _Coordinator:
    """A run at round 3 whose newest agreed snapshot only the packet mirror holds (every peer that
    served it is gone); it records the status polls."""

    def __init__(self, offered):
        self.offered = offered

    async def status(self, *_, **__):
        return SimpleNamespace(
            current_round=SimpleNamespace(round=3),
            run=SimpleNamespace(current_round=3, state="running"),
            history=[SimpleNamespace(round=r, num_contributors=1, agreed_digest=None) for r in range(3)],
            peers=[],
            snapshot_mirror=self.offered,
        )


def _session(tmp_path: Path, run, training, client):
    from node.round.state import RoundState
    from tests.doubles.memory_exchange import MemorySwarm
    from tests.doubles.session import node_session

    return node_session(
        tmp_path,
        run,
        client=client,
        exchange=MemorySwarm().exchange("node"),  # a swarm where nobody holds anything
        training=training,
        run_id=RUN,
        network={"fetch_timeout_s": 5.0},
        state=RoundState(params_round=None),
    )


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_joiner_whose_peers_serve_nothing_loads_the_agreed_state_from_the_store(s3_store, tmp_path, corrupt):
    from node.round.catchup import catch_up, load_snapshot
    from node.training.data import load_corpus
    from node.training.params import flat_named_params, param_digest
    from node.training.peer import PeerTraining
    from protocol.http import MirroredSnapshot
    from protocol.run_config import RunConfig

    async def main():
        run = RunConfig.model_validate(
            {
                "name": "from-the-store",
                "model": {"preset": "tiny"},
                "inner": {"steps": 2, "batch_size": 2, "seq_len": 32, "warmup_steps": 2, "total_steps": 100},
            }
        )
        source = PeerTraining.build(run, "cpu", load_corpus(None).train)
        with torch.no_grad():
            for p in source.model.parameters():
                p.add_(0.01)
        params = dict(flat_named_params(source.model))
        agreed = param_digest(params)
        snapshot = Snapshot.from_tensors(params, source.outer.snapshot_state())
        mirror, bucket, _ = _stored_snapshot(s3_store)
        body = bytearray(b"".join(_stream(snapshot)))
        if corrupt:
            body[-1] ^= 1
        key = snapshot_key("snapshots/", RUN, 3, agreed)
        s3_store.client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
        offered = MirroredSnapshot(
            round=3,
            params_digest=agreed,
            snapshot_digest=snapshot.digest,
            size_bytes=snapshot.size_bytes,
            url=mirror.snapshot_get_url(RUN, 3, agreed),
        )
        s = _session(tmp_path, run, PeerTraining.build(run, "cpu", load_corpus(None).train), _Coordinator(offered))
        if corrupt:
            assert not await load_snapshot(s, 3, agreed, offered)
            assert s.state.digest != agreed and s.state.params_round is None
        else:
            report = await asyncio.wait_for(catch_up(s), 30)
            assert (report.to_round, report.method) == (3, "snapshot")
            assert s.state.params_round == 3 and s.state.digest == agreed
            assert param_digest(flat_named_params(s.training.model)) == agreed
        s.stopping.set()
        for task in list(s.background):
            task.cancel()

    asyncio.run(main())


# -- a whole swarm gone: the store holds the state ----------------------------------------------


def test_a_paused_run_resumes_at_once_when_the_store_holds_the_open_round_s_start(s3_store, tmp_path, fake_clock):
    """Every peer went silent after round 0; its agreed start of round 1 is in the store. A fresh
    peer (no checkpoint) returns: the run resumes round 1 at once and waits for it (it loads the
    state from the store), where without the store it would wait for a peer holding that state."""
    from tests.fixtures.coordinator import coordinator_on
    from tests.unit.test_coordinator_rounds import tick

    timeout_s = 10.0
    with coordinator_on(tmp_path / "coordinator.db", fake_clock) as (client, _):
        bucket = s3_store.create_bucket()
        mirror = {"endpoint_url": s3_store.endpoint_url, "bucket": bucket, "snapshot_every_rounds": 1}
        run_id = create_run(
            client,
            {"exchange.mirror": mirror, "membership.min_peers": 3, "membership.heartbeat_timeout_s": timeout_s},
        )
        peers = [SignedPeer(client, clock=fake_clock) for _ in range(3)]
        for peer in peers:
            assert peer.join(run_id).status_code == 200
        _close_round(run_id, peers, 0)
        answers = [_applied(p, run_id, 0, DIGEST, snapshot_bytes=10) for p in peers]
        assert httpx.put(answers[0]["snapshot_put_url"], content=b"s" * 10, trust_env=False).status_code == 200
        assert _uploaded(peers[0], run_id, 0, "e" * 64, 10).status_code == 200

        fake_clock.advance(timeout_s + 3600)
        tick(client)
        paused = client.get(f"/v1/runs/{run_id}/status").json()
        assert paused["recovery"] is not None and paused["current_round"]["round"] == 1
        fresh = SignedPeer(client, clock=fake_clock)
        joined = fresh.join(run_id).json()
        assert joined["params"]["mirror"]["round"] == 1
        body = client.get(f"/v1/runs/{run_id}/status").json()
        assert body["recovery"] is None and body["rewinds"] == []
        assert body["current_round"]["round"] == 1 and body["current_round"]["opened_at"] == fake_clock()
        assert body["current_round"]["num_expected"] == 1  # the fresh peer, once it loaded the state
