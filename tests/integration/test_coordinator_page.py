"""The status page in headless Chromium against a live coordinator: after its script ran, the
DOM has what each state of a run should show, and the screenshot shows the plots' colours
(decoded with a tiny stdlib PNG reader). States: several closed rounds; a round training (the
round bar counts the peers' inner steps); a stalled round; a finished one-round run (one
marker); a run waiting for peers; two runs, where the page picks the live one; and the validation
loss beside the training loss, with each round's compression against dense."""

from __future__ import annotations

import shutil
import struct
import subprocess
import time
import zlib
from pathlib import Path

import httpx
import pytest

from tests.fixtures.coordinator import ADMIN_HEADERS, SignedPeer, create_run

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

LOSS_RGB = (0x25, 0x63, 0xEB)  # the page's loss series colour
TIME_RGB = (0xEA, 0x58, 0x0C)  # the page's round-time series colour
VAL_RGB = (0x93, 0x33, 0xEA)  # the page's validation loss series colour


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) for 8-bit RGB/RGBA non-interlaced PNGs."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, chunk = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    assert header is not None
    width, height, bit_depth, colour_type, _, _, interlace = header
    assert bit_depth == 8 and colour_type in (2, 6) and interlace == 0, header
    channels = 3 if colour_type == 2 else 4
    stride = width * channels
    raw = zlib.decompress(idat)
    rows, previous = [], bytearray(stride)
    for y in range(height):
        filter_type = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up = previous[i]
            up_left = previous[i - channels] if i >= channels else 0
            if filter_type == 1:
                line[i] = (line[i] + left) & 0xFF
            elif filter_type == 2:
                line[i] = (line[i] + up) & 0xFF
            elif filter_type == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif filter_type == 4:
                p = left + up - up_left
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - up_left)
                predictor = left if pa <= pb and pa <= pc else (up if pb <= pc else up_left)
                line[i] = (line[i] + predictor) & 0xFF
        rows.append(bytes(b for i, b in enumerate(line) if i % channels < 3))
        previous = line
    return width, height, rows


def count_near(rows: list[bytes], rgb: tuple[int, int, int], tolerance: int = 40) -> int:
    count = 0
    for row in rows:
        for x in range(0, len(row), 3):
            if sum(abs(row[x + c] - rgb[c]) for c in range(3)) <= tolerance:
                count += 1
    return count


def populate(url: str) -> str:
    with httpx.Client(base_url=url, timeout=10) as client:
        run_id = create_run(
            client, {"name": "page-demo", "membership.min_peers": 3, "membership.heartbeat_timeout_s": 300.0}
        )
        peers = [SignedPeer(client) for _ in range(3)]
        for i, peer in enumerate(peers):
            peer.join(
                run_id, bandwidth_mbps=100.0 * (i + 1), device=f"gpu-{i}", **({"uplink_mbps": 40.0} if i == 0 else {})
            )
        for round_index in range(8):
            for i, peer in enumerate(peers):
                loss = 5.0 - 0.35 * round_index + 0.05 * i
                assert peer.submit(run_id, round_index, train_loss=loss).status_code == 200
            for i, peer in enumerate(peers):
                digest = "ab" * 32 if i < 2 or round_index < 7 else "cd" * 32
                # Every update judged useful: the peers earn credit, which agrees round 7 against peer 2.
                scores = {p.peer_id: {"loss_delta": -0.1, "cosine": 0.8} for p in peers if p is not peer}
                response = peer.post(
                    f"/v1/runs/{run_id}/rounds/{round_index}/applied", {"params_digest": digest, "scores": scores}
                )
                assert response.status_code == 200, response.text
        peers[0].submit(run_id, 8, train_loss=2.1)
    return run_id


needs_chromium = pytest.mark.skipif(
    shutil.which("chromium") is None, reason="chromium is not installed (apt-get install chromium)"
)


