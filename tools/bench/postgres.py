"""A throwaway PostgreSQL server for benchmarks and tests, from Debian's binaries.

    python -m tools.bench.postgres start DIR    # prints the server's URL
    python -m tools.bench.postgres stop DIR

The server keeps its data in DIR/data and listens only on a unix socket in DIR (no TCP), with
fsync off: it is for measuring the coordinator, never for keeping anything. As root it runs as the
``postgres`` OS user (initdb refuses root). `new_schema(url)` gives a fresh, empty schema and the
URL that uses it, so that runs of a benchmark, or tests, never see each other's rows. The
integration tests' `postgres_url` fixture (tests/integration/conftest.py) starts one the same way.
"""

from __future__ import annotations

import argparse
import os
import pwd
import shutil
import socket
import subprocess
import uuid
from pathlib import Path

PG_BIN_DIRS = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)


class PostgresMissing(RuntimeError):
    """The binaries, or the OS user to run them as, are not on this machine."""


def _as_user() -> list[str]:
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError as e:
        raise PostgresMissing("running as root and there is no 'postgres' OS user for initdb") from e
    if shutil.which("runuser") is None:
        raise PostgresMissing("running as root and 'runuser' is missing")
    return ["runuser", "-u", "postgres", "--"]


def _bin_dir() -> Path:
    if not PG_BIN_DIRS or not (PG_BIN_DIRS[0] / "initdb").exists():
        raise PostgresMissing("PostgreSQL binaries not found under /usr/lib/postgresql/*/bin")
    return PG_BIN_DIRS[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(base: Path, timeout_s: float = 60.0) -> str:
    """Create a cluster in `base` (an empty or new directory), start it, return its URL."""
    bin_dir, as_user = _bin_dir(), _as_user()
    base.mkdir(parents=True, exist_ok=True)
    if as_user:
        user = pwd.getpwnam("postgres")
        os.chown(base, user.pw_uid, user.pw_gid)
    data_dir, log_file, port = base / "data", base / "server.log", _free_port()
    subprocess.run(
        as_user
        + [str(bin_dir / "initdb"), "-D", str(data_dir), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"],
        check=True,
        capture_output=True,
        timeout=timeout_s,
    )
    options = f"-k {base} -p {port} -c listen_addresses='' -c fsync=off"
    subprocess.run(
        as_user
        + [str(bin_dir / "pg_ctl"), "-D", str(data_dir), "-l", str(log_file), "-o", options, "-w", "-t", "30", "start"],
        check=True,
        capture_output=True,
        timeout=timeout_s,
    )
    return f"postgresql://postgres@/postgres?host={base}&port={port}"


def stop(base: Path, timeout_s: float = 60.0) -> None:
    """Stop the server of `base` (immediately: nothing in it is kept) and delete `base`."""
    subprocess.run(
        _as_user() + [str(_bin_dir() / "pg_ctl"), "-D", str(base / "data"), "-m", "immediate", "-w", "stop"],
        capture_output=True,
        timeout=timeout_s,
    )
    shutil.rmtree(base, ignore_errors=True)


def new_schema(url: str, prefix: str = "t") -> tuple[str, str]:
    """(schema, URL using it): a fresh, empty schema on the server of `url` (query-string URL)."""
    import psycopg

    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    separator = "&" if "?" in url else "?"
    return schema, f"{url}{separator}options=-csearch_path%3D{schema}"


def drop_schema(url: str, schema: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["start", "stop"])
    parser.add_argument("dir", type=Path, help="where the server keeps its data and socket")
    args = parser.parse_args(argv)
    if args.action == "start":
        print(start(args.dir))
    else:
        stop(args.dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
