"""A volunteer node's configuration from a TOML file, with command-line overrides.

    config = load_node_config(Path("node.toml"), overrides={"device": "cuda:1"})
    print(format_node_config(config))          # the resolved config, printed at start-up

The file's keys are exactly the fields of `node.round.loop.NodeConfig`, at the top level (see
deploy/node.toml for a commented sample). Precedence, lowest first: the dataclass defaults, the
file, the command line (`overrides`, already mapped to field names; a value of None means "not
given"). Every value is checked for its type and range after merging, so a bad value is refused
whether it came from the file or a flag, and every message names the key:

    node.toml: unknown key 'fetch_timeout' (known keys: coordinator, run_id, ...)
    node.toml: threads: must be between 0 and 1024, got -1

Decisions: paths expand `~`; `device = "auto"` (also the default when neither the file nor the
command line names one) picks `cuda` when torch sees a GPU, else `cpu`; TOML has no null, so an
optional field is "unset" by leaving it out; the printed config hides the join token.
"""

from __future__ import annotations

import dataclasses
import json
import re
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from node.round.loop import NodeConfig
from protocol.run_config import ConfigError

AUTO_DEVICE = "auto"
_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d{1,3})?)$")
_RUN_ID = re.compile(r"^[^/\x00-\x1f\x7f]{1,256}$")


class NodeConfigError(ConfigError):
    """A node config file or flag could not be used; the message names the key."""


def _between(low: float, high: float) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return None if low <= value <= high else f"must be between {low:g} and {high:g}, got {value}"
    return check


def _positive_at_most(high: float) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return None if 0 < value <= high else f"must be > 0 and at most {high:g}, got {value}"
    return check


def _matches(pattern: re.Pattern, what: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return None if pattern.match(value) else f"must be {what}, got {value!r}"
    return check


def _url(value: str) -> str | None:
    return None if re.match(r"^https?://[^\s/]+", value) else f"must be an http:// or https:// URL, got {value!r}"


def _maddrs(nonempty: bool) -> Callable[[Any], str | None]:
    def check(value: tuple[str, ...]) -> str | None:
        if nonempty and not value:
            return "must name at least one multiaddr"
        bad = [m for m in value if not m.startswith("/") or " " in m]
        return f"not multiaddrs (like /ip4/0.0.0.0/tcp/31337): {bad}" if bad else None
    return check


def _token(value: str) -> str | None:
    return None if 8 <= len(value) <= 256 else "must have 8 to 256 characters"


# Range checks by field, run after the type check. A field of NodeConfig missing here has only
# its type checked (so a field added to NodeConfig is accepted in files at once).
CHECKS: dict[str, Callable[[Any], str | None]] = {
    "coordinator": _url,
    "run_id": _matches(_RUN_ID, "a run id (no '/', no control characters)"),
    "join_token": _token,
    "device": _matches(_DEVICE, "auto, cpu, mps, cuda or cuda:N"),
    "host_maddrs": _maddrs(nonempty=True),
    "announce_maddrs": _maddrs(nonempty=False),
    "initial_peers": _maddrs(nonempty=False),
    "threads": _between(0, 1024),
    "max_rounds": _between(1, 100_000_000),
    "fetch_timeout_s": _positive_at_most(86_400),
    "uplink_mbps": _positive_at_most(1e7),
}


def node_config_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(NodeConfig)}


def read_node_config_file(path: Path) -> dict[str, Any]:
    """The raw key/value table of a node TOML file (unchecked)."""
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except OSError as e:
        raise NodeConfigError(f"{path}: cannot read: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise NodeConfigError(f"{path}: not valid TOML: {e}") from e


def load_node_config(path: Path | None = None, overrides: Mapping[str, Any] | None = None) -> NodeConfig:
    """Defaults, then the file at `path` (if any), then `overrides` whose value is not None."""
    where = str(path) if path is not None else "command line"
    values: dict[str, Any] = {"device": AUTO_DEVICE}
    if path is not None:
        values.update(read_node_config_file(path))
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return resolve_node_config(values)
    except NodeConfigError as e:
        raise NodeConfigError(f"{where}: {e}") from None


def resolve_node_config(values: Mapping[str, Any]) -> NodeConfig:
    """Check every key and value against NodeConfig and build it (device "auto" resolved)."""
    fields = node_config_fields()
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise NodeConfigError(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                              f"(known keys: {', '.join(fields)})")
    hints = typing.get_type_hints(NodeConfig)
    checked: dict[str, Any] = {}
    for name, value in values.items():
        checked[name] = _coerce(name, value, hints[name])
        check = CHECKS.get(name)
        problem = check(checked[name]) if check is not None and checked[name] is not None else None
        if problem:
            raise NodeConfigError(f"{name}: {problem}")
    missing = [n for n, f in fields.items() if n not in checked and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        flag = "--" + missing[0].replace("_", "-")
        raise NodeConfigError(f"{', '.join(missing)}: required (set it in the config file or pass {flag})")
    if checked.get("device") == AUTO_DEVICE:
        checked["device"] = _auto_device()
    return NodeConfig(**checked)


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """`value` as type `hint` (str, bool, int, float, Path, tuple[str, ...], or X | None)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(name, value, inner[0]) if len(inner) == 1 else value
    if hint is bool:
        if not isinstance(value, bool):
            raise NodeConfigError(f"{name}: must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise NodeConfigError(f"{name}: must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise NodeConfigError(f"{name}: must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise NodeConfigError(f"{name}: must be a string, got {value!r}")
        return value
    if hint is Path:
        if not isinstance(value, (str, Path)) or not str(value):
            raise NodeConfigError(f"{name}: must be a path (a string), got {value!r}")
        return Path(value).expanduser()
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise NodeConfigError(f"{name}: must be a list of strings, got {value!r}")
        return tuple(value)
    return value


def _auto_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def node_config_dict(config: NodeConfig) -> dict[str, Any]:
    """The config as JSON-ready values, the join token hidden (logs get shared in bug reports)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, Path):
            value = str(value)
        elif isinstance(value, tuple):
            value = list(value)
        if f.name == "join_token" and value is not None:
            value = "<hidden>"
        out[f.name] = value
    return out


def format_node_config(config: NodeConfig) -> str:
    return "node config: " + json.dumps(node_config_dict(config))
