"""`locoswarm doctor`: check this machine's set-up before joining a run, and say what to fix.

    locoswarm doctor [--coordinator URL] [--config node.toml] [--device cuda] [--key PATH] ...

One line per check, `OK`, `WARN` or `FAIL`, what was found, and for anything not OK what to do:

    python        Python >= 3.10 (TOML configs: the standard tomllib, or tomli on 3.10)
    torch         torch imports; its version and whether it is a CUDA build
    device        the device the node would train on exists (cuda: a GPU torch can use)
    libp2p        the exchange starts: a P2PExchange (p2pd daemon + DHT node) on 127.0.0.1, port 0,
                  is started and shut down, and the time it took is reported
    coordinator   GET /healthz answers (only with --coordinator or `coordinator` in --config),
                  and how many runs are open
    clock         this machine's clock against the coordinator's (its /healthz `server_time`, else
                  its HTTP Date header): hivemind's DHT nodes refuse each other when their clocks
                  are more than 3 s apart, so a node beyond CLOCK_REFUSE_S is refused at join
    reachability  whether the addresses the node would announce can be dialled from other
                  networks (node.exchange.reachability.assess_reachability); a fixed listen port is free
    disk          free space where the key, the data cache and checkpoints are written
    key           the key directory is writable; an existing key file loads (its peer id shown)

Clocks. hivemind 1.1.12 checks them when a DHT node bootstraps: `DHTNode.create` pings each
initial peer with `DHTProtocol.call_ping(peer, validate=True, strict=True)`
(hivemind/dht/protocol.py), which raises `ValidationError("local time must be within 3 seconds of
others ...")` when the peer's `PingResponse.dht_time` falls outside [time requested - 3, time
responded + 3] by this node's `get_dht_time` (`time.time`; the 3 is
`hivemind.utils.timed_storage.MAX_DHT_TIME_DISCREPANCY_SECONDS`), and `DHTNode.create` re-raises
it, so the node crashes at start (and so does a well-set newcomer that bootstraps from a node with
a bad clock). hivemind offers no supported way to shift its clock: `get_dht_time` is a module
global that each of its modules imports by name, so an offset would mean patching them all. The
node therefore refuses to join with a clock off by more than CLOCK_REFUSE_S (the tolerance less a
margin for the other peers' own error) and says how to fix it: turn on NTP.

The exit code is 1 when any check FAILs, else 0; a WARN does not fail (a node behind NAT can
still train in client mode). The flags and --config are those of `node join` (node/config.py),
so the doctor checks the set-up the node would use. The only network traffic is the requests to
the coordinator (its runs, and three round trips to its clock) and loopback traffic to the local daemon.
"""

from __future__ import annotations

import argparse
import email.utils
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from node.cli.config_flags import add_config_flags, config_overrides
from node.config import NetworkSection, NodeConfig

OK, WARN, FAIL = "OK", "WARN", "FAIL"
MIN_PYTHON = (3, 10)
FAIL_BELOW_BYTES = 1 << 30  # under 1 GiB free a checkpoint or the token cache may not fit
WARN_BELOW_BYTES = 5 << 30
LIBP2P_TIMEOUT_S = 60.0
HTTP_TIMEOUT_S = 10.0
# hivemind.utils.timed_storage.MAX_DHT_TIME_DISCREPANCY_SECONDS (a test pins the two together;
# importing hivemind here would load torch for a constant).
HIVEMIND_CLOCK_TOLERANCE_S = 3.0
CLOCK_REFUSE_S = HIVEMIND_CLOCK_TOLERANCE_S - 1.0  # certainly off by more: FAIL, and `node join` refuses
CLOCK_WARN_S = 1.0  # possibly off by more: WARN (two such clocks on opposite sides use 2 s of the 3)
CLOCK_SAMPLES = 3  # round trips; the shortest bounds the estimate best
CLOCK_FIX = (
    "turn on NTP: `sudo timedatectl set-ntp true` (systemd-timesyncd), or install chrony "
    "(`sudo apt install chrony`); `timedatectl` shows 'System clock synchronized: yes' once it is"
)
NO_COORDINATOR = "http://coordinator.not.given"


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: str  # OK, WARN or FAIL
    detail: str  # what was found
    fix: str = ""  # what to do, when not OK

    def line(self) -> str:
        fix = f" -> {self.fix}" if self.fix and self.status != OK else ""
        return f"{self.status:<4} {self.name:<12} {self.detail}{fix}"