def open_page(url: str, tmp_path: Path, name: str = "page") -> tuple[str, list[bytes]]:
    """(the DOM after the page's script ran, the screenshot's rows); the PNG stays in tmp_path."""
    screenshot = tmp_path / f"{name}.png"
    result = subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / ('profile-' + name)}",
            f"--screenshot={screenshot}",
            "--dump-dom",
            "--window-size=1280,900",
            "--virtual-time-budget=5000",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (tmp_path / f"{name}.html").write_text(result.stdout)  # beside the screenshot, for a failure
    assert '<span id="error"></span>' in result.stdout, "the status fetch failed"
    width, height, rows = decode_png(screenshot.read_bytes())
    assert (width, height) == (1280, 900)
    assert len(set(rows[height // 2][::3])) > 3, "the screenshot is blank"
    return result.stdout, rows


@needs_chromium
def test_status_page_renders_in_headless_chromium(start_coordinator, tmp_path: Path):
    coordinator = start_coordinator()
    run_id = populate(coordinator.url)
    dom, rows = open_page(f"{coordinator.url}/", tmp_path)
    assert run_id in dom and "page-demo" in dom
    assert dom.count('class="peer-row"') == 3
    assert dom.count('class="round-row"') == 8
    assert 'class="series-loss"' in dom and 'class="series-time"' in dom
    assert "params_mismatch @7" in dom
    assert 'id="bar-train" style="width: 33.3' in dom, "the peer that submitted trained its H steps"
    assert "100 Mbps, up 40" in dom and "200 Mbps<" in dom  # measured, and the uplink where stated
    assert 'class="x-tick">7<' in dom and ">seconds</text>" in dom
    assert count_near(rows, LOSS_RGB) > 200, "the loss series is missing from the plot"
    assert count_near(rows, TIME_RGB) > 200, "the round-time series is missing from the plot"


def start_run(client: httpx.Client, num_peers: int, **overrides) -> tuple[str, list[SignedPeer]]:
    run_id = create_run(
        client, {"membership.min_peers": num_peers, "membership.heartbeat_timeout_s": 300.0, **overrides}
    )
    peers = [SignedPeer(client) for _ in range(num_peers)]
    for i, peer in enumerate(peers):
        assert peer.join(run_id, device=f"gpu-{i}").status_code == 200
    return run_id, peers


def beat(peer: SignedPeer, run_id: str, round_index: int, state: str, inner_step: int | None) -> None:
    response = peer.post(
        f"/v1/runs/{run_id}/heartbeat", {"round": round_index, "state": state, "inner_step": inner_step}
    )
    assert response.status_code == 200, response.text


@needs_chromium
def test_page_while_peers_train(start_coordinator, tmp_path: Path):
    coordinator = start_coordinator()
    with httpx.Client(base_url=coordinator.url, timeout=10) as client:
        run_id, peers = start_run(client, 2)  # H = 15
        for round_index in range(2):
            for i, peer in enumerate(peers):
                assert peer.submit(run_id, round_index, train_loss=4.0 - round_index + 0.1 * i).status_code == 200
        beat(peers[0], run_id, 2, "training", 6)
        beat(peers[1], run_id, 2, "encoding", 15)
    dom, rows = open_page(f"{coordinator.url}/", tmp_path, "training")
    assert 'id="bar-train" style="width: 70%;"' in dom, "(6 + 15) of 2 x 15 inner steps"
    assert 'id="bar-submit" style="width: 0%;"' in dom and 'id="bar-close" style="width: 0%;"' in dom
    assert "round 2 open: 70% of 15 inner steps trained, 0 of 2 submitted" in dom
    assert ">training 6/15<" in dom and ">encoding<" in dom
    assert '<div id="banner" class="banner" hidden="">' in dom
    assert dom.count('class="marker-loss"') == 2 and dom.count('class="marker-time"') == 2
    assert 'class="x-tick">0<' in dom and 'class="x-tick">1<' in dom and 'class="x-tick">2<' not in dom
    assert dom.count('class="y-tick"') >= 6, "both y axes have ticks"
    assert ">loss</text>" in dom and ">seconds</text>" in dom and 'class="axis-label">round<' in dom
    assert count_near(rows, LOSS_RGB) > 200 and count_near(rows, TIME_RGB) > 200


@needs_chromium
def test_page_shows_a_stalled_round(start_coordinator, tmp_path: Path):
    coordinator = start_coordinator()
    patience_s = 3.0  # heartbeat_timeout_s: nothing moved for this long is a stall
    with httpx.Client(base_url=coordinator.url, timeout=10) as client:
        run_id, peers = start_run(client, 2, **{"membership.heartbeat_timeout_s": patience_s})
        opened_at = client.get(f"/v1/runs/{run_id}/status").json()["current_round"]["opened_at"]
        while True:  # the peers beat, alive and stuck at step 0, until the patience has passed
            for peer in peers:
                beat(peer, run_id, 0, "training", 0)
            now = client.get(f"/v1/runs/{run_id}/status").json()["now"]
            if now - opened_at > patience_s + 0.5:
                break
            time.sleep(0.5)
    dom, _ = open_page(f"{coordinator.url}/?run={run_id}", tmp_path, "stalled")
    assert '<div id="banner" class="banner stalled">Round 0 stalled: no submission and no training progress' in dom
    assert 'id="bar-train" style="width: 0%;"' in dom
    assert "no closed rounds yet" in dom


@needs_chromium
def test_page_shows_what_a_stuck_peer_waits_for(start_coordinator, tmp_path: Path):
    """A peer catching up on a round whose packets nobody serves says so in its heartbeats; the banner
    shows the line as text (a detail that looks like markup stays text)."""
    coordinator = start_coordinator()
    line = "round 4: waiting for the packets of p00 (gone; reported missing) <b>x</b>"
    with httpx.Client(base_url=coordinator.url, timeout=10) as client:
        run_id, peers = start_run(client, 2)
        response = peers[0].post(f"/v1/runs/{run_id}/heartbeat", {"round": 5, "state": "stuck", "detail": line})
        assert response.status_code == 200, response.text
    dom, _ = open_page(f"{coordinator.url}/?run={run_id}", tmp_path, "stuck")
    shown = f"stuck: {peers[0].peer_id}: " + line.replace("<", "&lt;").replace(">", "&gt;")
    assert f'<div id="banner" class="banner stalled">{shown}</div>' in dom
    assert "<b>x</b>" not in dom


@needs_chromium
def test_page_shows_what_the_model_writes(start_coordinator, tmp_path: Path):
    """The newest text sample a peer sent with its validation loss, as text (markup stays text)."""
    coordinator = start_coordinator()
    text = "def __init__(self, <b>name</b>):\n    self.name = name"
    with httpx.Client(base_url=coordinator.url, timeout=10) as client:
        run_id, peers = start_run(client, 2)
        for peer in peers:
            assert peer.submit(run_id, 0).status_code == 200
        response = peers[1].post(
            f"/v1/runs/{run_id}/rounds/0/applied", {"params_digest": "ab" * 32, "val_loss": 3.5, "sample": text}
        )
        assert response.status_code == 200, response.text
    dom, _ = open_page(f"{coordinator.url}/?run={run_id}", tmp_path, "sample")
    assert f'<div id="sample-info" class="muted">after round 0, from {peers[1].peer_id}</div>' in dom
    escaped = text.replace("<", "&lt;").replace(">", "&gt;")
    assert f'<pre id="sample">{escaped}</pre>' in dom and "<b>name</b>" not in dom


@needs_chromium
def test_page_of_a_finished_one_round_run(start_coordinator, tmp_path: Path):
    coordinator = start_coordinator()
    with httpx.Client(base_url=coordinator.url, timeout=10) as client:
        run_id, peers = start_run(client, 2, max_rounds=1)
        for peer in peers:
            assert peer.submit(run_id, 0, train_loss=3.5, packet_size_bytes=2_500_000).status_code == 200
        assert client.get(f"/v1/runs/{run_id}").json()["state"] == "finished"
    dom, rows = open_page(f"{coordinator.url}/", tmp_path, "finished")
    assert "run finished after 1 round" in dom and '<div id="banner" class="banner" hidden="">' in dom
    assert 'id="bar-close" style="width: 100%;"' in dom
    # One round: a marker in each plot, on its own x tick.
    assert dom.count('class="marker-loss"') == 1 and dom.count('class="marker-time"') == 1
    assert 'class="x-tick">0<' in dom
    assert ">5.00 MB<" in dom and ">246 k<" in dom  # packet bytes; tokens: 2 x 15 x 8 x 1024
    assert count_near(rows, LOSS_RGB) > 30 and count_near(rows, TIME_RGB) > 30


@needs_chromium
def test_page_of_a_run_waiting_for_peers(start_coordinator, tmp_path: Path):
    coordinator = start_coordinator()
    with httpx.Client(base_url=coordinator.url, timeout=10) as client:
        run_id = create_run(client, {"membership.min_peers": 3})
        assert SignedPeer(client).join(run_id).status_code == 200
    dom, _ = open_page(f"{coordinator.url}/", tmp_path, "waiting")
    assert '<div id="banner" class="banner waiting">Waiting for peers: 1 of 3 live</div>' in dom


@needs_chromium
def test_page_picks_the_live_run_and_lists_every_run(start_coordinator, tmp_path: Path):
    coordinator = start_coordinator()
    with httpx.Client(base_url=coordinator.url, timeout=10) as client:
        long_run, peers = start_run(client, 2, name="long")
        for peer in peers:
            assert peer.submit(long_run, 0, train_loss=3.0).status_code == 200
        quick_run = create_run(client, {"name": "quick"})  # newer, and closed a moment later
        assert client.post(f"/v1/runs/{quick_run}/close", headers=ADMIN_HEADERS).status_code == 200
    dom, _ = open_page(f"{coordinator.url}/", tmp_path, "two-runs")
    assert f'<span id="run-title">long ({long_run})</span>' in dom
    assert f'<option value="{quick_run}">quick - closed ({quick_run})</option>' in dom
    assert f'<option value="{long_run}" selected="">long - running ({long_run})</option>' in dom
    assert dom.index(quick_run) < dom.index(f'<option value="{long_run}"'), "newest first"


@needs_chromium
def test_page_plots_a_thousand_rounds_readably(start_coordinator, tmp_path: Path):
    # A real status, its history stretched to a thousand rounds and served by a stub: the
    # coordinator's per-peer rate limit would make a thousand real rounds take a minute.
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from coordinator.page import render_page

    coordinator = start_coordinator()
    with httpx.Client(base_url=coordinator.url, timeout=10) as client:
        run_id, [peer] = start_run(client, 1)  # one peer: each submission closes its round
        assert peer.submit(run_id, 0, train_loss=6.0).status_code == 200
        runs = client.get("/v1/runs").content
        status = client.get(f"/v1/runs/{run_id}/status").json()
    [first] = status["history"]
    status["history"] = [
        first | {"round": r, "mean_loss": 6.0 / (1 + 0.01 * r), "round_time_s": 20.0 + r % 7} for r in range(1000)
    ]
    bodies = {
        "/": render_page(run_id).encode(),
        "/v1/runs": runs,
        f"/v1/runs/{run_id}/status": json.dumps(status).encode(),
    }

    class Stub(BaseHTTPRequestHandler):
        def do_GET(self):
            body = bodies.get(self.path.split("?")[0])
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "text/html" if self.path == "/" else "application/json")
            self.end_headers()
            self.wfile.write(body or b"{}")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        dom, rows = open_page(f"http://127.0.0.1:{server.server_address[1]}/", tmp_path, "thousand")
    finally:
        server.shutdown()
        server.server_close()
    assert 'class="series-loss"' in dom and 'class="marker-loss"' not in dom, "a line, no marker per round"
    assert 5 <= dom.count('class="x-tick"') <= 15 and 'class="x-tick">0<' in dom
    assert dom.count('class="y-tick"') >= 6
    assert count_near(rows, LOSS_RGB) > 500 and count_near(rows, TIME_RGB) > 500


@needs_chromium
def test_page_plots_validation_loss_and_shows_compression(start_coordinator, tmp_path: Path):
    import re

    coordinator = start_coordinator()
    with httpx.Client(base_url=coordinator.url, timeout=10) as client:
        run_id, peers = start_run(client, 2)
        for round_index in range(7):
            for i, peer in enumerate(peers):
                assert (
                    peer.submit(
                        run_id, round_index, train_loss=5.0 - 0.3 * round_index + 0.1 * i, packet_size_bytes=20_000
                    ).status_code
                    == 200
                )
            if round_index % 3 == 0:  # the peers evaluate every third round
                for peer in peers:
                    response = peer.post(
                        f"/v1/runs/{run_id}/rounds/{round_index}/applied",
                        {"params_digest": "ab" * 32, "val_loss": 5.2 - 0.3 * round_index},
                    )
                    assert response.status_code == 200, response.text
    dom, rows = open_page(f"{coordinator.url}/", tmp_path, "validation")
    assert 'class="series-loss"' in dom and 'class="series-val"' in dom
    assert dom.count('class="marker-loss"') == 7 and dom.count('class="marker-val"') == 3
    [val_path] = re.findall(r'<path d="([^"]+)"[^>]*class="series-val"', dom)
    assert val_path.count("M") == 1 and val_path.count("L") == 2, "joined across the rounds not evaluated"
    assert 'class="legend">train (mean over peers)<' in dom and 'class="legend">validation<' in dom
    assert "<th>val loss</th>" in dom and ">5.2000<" in dom and ">4.3000<" in dom  # rounds 0 and 3
    # tiny: 836,736 parameters x 4 bytes x 2 packets over 40,000 bytes of packets.
    assert dom.count(">167x<") == 7
    assert count_near(rows, VAL_RGB) > 100, "the validation series is missing from the plot"
    assert count_near(rows, LOSS_RGB) > 200


@needs_chromium
def test_page_of_a_run_every_peer_left(start_coordinator, tmp_path: Path):
    """Every peer went silent: the run is paused (coordinator/recovery.py) and the banner says since
    when and what it waits for."""
    coordinator = start_coordinator()
    with httpx.Client(base_url=coordinator.url, timeout=10) as client:
        run_id, peers = start_run(client, 2, **{"membership.heartbeat_timeout_s": 1.0})
        for peer in peers:
            assert peer.submit(run_id, 0).status_code == 200
        deadline = time.monotonic() + 20
        while client.get(f"/v1/runs/{run_id}/status").json()["recovery"] is None:
            assert time.monotonic() < deadline, "the run never paused"
            time.sleep(0.3)
    dom, _ = open_page(f"{coordinator.url}/?run={run_id}", tmp_path, "paused")
    assert '<div id="banner" class="banner stalled">Paused since ' in dom
    assert "every peer has stopped; the run is paused at round 1" in dom


@needs_chromium
def test_page_shows_a_peer_excluded_by_contribution_scoring(start_coordinator, tmp_path: Path):
    """Three peers score the fourth's updates as hurting in rounds 0 and 1 (protocol/scoring.py):
    its next submission is refused `excluded` (403), and the page shows why and everyone's score."""
    from tests.fixtures.coordinator import error_of

    coordinator = start_coordinator()
    with httpx.Client(base_url=coordinator.url, timeout=10) as client:
        run_id, peers = start_run(client, 4)
        ids = [peer.peer_id for peer in peers]
        for round_index in range(2):
            for peer in [peers[3], *peers[:3]]:  # the bad one first: once it hurt, no round waits for it
                assert peer.submit(run_id, round_index, train_loss=4.0).status_code == 200
            for peer in peers:
                scores = {
                    p: {"loss_delta": 0.1 if p == ids[3] else -0.1, "cosine": -0.8 if p == ids[3] else 0.8}
                    for p in ids
                    if p != peer.peer_id
                }
                response = peer.post(
                    f"/v1/runs/{run_id}/rounds/{round_index}/applied", {"params_digest": "ab" * 32, "scores": scores}
                )
                assert response.status_code == 200, response.text
        refused = peers[3].submit(run_id, 2, train_loss=4.0)
        assert refused.status_code == 403 and error_of(refused) == "excluded"
        # Round 2: the three earned credit 2 each; one of them reports another digest. Two votes of
        # credit 4 of 6 agree theirs, the third is excluded for a wrong digest, the dispute is shown.
        for peer in peers[:3]:
            assert peer.submit(run_id, 2, train_loss=4.0).status_code == 200
        for peer, digest in zip(peers[:3], ("cd" * 32, "cd" * 32, "ef" * 32)):
            response = peer.post(f"/v1/runs/{run_id}/rounds/2/applied", {"params_digest": digest})
            assert response.status_code == 200, response.text
    dom, _ = open_page(f"{coordinator.url}/", tmp_path)
    assert dom.count('class="peer-row"') == 4
    assert "excluded: hurting_updates: its updates hurt in 2 of its last 2 scored rounds" in dom
    assert "dloss 0.100 cos -0.80 (2/2 hurt)" in dom and dom.count("dloss -0.100 cos 0.80") == 3
    assert f"excluded: wrong_digest: round 2: it reported digest {'ef' * 8}" in dom
    assert (
        f"dispute: {'cd' * 6} by 2 (credit 4) vs {'ef' * 6} by 1 (credit 2); its chunks recompute to the"
        " agreed leaves by 2 peer(s) of credit 4"
    ) in dom
