"""One loader for config files: a TOML (or JSON) file, then overrides, validated by a pydantic model.

    config = load_config(RunConfig, Path("run.toml"), {"inner.lr": 3e-4})
    config = load_config(NodeConfig, Path("node.toml"), {"device": "cuda:1", "threads": None})

Both configs load through here: the run config (protocol/run_config.py, nested in sections) and a
volunteer node's config (node/config.py, flat). Precedence, lowest first: the model's defaults,
the file, the overrides. An override's key is dotted to reach inside a section ("inner.lr" sets
one field of [inner]; "deadline" replaces the whole table); a value of None means "not given",
so command-line flags that default to None override the file only when passed. The merged values
are validated once, so a bad value is refused whether it came from the file or a flag.

Every failure is a `ConfigError` whose message names each bad key by its dotted path:

    run.toml: inner.lr: Input should be greater than 0
    node.toml: threds: unknown key (known keys: coordinator, run_id, ...)
    run.toml: inner_lr: unknown key (it is now inner.lr)
"""

from __future__ import annotations

import copy
import json

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)


class ConfigError(ValueError):
    """A config file or override could not be used; the message names the key."""


def read_config_file(path: Path) -> dict[str, Any]:
    """The raw tables of a TOML file, or of a JSON one (by suffix); unchecked."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from e
    try:
        values = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from e
    except ValueError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: the top level must be a table of keys")
    return values


def with_overrides(values: Mapping[str, Any], overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """`values` with each override whose value is not None set; "a.b" sets key b of table a."""
    merged = copy.deepcopy(dict(values))
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        *sections, leaf = key.split(".")
        table = merged
        for depth, section in enumerate(sections):
            table = table.setdefault(section, {})
            if not isinstance(table, dict):
                raise ConfigError(f"{key}: {'.'.join(sections[:depth + 1])} is not a table")
        table[leaf] = value
    return merged


def validate_config(model: type[M], values: Mapping[str, Any], *, where: str,
                    renamed: Mapping[str, str] | None = None,
                    unions: Mapping[str, Collection[str]] | None = None) -> M:
    """`model` built from `values`; a ValidationError becomes a ConfigError prefixed with `where`."""
    try:
        return model.model_validate(values)
    except ValidationError as e:
        raise ConfigError(f"{where}: {describe_validation_error(e, model, renamed=renamed, unions=unions)}") from None


def load_config(model: type[M], path: Path | None = None, overrides: Mapping[str, Any] | None = None, *,
                renamed: Mapping[str, str] | None = None,
                unions: Mapping[str, Collection[str]] | None = None) -> M:
    """The model's defaults, then the file at `path` (if any), then `overrides` (None: not given)."""
    values = read_config_file(path) if path is not None else {}
    where = str(path) if path is not None else "command line"
    return validate_config(model, with_overrides(values, overrides), where=where, renamed=renamed, unions=unions)


def describe_validation_error(error: ValidationError, model: type[BaseModel] | None = None, *,
                              renamed: Mapping[str, str] | None = None,
                              unions: Mapping[str, Collection[str]] | None = None) -> str:
    """One line naming each bad key by its dotted path: 'inner.lr: Input should be greater than 0'.

    `unions` maps the dotted key of a tagged union to its tags, which pydantic puts in the path
    after the key ("deadline.fixed.round_timeout_s") and which are left out here. `renamed` maps
    keys that moved to where they are now, for the message about an unknown key."""
    parts = []
    for item in error.errors():
        path: list[str] = []
        for part in map(str, item["loc"]):
            if part not in (unions or {}).get(".".join(path), ()):
                path.append(part)
        key = ".".join(path) or "(top level)"
        parts.append(f"{key}: {_message(item, path, model, renamed or {})}")
    return "; ".join(parts)


def _message(item: Mapping[str, Any], path: list[str], model: type[BaseModel] | None,
             renamed: Mapping[str, str]) -> str:
    kind = item["type"]
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        key = ".".join(path)
        if key in renamed:
            return f"unknown key (it is now {renamed[key]})"
        known = _known_keys(model, path[:-1])
        return f"unknown key (known keys: {', '.join(known)})" if known else "unknown key"
    return item["msg"].removeprefix("Value error, ")


def _known_keys(model: type[BaseModel] | None, path: list[str]) -> list[str]:
    """The field names of the (sub)model at `path`; none where the path leaves plain models."""
    for name in path:
        field = model.model_fields.get(name) if model is not None else None
        annotation = field.annotation if field is not None else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return list(model.model_fields) if model is not None else []