def register(subparsers) -> None:
    doctor = subparsers.add_parser(
        "doctor",
        help="check this machine's set-up and say what to fix",
        description="Check this machine's set-up for `node join`, with the same flags and --config; "
        "--coordinator (optional here) also checks that coordinator and the clock against it.",
    )
    doctor.add_argument("--config", default=None, help="node config file (as for `node join --config`)")
    add_config_flags(doctor, NodeConfig)
    doctor.set_defaults(func=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    python = check_python()
    print(python.line(), flush=True)
    if python.status == FAIL:
        return 1
    from node.config import load_node_config
    from protocol.config_file import ConfigError, read_config_file

    path = Path(args.config) if args.config else None
    overrides = config_overrides(args, NodeConfig)
    try:
        # A coordinator is required to join, not to be checked: a placeholder stands in for a missing one.
        if overrides["coordinator"] is None and "coordinator" not in (read_config_file(path) if path else {}):
            overrides["coordinator"] = NO_COORDINATOR
        config = load_node_config(path, overrides)
    except ConfigError as e:
        print(Check("config", FAIL, str(e), "fix the key named above").line())
        return 1
    checks = [
        ("torch", check_torch),
        ("device", lambda: check_device(config.training.device)),
        ("libp2p", check_libp2p),
    ]
    if config.coordinator != NO_COORDINATOR:
        checks.append(("coordinator", lambda: check_coordinator(config.coordinator)))
        checks.append(("clock", lambda: check_clock(config.coordinator)))
    checks += [
        ("reachability", lambda: check_reachability(config.network)),
        ("disk", lambda: check_disk(_disk_dirs(config))),
        ("key", lambda: check_key(config.key_path)),
    ]
    failed = False
    for name, run_check in checks:
        try:
            result = run_check()
        except Exception as e:  # a check that crashes is a finding, not a reason to stop the others
            result = Check(name, FAIL, f"the check itself failed: {type(e).__name__}: {e}")
        print(result.line(), flush=True)
        failed |= result.status == FAIL
    print("doctor: " + ("something needs fixing (FAIL above)" if failed else "ready to join"), flush=True)
    return 1 if failed else 0


# -- checks ------------------------------------------------------------------------------------


def check_python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info[:2] < MIN_PYTHON:
        return Check(
            "python",
            FAIL,
            f"Python {version} at {sys.executable}",
            "install Python >= 3.11 and rerun deploy/setup.sh with PYTHON=python3.11",
        )
    return Check("python", OK, f"Python {version} at {sys.executable}")


def check_torch() -> Check:
    try:
        import torch
    except ImportError as e:
        return Check("torch", FAIL, f"torch does not import: {e}", "run deploy/setup.sh (it installs TORCH_SPEC)")
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU-only build"
    return Check("torch", OK, f"torch {torch.__version__} ({build})")


def check_device(device: str) -> Check:
    import torch

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            why = "this torch is a CPU-only build" if not torch.version.cuda else "no GPU visible to torch"
            return Check(
                "device",
                FAIL,
                f"{device} requested but {why}",
                'reinstall with TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" '
                "bash deploy/setup.sh (check nvidia-smi), or use --device cpu",
            )
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            return Check(
                "device",
                FAIL,
                f"{device}: only {torch.cuda.device_count()} GPU(s) visible",
                "pick an index below that count, or check CUDA_VISIBLE_DEVICES",
            )
        props = torch.cuda.get_device_properties(index)
        return Check("device", OK, f"{device}: {props.name}, {props.total_memory / 2**30:.1f} GiB")
    if device == "mps":
        ok = torch.backends.mps.is_available()
        return Check("device", OK if ok else FAIL, f"mps {'available' if ok else 'not available'}", "use --device cpu")
    if torch.cuda.is_available():
        return Check(
            "device",
            WARN,
            f"{device}, although torch sees {torch.cuda.device_count()} GPU(s)",
            "pass --device cuda to train on the GPU",
        )
    return Check(
        "device",
        WARN,
        f"{device}: {os.cpu_count()} cores, no CUDA GPU",
        "fine for the tiny/mini presets; for real runs install a CUDA build of torch (TORCH_SPEC, see README)",
    )


def check_libp2p() -> Check:
    import asyncio

    from hivemind.p2p import P2PDaemonError

    from node.exchange.config import ExchangeConfig
    from node.exchange.p2p import P2PExchange

    async def start_and_stop() -> tuple[float, float, int]:
        start = time.perf_counter()
        exchange = await P2PExchange.create(
            ExchangeConfig(run_id="doctor", host_maddrs=("/ip4/127.0.0.1/tcp/0",), use_relay=False)
        )
        up_s = time.perf_counter() - start
        try:
            num_maddrs = len(exchange.visible_maddrs)
        finally:
            start = time.perf_counter()
            await exchange.shutdown()
        return up_s, time.perf_counter() - start, num_maddrs

    try:
        up_s, down_s, num_maddrs = asyncio.run(asyncio.wait_for(start_and_stop(), LIBP2P_TIMEOUT_S))
    except (P2PDaemonError, OSError, RuntimeError) as e:  # OSError: a time-out too
        return Check(
            "libp2p",
            FAIL,
            f"the libp2p daemon did not start: {type(e).__name__}: {e}",
            "reinstall hivemind==1.1.12 (its wheel ships the p2pd binary); check that 127.0.0.1 is usable",
        )
    return Check(
        "libp2p",
        OK,
        f"p2pd + DHT node started in {up_s:.2f} s, stopped in {down_s:.2f} s "
        f"({num_maddrs} address{'es' if num_maddrs != 1 else ''})",
    )


def check_coordinator(url: str) -> Check:
    import httpx

    base = url.rstrip("/")
    start = time.perf_counter()
    try:
        health = httpx.get(f"{base}/healthz", timeout=HTTP_TIMEOUT_S, trust_env=False)
        rtt_ms = (time.perf_counter() - start) * 1e3
        health.raise_for_status()
        runs = httpx.get(f"{base}/v1/runs", timeout=HTTP_TIMEOUT_S, trust_env=False).json()["runs"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        return Check(
            "coordinator",
            FAIL,
            f"{base} does not answer: {type(e).__name__}: {e}",
            "check the URL and port, that the coordinator runs (`coordinator serve --host 0.0.0.0`) "
            "and that no firewall blocks it",
        )
    open_runs = [r for r in runs if r.get("state") in ("waiting", "running")]
    names = ", ".join(f"{r['run_id']} ({r['name']})" for r in open_runs[:5])
    if not open_runs:
        return Check(
            "coordinator",
            WARN,
            f"{base} healthy ({rtt_ms:.0f} ms) but has no open run",
            "ask the operator to create one (`locoswarm run create`)",
        )
    return Check("coordinator", OK, f"{base} healthy ({rtt_ms:.0f} ms); open runs: {names}")


@dataclass(frozen=True, slots=True)
class ClockOffset:
    """This machine's clock against the coordinator's."""

    offset_s: float  # this clock minus the coordinator's: positive when this one is ahead
    error_s: float  # the estimate is within this of the truth (half the round trip, plus the Date header's 1 s)
    source: str  # "server_time" (the /healthz field) or "Date header" (a coordinator older than the field)

    @property
    def beyond_refusal(self) -> bool:
        """Off by more than CLOCK_REFUSE_S even at the estimate's most favourable end."""
        return abs(self.offset_s) - self.error_s > CLOCK_REFUSE_S

    def describe(self) -> str:
        side = "ahead of" if self.offset_s > 0 else "behind"
        return f"{abs(self.offset_s):.2f} s {side} the coordinator's (+-{self.error_s:.2f} s, from its {self.source})"


def measure_clock_offset(
    url: str, clock: Callable[[], float] = time.time, samples: int = CLOCK_SAMPLES, timeout_s: float = HTTP_TIMEOUT_S
) -> ClockOffset:
    """The offset of `clock` from the coordinator's, as NTP estimates it: the server's time is
    taken to fall at the midpoint of the request's round trip, so the error is at most half the
    round trip; of `samples` requests, the one with the shortest round trip counts. Raises
    httpx.HTTPError (or ValueError for an answer without a time) when the coordinator cannot say."""
    import httpx

    best: ClockOffset | None = None
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        for _ in range(samples):
            sent = clock()
            response = client.get(f"{url.rstrip('/')}/healthz")
            received = clock()
            response.raise_for_status()
            midpoint, half_rtt = (sent + received) / 2, max(0.0, received - sent) / 2
            body = response.json()
            server_time = body.get("server_time") if isinstance(body, dict) else None
            if isinstance(server_time, (int, float)) and not isinstance(server_time, bool):
                sample = ClockOffset(midpoint - server_time, half_rtt, "server_time")
            else:  # the Date header says the whole second the server was in: [D, D + 1)
                date = email.utils.parsedate_to_datetime(response.headers["date"]).timestamp()
                sample = ClockOffset(midpoint - (date + 0.5), half_rtt + 0.5, "Date header")
            if best is None or sample.error_s < best.error_s:
                best = sample
    assert best is not None
    return best


def check_clock(url: str, clock: Callable[[], float] = time.time) -> Check:
    import httpx

    try:
        offset = measure_clock_offset(url, clock)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        return Check(
            "clock",
            WARN,
            f"could not compare with the coordinator's: {type(e).__name__}: {e}",
            "fix the coordinator check first",
        )
    detail = f"{offset.describe()}; hivemind's DHT refuses peers over {HIVEMIND_CLOCK_TOLERANCE_S:g} s apart"
    if offset.beyond_refusal:
        return Check("clock", FAIL, detail + "; `node join` refuses to start", CLOCK_FIX)
    if abs(offset.offset_s) + offset.error_s > CLOCK_WARN_S:
        return Check("clock", WARN, detail, CLOCK_FIX)
    return Check("clock", OK, offset.describe())


def clock_refusal(url: str, clock: Callable[[], float] = time.time, timeout_s: float = HTTP_TIMEOUT_S) -> str | None:
    """The line `node join` refuses with when this clock is beyond CLOCK_REFUSE_S; None when it is
    not, or when the coordinator cannot be asked (the join then says what is wrong with it)."""
    import httpx

    try:
        offset = measure_clock_offset(url, clock, timeout_s=timeout_s)
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    if not offset.beyond_refusal:
        return None
    return (
        f"this machine's clock is {offset.describe()}; peers' DHT nodes refuse each other beyond "
        f"{HIVEMIND_CLOCK_TOLERANCE_S:g} s: {CLOCK_FIX}, then join again"
    )


def check_reachability(network: NetworkSection) -> Check:
    """Whether others could dial the addresses a node with these network settings would announce."""
    from node.exchange.reachability import assess_reachability

    if network.client_mode:
        return Check("reachability", OK, "client mode: this node fetches but serves neither DHT nor packets")
    busy = [m for m in network.host_maddrs if not _port_free(m)]
    if busy:
        return Check(
            "reachability",
            FAIL,
            f"listen address in use: {', '.join(busy)}",
            "stop whatever holds the port (another node?) or pick another in --host-maddrs",
        )
    if network.relay_via:
        return Check("reachability", OK, f"reachable through the relays {', '.join(network.relay_via)}")
    maddrs = list(network.announce_maddrs) or [_with_outbound_ip(m) for m in network.host_maddrs]
    reach = assess_reachability(maddrs)
    if network.use_auto_relay and not reach.reachable:
        return Check("reachability", OK, f"{', '.join(maddrs)} private; auto-relay will make this node reachable")
    return Check("reachability", OK if reach.reachable else WARN, f"would announce {', '.join(maddrs)}", reach.advice)


def check_disk(dirs: dict[str, Path]) -> Check:
    worst: tuple[int, str, Path] | None = None
    for label, directory in dirs.items():
        free = shutil.disk_usage(_existing_ancestor(directory)).free
        if worst is None or free < worst[0]:
            worst = (free, label, directory)
    free, label, directory = worst
    detail = f"{free / 2**30:.1f} GiB free for the {label} ({directory})"
    if free < FAIL_BELOW_BYTES:
        return Check("disk", FAIL, detail, "free some space or point the directory elsewhere")
    if free < WARN_BELOW_BYTES:
        return Check("disk", WARN, detail, "a few GB are needed for checkpoints and the token cache of real runs")
    return Check("disk", OK, detail)


def check_key(key_path: Path) -> Check:
    from protocol.http import peer_id_from_public_key
    from protocol.signing import KeyFileError, PeerKey

    if key_path.exists():
        try:
            key = PeerKey.load_or_create(key_path)
        except KeyFileError as e:  # it says the fix
            return Check("key", FAIL, str(e))
        where = key_path.parent
        writable = os.access(where, os.W_OK)
        return Check(
            "key",
            OK if writable else WARN,
            f"{key_path}: peer id {peer_id_from_public_key(key.public_bytes)} (rejoins as this peer)",
            f"{where} is not writable (fine while the key exists)",
        )
    parent = _existing_ancestor(key_path.parent)
    if not os.access(parent, os.W_OK):
        return Check(
            "key", FAIL, f"cannot create {key_path}: {parent} is not writable", "pass --key with a writable path"
        )
    return Check("key", OK, f"{key_path} will be created on first join (keep it to rejoin as the same peer)")


# -- helpers -----------------------------------------------------------------------------------


def _disk_dirs(config: NodeConfig) -> dict[str, Path]:
    from node.training.data import default_cache_dir

    dirs = {"key": config.key_path.parent, "data cache": default_cache_dir()}
    if config.checkpoints.checkpoint_dir is not None:
        dirs["checkpoints"] = config.checkpoints.checkpoint_dir
    return dirs


def _existing_ancestor(path: Path) -> Path:
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _split_tcp(maddr: str) -> tuple[str, str, int] | None:
    """(family, ip, port) of /ip4|ip6/IP/tcp/PORT..., else None."""
    parts = maddr.strip("/").split("/")
    if len(parts) >= 4 and parts[0] in ("ip4", "ip6") and parts[2] == "tcp" and parts[3].isdigit():
        return parts[0], parts[1], int(parts[3])
    return None


def _port_free(maddr: str) -> bool:
    parsed = _split_tcp(maddr)
    if parsed is None or parsed[2] == 0:
        return True
    family, ip, port = parsed
    with socket.socket(socket.AF_INET6 if family == "ip6" else socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((ip, port))
        except OSError:
            return False
    return True


def _with_outbound_ip(maddr: str) -> str:
    """A wildcard listen address as others would see it: the IP of this host's default route.

    p2pd announces every interface's address for 0.0.0.0; the default-route one is what matters
    for reachability. Connecting a UDP socket sends nothing; it only asks the kernel for a route.
    """
    parsed = _split_tcp(maddr)
    if parsed is None or parsed[1] not in ("0.0.0.0", "::"):
        return maddr
    family, wildcard, _ = parsed
    probe = ("2001:4860:4860::8888", 53) if family == "ip6" else ("8.8.8.8", 53)
    try:
        with socket.socket(socket.AF_INET6 if family == "ip6" else socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(probe)
            ip = sock.getsockname()[0]
    except OSError:
        return maddr.replace(wildcard, "127.0.0.1" if family == "ip4" else "::1", 1)
    return maddr.replace(wildcard, ip, 1)
