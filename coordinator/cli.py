"""Command-line entry points for the coordinator, wired into `locoswarm` by `register`.

``locoswarm coordinator serve``  run the service (prints ``coordinator listening on URL`` once the
                                 socket is bound and the app started: scripts and tests wait on it)
``locoswarm run create|list|close``  manage runs with the admin token
``locoswarm status``             the status page as a terminal table (``--watch`` to refresh)

Top-level imports stay light (argparse and stdlib) so ``locoswarm --help`` is instant; FastAPI,
uvicorn and httpx are imported inside the commands. Operator mistakes -- a bad config file, a
database that cannot be opened, a port in use, an unreachable coordinator -- end with one line
on stderr and exit code 2; the line says what to do (a missing admin token: where `serve` wrote
it; a run that does not exist: `run list`).

Logging: the coordinator's own lines at INFO, uvicorn's at WARNING (no line per request); `serve
-v` adds uvicorn's INFO lines and the access log.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import socket
import sys
from pathlib import Path

ADMIN_TOKEN_ENV = "LOCOSWARM_ADMIN_TOKEN"
EXIT_USAGE = 2


class CliError(Exception):
    """An operator-facing failure: printed as one line, exit code 2."""


class RefusedByCoordinator(CliError):
    """The coordinator answered with a 4xx refusal; `code` is its error code (protocol.http.ErrorCode)."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_USAGE


# -- serve ------------------------------------------------------------------------------------


def _admin_token_for_server(args: argparse.Namespace) -> str:
    if os.environ.get(ADMIN_TOKEN_ENV):
        return os.environ[ADMIN_TOKEN_ENV].strip()
    if args.admin_token_file:
        try:
            return Path(args.admin_token_file).read_text().strip()
        except OSError as e:
            raise CliError(f"cannot read admin token file {args.admin_token_file}: {e.strerror}") from e
    # Generated once and kept next to the database, so a restart keeps the same token.
    if args.db.startswith(("postgresql://", "postgres://")):
        token_path = Path("locoswarm-coordinator.admin-token")
    else:
        token_path = Path(args.db.removeprefix("sqlite:///") + ".admin-token")
    if token_path.exists():
        token = token_path.read_text().strip()
    else:
        token = secrets.token_urlsafe(32)
        fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    print(f"admin token in {token_path.resolve()}", flush=True)
    return token


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # Lets a restarted coordinator take its port back while old connections sit in TIME_WAIT;
    # on Linux it never lets two servers listen on one port.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        reason = "address already in use" if e.errno == 98 else (e.strerror or str(e))
        raise CliError(f"cannot listen on {host}:{port}: {reason}") from e
    sock.set_inheritable(True)
    return sock


