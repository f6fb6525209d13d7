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
    reachability  whether the addresses the node would announce can be dialled from other
                  networks (node.exchange.p2p.assess_reachability); a fixed listen port is free
    disk          free space where the key, the data cache and checkpoints are written
    key           the key directory is writable; an existing key file loads (its peer id shown)

The exit code is 1 when any check FAILs, else 0; a WARN does not fail (a node behind NAT can
still train in client mode). The flags and --config are those of `node join` (node/config.py),
so the doctor checks the set-up the node would use. The only network traffic is the request to
the coordinator and loopback traffic to the local daemon.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

OK, WARN, FAIL = "OK", "WARN", "FAIL"
MIN_PYTHON = (3, 10)
FAIL_BELOW_BYTES = 1 << 30  # under 1 GiB free a checkpoint or the token cache may not fit
WARN_BELOW_BYTES = 5 << 30
LIBP2P_TIMEOUT_S = 60.0
HTTP_TIMEOUT_S = 10.0
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
    doctor = subparsers.add_parser("doctor", help="check this machine's set-up and say what to fix")
    doctor.add_argument("--coordinator", default=None, help="also check this coordinator, http://host:port")
    doctor.add_argument("--config", default=None, help="node config file (as for `node join --config`)")
    doctor.add_argument("--device", default=None, help="auto, cpu, cuda or cuda:N (default: as `node join`)")
    doctor.add_argument("--key", dest="key_path", default=None, help="identity file (default ~/.locoswarm/peer.key)")
    doctor.add_argument("--host-maddrs", nargs="+", default=None, help="listen addresses, as for `node join`")
    doctor.add_argument("--announce-maddrs", nargs="*", default=None, help="advertised addresses")
    doctor.add_argument("--client-mode", action=argparse.BooleanOptionalAction, default=None)
    doctor.add_argument("--auto-relay", dest="use_auto_relay", action=argparse.BooleanOptionalAction, default=None)
    doctor.add_argument("--checkpoint-dir", default=None, help="where checkpoints would be written")
    doctor.set_defaults(func=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    python = check_python()
    print(python.line(), flush=True)
    if python.status == FAIL:
        return 1
    from node.config import load_node_config
    from protocol.config_file import ConfigError, read_config_file

    path = Path(args.config) if args.config else None
    overrides = {name: getattr(args, name) for name in (
        "coordinator", "device", "key_path", "host_maddrs", "announce_maddrs", "client_mode", "use_auto_relay",
        "checkpoint_dir")}
    try:
        # A coordinator is required to join, not to be checked: a placeholder stands in for a missing one.
        if overrides["coordinator"] is None and "coordinator" not in (read_config_file(path) if path else {}):
            overrides["coordinator"] = NO_COORDINATOR
        config = load_node_config(path, overrides)
    except ConfigError as e:
        print(Check("config", FAIL, str(e), "fix the key named above").line())
        return 1
    checks = [("torch", check_torch), ("device", lambda: check_device(config.device)), ("libp2p", check_libp2p)]
    if config.coordinator != NO_COORDINATOR:
        checks.append(("coordinator", lambda: check_coordinator(config.coordinator)))
    checks += [("reachability", lambda: check_reachability(config)),
               ("disk", lambda: check_disk(_disk_dirs(config))), ("key", lambda: check_key(config.key_path))]
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
        return Check("python", FAIL, f"Python {version} at {sys.executable}",
                     "install Python >= 3.11 and rerun deploy/setup.sh with PYTHON=python3.11")
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
            return Check("device", FAIL, f"{device} requested but {why}",
                         'reinstall with TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" '
                         "bash deploy/setup.sh (check nvidia-smi), or use --device cpu")
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            return Check("device", FAIL, f"{device}: only {torch.cuda.device_count()} GPU(s) visible",
                         "pick an index below that count, or check CUDA_VISIBLE_DEVICES")
        props = torch.cuda.get_device_properties(index)
        return Check("device", OK, f"{device}: {props.name}, {props.total_memory / 2**30:.1f} GiB")
    if device == "mps":
        ok = torch.backends.mps.is_available()
        return Check("device", OK if ok else FAIL, f"mps {'available' if ok else 'not available'}",
                     "use --device cpu")
    if torch.cuda.is_available():
        return Check("device", WARN, f"{device}, although torch sees {torch.cuda.device_count()} GPU(s)",
                     "pass --device cuda to train on the GPU")
    return Check("device", WARN, f"{device}: {os.cpu_count()} cores, no CUDA GPU",
                 "fine for the tiny/mini presets; for real runs install a CUDA build of torch (TORCH_SPEC, see README)")


def check_libp2p() -> Check:
    import asyncio

    from node.exchange.p2p import ExchangeConfig, P2PExchange

    async def start_and_stop() -> tuple[float, float, int]:
        start = time.perf_counter()
        exchange = await P2PExchange.create(ExchangeConfig(run_id="doctor", host_maddrs=("/ip4/127.0.0.1/tcp/0",),
                                                           use_relay=False))
        up_s = time.perf_counter() - start
        try:
            num_maddrs = len(exchange.visible_maddrs)
        finally:
            start = time.perf_counter()
            await exchange.shutdown()
        return up_s, time.perf_counter() - start, num_maddrs

    try:
        up_s, down_s, num_maddrs = asyncio.run(asyncio.wait_for(start_and_stop(), LIBP2P_TIMEOUT_S))
    except Exception as e:
        return Check("libp2p", FAIL, f"the libp2p daemon did not start: {type(e).__name__}: {e}",
                     "reinstall hivemind==1.1.12 (its wheel ships the p2pd binary); check that 127.0.0.1 is usable")
    return Check("libp2p", OK, f"p2pd + DHT node started in {up_s:.2f} s, stopped in {down_s:.2f} s "
                               f"({num_maddrs} address{'es' if num_maddrs != 1 else ''})")


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
        return Check("coordinator", FAIL, f"{base} does not answer: {type(e).__name__}: {e}",
                     "check the URL and port, that the coordinator runs (`coordinator serve --host 0.0.0.0`) "
                     "and that no firewall blocks it")
    open_runs = [r for r in runs if r.get("state") in ("waiting", "running")]
    names = ", ".join(f"{r['run_id']} ({r['name']})" for r in open_runs[:5])
    if not open_runs:
        return Check("coordinator", WARN, f"{base} healthy ({rtt_ms:.0f} ms) but has no open run",
                     "ask the operator to create one (`locoswarm run create`)")
    return Check("coordinator", OK, f"{base} healthy ({rtt_ms:.0f} ms); open runs: {names}")


def check_reachability(config) -> Check:
    from node.exchange.p2p import assess_reachability

    if config.client_mode:
        return Check("reachability", OK, "client mode: this node fetches but serves neither DHT nor packets")
    busy = [m for m in config.host_maddrs if not _port_free(m)]
    if busy:
        return Check("reachability", FAIL, f"listen address in use: {', '.join(busy)}",
                     "stop whatever holds the port (another node?) or pick another in --host-maddrs")
    maddrs = list(config.announce_maddrs) or [_with_outbound_ip(m) for m in config.host_maddrs]
    reach = assess_reachability(maddrs)
    if config.use_auto_relay and not reach.reachable:
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
    from protocol.signing import PeerKey

    if key_path.exists():
        try:
            key = PeerKey.load_or_create(key_path)
        except (OSError, ValueError) as e:
            return Check("key", FAIL, f"{key_path} does not load: {e}",
                         "restore the file from a backup, or move it away to start as a new peer")
        where = key_path.parent
        writable = os.access(where, os.W_OK)
        return Check("key", OK if writable else WARN,
                     f"{key_path}: peer id {peer_id_from_public_key(key.public_bytes)} (rejoins as this peer)",
                     f"{where} is not writable (fine while the key exists)")
    parent = _existing_ancestor(key_path.parent)
    if not os.access(parent, os.W_OK):
        return Check("key", FAIL, f"cannot create {key_path}: {parent} is not writable",
                     "pass --key with a writable path")
    return Check("key", OK, f"{key_path} will be created on first join (keep it to rejoin as the same peer)")


# -- helpers -----------------------------------------------------------------------------------


def _disk_dirs(config) -> dict[str, Path]:
    from node.training.data import default_cache_dir

    dirs = {"key": config.key_path.parent, "data cache": default_cache_dir()}
    if config.checkpoint_dir is not None:
        dirs["checkpoints"] = config.checkpoint_dir
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
