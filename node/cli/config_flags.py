"""Command-line flags made from a config model: one per field, its help from the field's description.

    add_config_flags(parser, NodeConfig)                  # `node join` and `doctor`
    config = load_node_config(path, config_overrides(args, NodeConfig))

Every field of the model and of its sections (node/config.py) becomes a flag, in one argument
group per section: `--` and the field's name with dashes (`--uplink-mbps`), unless its
`json_schema_extra["flag"]` spells it otherwise (`--run` for run_id, `--fetch-timeout` for
fetch_timeout_s): the spellings volunteers already use; `json_schema_extra["metavar"]` names the
value in the help. The flag's `dest` is the field's name, unique across the
sections, and `config_overrides` maps it to the dotted key the loader takes ("network.uplink_mbps").

Every flag defaults to None, "not given", so that a flag overrides the file only when passed; the
model applies the real defaults and checks every value, and the help shows the default. The kind
of flag follows the field's type: a bool is `--x`/`--no-x`; an int or a float is parsed as one; a
Literal offers its choices; a tuple of strings takes several values (one at least when the field
needs one), or, with `json_schema_extra["flag_repeats"]`, one value per repetition of the flag;
anything else (strings, paths) is passed as written and checked by the model.

This module imports only the standard library: `locoswarm --help` builds every parser.
"""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any

# The model is a pydantic BaseModel; typed as Any so that importing this module imports nothing.
Model = Any


def add_config_flags(parser: argparse.ArgumentParser, model: Model) -> None:
    """Add a flag for every field of `model` and of its sections (see the module docstring)."""
    for section, fields in _sections(model):
        if section is None:
            group = parser.add_argument_group("which run, as whom (the top level of the file)")
        else:
            group = parser.add_argument_group(f"[{section}]", _one_line(model.model_fields[section].description))
        for name, field in fields.items():
            _add_flag(group, name, field)


def config_overrides(args: argparse.Namespace, model: Model) -> dict[str, Any]:
    """The dotted keys of `model` ("network.uplink_mbps") with the value each flag was given
    (None: not given), for `load_node_config`'s overrides."""
    return {
        (name if section is None else f"{section}.{name}"): getattr(args, name)
        for section, fields in _sections(model)
        for name in fields
    }


def flag_of(name: str, field) -> str:
    """The flag that sets the field `name`: its own spelling, else `--` and the name with dashes."""
    return (field.json_schema_extra or {}).get("flag") or "--" + name.replace("_", "-")


def _sections(model: Model) -> list[tuple[str | None, dict]]:
    """(None, the top-level fields), then (section name, its fields) per section; every field name
    once (they become argparse dests)."""
    top = {name: field for name, field in model.model_fields.items() if not _is_model(field.annotation)}
    sections = [
        (name, field.annotation.model_fields)
        for name, field in model.model_fields.items()
        if _is_model(field.annotation)
    ]
    names = [*top, *(name for _, fields in sections for name in fields)]
    if len(names) != len(set(names)):
        raise TypeError(f"{model.__name__}: a field name is used in two sections; flags need unique names")
    return [(None, top), *sections]


def _add_flag(group, name: str, field) -> None:
    extra = field.json_schema_extra or {}
    kind = _plain_type(field.annotation)
    options: dict[str, Any] = {"dest": name, "default": None, "help": _help(field)}
    if "metavar" in extra:
        options["metavar"] = extra["metavar"]
    if kind is bool:
        options["action"] = argparse.BooleanOptionalAction
    elif kind in (int, float):
        options["type"] = kind
    elif typing.get_origin(kind) is typing.Literal:
        options["choices"] = typing.get_args(kind)
    elif typing.get_origin(kind) is tuple:
        if extra.get("flag_repeats"):
            options["action"] = "append"
        else:
            options["nargs"] = "+" if _min_length(field) >= 1 else "*"
    group.add_argument(flag_of(name, field), **options)


def _help(field) -> str:
    """The field's description, and its default where it has one worth saying."""
    text = field.description or ""
    default = field.default
    if field.is_required() or default is None or default == ():
        return text
    if isinstance(default, bool):
        shown = "on" if default else "off"
    elif isinstance(default, tuple):
        shown = " ".join(map(str, default))
    else:
        shown = str(default) if not isinstance(default, Path) else default.as_posix()
    return f"{text} Default: {shown}."


def _plain_type(annotation):
    """The type under Optional and Annotated: `float | None` -> float, `Annotated[Path, ...]` -> Path."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            kinds = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
            if len(kinds) != 1:
                return annotation
            annotation = kinds[0]
        else:
            return annotation


def _min_length(field) -> int:
    return max((getattr(rule, "min_length", 0) or 0 for rule in field.metadata), default=0)


def _is_model(annotation) -> bool:
    return isinstance(annotation, type) and hasattr(annotation, "model_fields")


def _one_line(text: str | None) -> str | None:
    return " ".join(text.split()) if text else None