def _configure_logging(verbose: bool) -> None:
    """The coordinator's own loggers at INFO on stderr; the HTTP libraries' at WARNING unless `verbose`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for name in ("httpx", "httpcore", "asyncio"):
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.WARNING)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from coordinator.app import create_app
    from coordinator.errors import StorageError
    from coordinator.storage import open_storage

    try:
        storage = open_storage(args.db)
    except StorageError as e:
        return _fail(str(e))
    try:
        token = _admin_token_for_server(args)
        if len(token) < 16:
            raise CliError("the admin token must have at least 16 characters")
        sock = _bind(args.host, args.port)
    except CliError as e:
        storage.close()
        return _fail(str(e))
    bound_port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    url = f"http://{host}:{bound_port}"
    app = create_app(storage, token, tune_gc=True, keep_rounds=args.keep_rounds)  # this process serves only the app
    _configure_logging(args.verbose)
    config = uvicorn.Config(
        app,
        log_level="info" if args.verbose and args.log_level == "warning" else args.log_level,
        access_log=args.access_log or args.verbose,
        timeout_graceful_shutdown=2,
        # Long-polls hold connections up to a minute; keep idle ones a little longer.
        timeout_keep_alive=75,
    )

    class AnnouncingServer(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                print(f"coordinator listening on {url}", flush=True)

    try:
        AnnouncingServer(config).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on; that is a clean stop
        pass
    finally:
        storage.close()
    return 0


# -- admin commands ---------------------------------------------------------------------------


def _admin_token_for_client(args: argparse.Namespace) -> str:
    if args.admin_token:
        return args.admin_token
    if args.admin_token_file:
        try:
            return Path(args.admin_token_file).read_text().strip()
        except OSError as e:
            raise CliError(f"cannot read admin token file {args.admin_token_file}: {e.strerror}") from e
    if os.environ.get(ADMIN_TOKEN_ENV):
        return os.environ[ADMIN_TOKEN_ENV].strip()
    found = _admin_token_files(Path.cwd())
    here = f"; in this directory: {', '.join(map(str, found))}" if found else ""
    raise CliError(
        f"no admin token: pass --admin-token-file PATH, the file `coordinator serve` printed as `admin token in "
        f"PATH` (beside a SQLite database DB: DB.admin-token), or --admin-token T, or set {ADMIN_TOKEN_ENV}{here}"
    )


def _admin_token_files(directory: Path) -> list[Path]:
    """Token files `serve` may have written (`<db>.admin-token`) in `directory` or one level below."""
    found = [*directory.glob("*.admin-token"), *directory.glob("*/*.admin-token")]
    return sorted(path.relative_to(directory) for path in found)[:3]


def _request(method: str, url: str, **kwargs: object) -> dict:
    """One HTTP call; a refusal or an unreachable server becomes a `CliError`."""
    import httpx

    try:
        response = httpx.request(method, url, timeout=30.0, **kwargs)  # type: ignore[arg-type]
    except httpx.HTTPError as e:
        raise CliError(f"cannot reach the coordinator at {url}: {e}") from e
    if response.status_code >= 400:
        try:
            body = response.json()
            code, reason = str(body["error"]), f"{body['error']}: {body['detail']}"
        except (ValueError, KeyError, TypeError):
            code, reason = "http_error", response.text[:200]
        raise RefusedByCoordinator(f"{method} {url} refused ({response.status_code}) {reason}", code)
    return response.json()


def _no_such_run(error: CliError, base: str, run_id: str) -> CliError:
    """A run_not_found refusal, said as what to do about it; any other error unchanged."""
    if isinstance(error, RefusedByCoordinator) and error.code == "run_not_found":
        return CliError(
            f"run {run_id} does not exist on {base}: list the runs with `locoswarm run list --coordinator {base}`"
        )
    return error


def _run_create(args: argparse.Namespace) -> int:
    from protocol.run_config import ConfigError, load_run_config

    try:
        config = load_run_config(Path(args.config))
        token = _admin_token_for_client(args)
        created = _request(
            "POST",
            f"{args.coordinator.rstrip('/')}/v1/runs",
            content=config.model_dump_json(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
    except (ConfigError, CliError) as e:
        return _fail(str(e))
    print(created["run_id"])
    return 0


def _run_list(args: argparse.Namespace) -> int:
    try:
        runs = _request("GET", f"{args.coordinator.rstrip('/')}/v1/runs")["runs"]
    except CliError as e:
        return _fail(str(e))
    for run in runs:
        print(f"{run['run_id']}  {run['state']:<9} round {run['current_round']:<6} {run['name']}")
    return 0


def _run_close(args: argparse.Namespace) -> int:
    base = args.coordinator.rstrip("/")
    try:
        token = _admin_token_for_client(args)
        run = _request(
            "POST",
            f"{base}/v1/runs/{args.run}/close",
            headers={"Authorization": f"Bearer {token}"},
        )
    except CliError as e:
        return _fail(str(_no_such_run(e, base, args.run)))
    print(f"{run['run_id']} {run['state']}")
    return 0


def _status(args: argparse.Namespace) -> int:
    import time

    from coordinator.terminal import pick_run, render_status

    base = args.coordinator.rstrip("/")
    try:
        while True:
            run_id = args.run
            if run_id is None:
                runs = _request("GET", f"{base}/v1/runs")["runs"]
                if not runs:
                    raise CliError(
                        f"no runs on {base}: create one with `locoswarm run create --coordinator "
                        f"{base} --config run.toml`"
                    )
                run_id = pick_run(runs)
            try:
                text = render_status(_request("GET", f"{base}/v1/runs/{run_id}/status"))
            except CliError as e:
                raise _no_such_run(e, base, run_id) from e
            if not args.watch:
                print(text)
                return 0
            print("\x1b[H\x1b[2J" + text, flush=True)
            time.sleep(args.interval_s)
    except CliError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        return 0


# -- wiring -----------------------------------------------------------------------------------


def _add_admin_token_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--admin-token", help=f"admin token (default: ${ADMIN_TOKEN_ENV})")
    parser.add_argument(
        "--admin-token-file",
        help="file holding the admin token (`coordinator serve` without a token writes one "
        "beside its SQLite database, DB.admin-token, and prints its path)",
    )


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    coordinator = subparsers.add_parser("coordinator", help="run the coordinator service")
    coordinator_sub = coordinator.add_subparsers(dest="coordinator_command", metavar="COMMAND")
    serve = coordinator_sub.add_parser("serve", help="serve the coordinator HTTP API and page")
    serve.add_argument(
        "--db",
        default="sqlite:///locoswarm-coordinator.db",
        help="sqlite:///path.db (default) or postgresql://user@host/dbname",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve.add_argument(
        "--admin-token-file",
        help=f"file holding the admin token (else ${ADMIN_TOKEN_ENV}, else one is generated next to the database)",
    )
    serve.add_argument(
        "--keep-rounds",
        type=_non_negative_int,
        default=1000,
        metavar="N",
        help="keep per-peer rows (submissions outside manifests, reports, scores) of the newest N rounds;"
        " older rounds keep their agreed digest and manifest (0: keep everything; default %(default)s)",
    )
    serve.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    serve.add_argument("--access-log", action="store_true", help="log every request")
    serve.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="uvicorn's INFO lines and the access log (default: the coordinator's own lines only)",
    )
    serve.set_defaults(func=_serve)
    coordinator.set_defaults(func=lambda args: coordinator.print_help() or EXIT_USAGE)

    run = subparsers.add_parser("run", help="create, list and close training runs")
    run_sub = run.add_subparsers(dest="run_command", metavar="COMMAND")
    create = run_sub.add_parser("create", help="create a run from a TOML config file")
    create.add_argument("--coordinator", required=True, help="http://host:port")
    create.add_argument("--config", required=True, help="run config, TOML (or .json)")
    _add_admin_token_args(create)
    create.set_defaults(func=_run_create)
    listing = run_sub.add_parser("list", help="list runs")
    listing.add_argument("--coordinator", required=True)
    listing.set_defaults(func=_run_list)
    close = run_sub.add_parser("close", help="close a run: its open round closes now")
    close.add_argument("--coordinator", required=True)
    close.add_argument("--run", required=True)
    _add_admin_token_args(close)
    close.set_defaults(func=_run_close)
    run.set_defaults(func=lambda args: run.print_help() or EXIT_USAGE)

    status = subparsers.add_parser("status", help="show a run's status in the terminal")
    status.add_argument("--coordinator", required=True, help="http://host:port")
    status.add_argument("--run", help="run id (default: the newest run still waiting or running, else the newest)")
    status.add_argument("--watch", action="store_true", help="refresh until interrupted (Ctrl+C)")
    status.add_argument(
        "--interval-s", type=float, default=2.0, help="with --watch: seconds between refreshes (default 2)"
    )
    status.set_defaults(func=_status)


def main(argv: list[str] | None = None) -> int:
    """``python -m coordinator.cli ...``: the same commands as ``locoswarm``, for a coordinator
    host that installs only the coordinator's dependencies (no torch, no hivemind)."""
    parser = argparse.ArgumentParser(
        prog="python -m coordinator.cli", description="The locoswarm coordinator's commands."
    )
    register(parser.add_subparsers(dest="command", metavar="COMMAND"))
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return EXIT_USAGE
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
