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
    node.toml: threds: unknown key (did you mean threads?)
    run.toml: inner_step: unknown key (did you mean inner.steps?)
    run.toml: inner_lr: unknown key (it is now inner.lr)
    node.toml: colour: unknown key (known keys: coordinator, run_id, ...)

A misspelt key is offered the closest known one (difflib, over every dotted key of the model and
the old names in `renamed`); bounds are printed as plain numbers (100000000, 0.0000001).
"""

from __future__ import annotations

import copy
import difflib
import json
import typing
from decimal import Decimal

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
                raise ConfigError(f"{key}: {'.'.join(sections[: depth + 1])} is not a table")
        table[leaf] = value
    return merged


def validate_config(
    model: type[M],
    values: Mapping[str, Any],
    *,
    where: str,
    renamed: Mapping[str, str] | None = None,
    unions: Mapping[str, Collection[str]] | None = None,
) -> M:
    """`model` built from `values`; a ValidationError becomes a ConfigError prefixed with `where`."""
    try:
        return model.model_validate(values)
    except ValidationError as e:
        raise ConfigError(f"{where}: {describe_validation_error(e, model, renamed=renamed, unions=unions)}") from None


def load_config(
    model: type[M],
    path: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    renamed: Mapping[str, str] | None = None,
    unions: Mapping[str, Collection[str]] | None = None,
) -> M:
    """The model's defaults, then the file at `path` (if any), then `overrides` (None: not given)."""
    values = read_config_file(path) if path is not None else {}
    where = str(path) if path is not None else "command line"
    return validate_config(model, with_overrides(values, overrides), where=where, renamed=renamed, unions=unions)


def describe_validation_error(
    error: ValidationError,
    model: type[BaseModel] | None = None,
    *,
    renamed: Mapping[str, str] | None = None,
    unions: Mapping[str, Collection[str]] | None = None,
) -> str:
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


# pydantic's bound errors, re-worded so the bound is a plain number (pydantic's own text may
# print a float bound in exponent form).
_BOUNDS = {
    "greater_than": ("gt", "greater than"),
    "greater_than_equal": ("ge", "greater than or equal to"),
    "less_than": ("lt", "less than"),
    "less_than_equal": ("le", "less than or equal to"),
}


def _message(
    item: Mapping[str, Any], path: list[str], model: type[BaseModel] | None, renamed: Mapping[str, str]
) -> str:
    kind = item["type"]
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        key = ".".join(path)
        if key in renamed:
            return f"unknown key (it is now {renamed[key]})"
        suggestion = _closest_key(key, model, renamed)
        if suggestion is not None:
            return f"unknown key (did you mean {suggestion}?)"
        known = _known_keys(model, path[:-1])
        return f"unknown key (known keys: {', '.join(known)})" if known else "unknown key"
    bound = _BOUNDS.get(kind)
    if bound is not None and bound[0] in item.get("ctx", {}):
        return f"Input should be {bound[1]} {plain_number(item['ctx'][bound[0]])}"
    return item["msg"].removeprefix("Value error, ")


def plain_number(value: Any) -> str:
    """100000000, 0.0000001, 2.5: a number as a person writes it, never in exponent form."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return format(Decimal(repr(value)), "f") if isinstance(value, float) else str(value)


def _closest_key(key: str, model: type[BaseModel] | None, renamed: Mapping[str, str]) -> str | None:
    """The known dotted key (or an old name's new place) closest to the unknown `key`: the same
    name in another section ("inner.top_k": outer.top_k; "lr": inner.lr or outer.lr), else the
    closest spelling, if one is close; None otherwise."""
    known = _dotted_keys(model)
    leaf = key.rsplit(".", 1)[-1]
    same_name = [k for k in known if k.rsplit(".", 1)[-1] == leaf and k != key]
    if same_name:
        return " or ".join(same_name[:3])
    candidates = {k: k for k in known}
    candidates.update({old: new for old, new in renamed.items() if old not in candidates})
    matches = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.75)
    return candidates[matches[0]] if matches else None


def _dotted_keys(model: type[BaseModel] | None, prefix: str = "") -> list[str]:
    """Every key of `model` and of its sections, dotted ("inner", "inner.steps", ...); a section
    that is a union of models (the deadline policies) gets the keys of each."""
    keys: list[str] = []
    for name, field in model.model_fields.items() if model is not None else ():
        keys.append(prefix + name)
        for section in _models_in(field.annotation):
            keys += [k for k in _dotted_keys(section, f"{prefix}{name}.") if k not in keys]
    return keys


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds: itself, or the members of a union (through Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _known_keys(model: type[BaseModel] | None, path: list[str]) -> list[str]:
    """The field names of the (sub)model at `path`; none where the path leaves plain models."""
    for name in path:
        field = model.model_fields.get(name) if model is not None else None
        annotation = field.annotation if field is not None else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return list(model.model_fields) if model is not None else []
