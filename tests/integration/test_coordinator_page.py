"""The status page in headless Chromium against a live coordinator with several closed rounds:
after its script ran, the DOM has the peer rows and both plot series, and the screenshot shows
the plot's two colours (decoded with a tiny stdlib PNG reader)."""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import httpx
import pytest

from tests.fixtures.coordinator import SignedPeer, create_run

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

LOSS_RGB = (0x25, 0x63, 0xEB)  # the page's loss series colour
TIME_RGB = (0xEA, 0x58, 0x0C)  # the page's round-time series colour


def decode_png(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) for 8-bit RGB/RGBA non-interlaced PNGs."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, chunk = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
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
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
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
        run_id = create_run(client, {"name": "page-demo", "membership.min_peers": 3,
                                     "membership.heartbeat_timeout_s": 300.0})
        peers = [SignedPeer(client) for _ in range(3)]
        for i, peer in enumerate(peers):
            peer.join(run_id, bandwidth_mbps=100.0 * (i + 1), device=f"gpu-{i}",
                      **({"uplink_mbps": 40.0} if i == 0 else {}))
        for round_index in range(8):
            for i, peer in enumerate(peers):
                loss = 5.0 - 0.35 * round_index + 0.05 * i
                assert peer.submit(run_id, round_index, train_loss=loss).status_code == 200
            for i, peer in enumerate(peers):
                digest = "ab" * 32 if i < 2 or round_index < 7 else "cd" * 32
                assert peer.applied(run_id, round_index, digest).status_code == 200
        peers[0].submit(run_id, 8, train_loss=2.1)
    return run_id


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="chromium is not installed (apt-get install chromium)")
def test_status_page_renders_in_headless_chromium(start_coordinator, tmp_path: Path):
    coordinator = start_coordinator()
    run_id = populate(coordinator.url)
    screenshot = tmp_path / "page.png"
    result = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
         f"--screenshot={screenshot}", "--dump-dom", "--window-size=1280,900",
         "--virtual-time-budget=5000", f"{coordinator.url}/"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    dom = result.stdout
    assert run_id in dom and "page-demo" in dom
    assert dom.count('class="peer-row"') == 3
    assert dom.count('class="round-row"') == 8
    assert 'class="series-loss"' in dom and 'class="series-time"' in dom
    assert "params_mismatch @7" in dom
    assert "100 Mbps, up 40" in dom and "200 Mbps<" in dom  # measured, and the uplink where stated
    assert '<span id="error"></span>' in dom, "the status fetch failed"

    width, height, rows = decode_png(screenshot.read_bytes())
    assert (width, height) == (1280, 900)
    assert len(set(rows[height // 2][::3])) > 3, "the screenshot is blank"
    assert count_near(rows, LOSS_RGB) > 200, "the loss series is missing from the plot"
    assert count_near(rows, TIME_RGB) > 200, "the round-time series is missing from the plot"
