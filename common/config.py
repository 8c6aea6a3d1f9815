"""One way to configure every part: frozen dataclasses filled from a YAML file, KVHARBOR_* env, flags.

A part's root config is a frozen dataclass whose fields are sub-config dataclasses. Their leaf
fields have globally unique names, and each leaf is reachable under the same name everywhere:

    flag  --max-num-seqs 32     env  KVHARBOR_MAX_NUM_SEQS=32     YAML  max_num_seqs: 32

Precedence, lowest first: defaults, the YAML file, the environment, flags and explicit overrides.
The loaded config is never mutated; values computed at run time live in runtime objects.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

ENV_PREFIX = "KVHARBOR_"
T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message says which source and what to do."""


def opt(default: Any, help: str, **kwargs: Any) -> Any:
    """A config field with its help text (shown by --help on every command)."""
    return dataclasses.field(default=default, metadata={"help": help, **kwargs})


@dataclasses.dataclass(frozen=True)
class Leaf:
    name: str  # snake_case, unique across the config tree
    path: tuple[str, ...]  # attribute path from the root, e.g. ("cache", "block_size")
    type: Any
    default: Any
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


def leaves(cls: type) -> list[Leaf]:
    """Every leaf field of a (nested) config dataclass; raises if two leaves share a name."""
    found: list[Leaf] = []
    _collect(cls, (), found)
    seen: dict[str, Leaf] = {}
    for leaf in found:
        if leaf.name in seen:
            raise TypeError(f"config leaf {leaf.name!r} appears twice: {seen[leaf.name].path} and {leaf.path}")
        seen[leaf.name] = leaf
    return found


def _collect(cls: type, prefix: tuple[str, ...], out: list[Leaf]) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            _collect(tp, (*prefix, f.name), out)
            continue
        out.append(Leaf(f.name, (*prefix, f.name), tp, f.default, f.metadata.get("help", "")))


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def coerce(leaf: Leaf, value: Any, source: str) -> Any:
    """Convert `value` (from YAML, env or a flag) to the leaf's type, or raise ConfigError."""
    tp, optional = _unwrap_optional(leaf.type)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null", "")):
        if optional:
            return None
        raise ConfigError(f"{leaf.name} from {source}: a value is required")
    try:
        if typing.get_origin(tp) is Literal:
            choices = typing.get_args(tp)
            if value not in choices:
                raise ValueError(f"must be one of {', '.join(map(str, choices))}")
            return value
        if tp is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text in _TRUE | _FALSE:
                return text in _TRUE
            raise ValueError("must be true or false")
        if tp is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("must be an integer")
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
        if _is_str_list(tp):
            return _str_list(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{leaf.name}={value!r} from {source}: {exc}") from None
    raise TypeError(f"config leaf {leaf.name} has unsupported type {tp!r}")


def _is_str_list(tp: Any) -> bool:
    return typing.get_origin(tp) is tuple and typing.get_args(tp) == (str, Ellipsis)


def _str_list(value: Any) -> tuple[str, ...]:
    """A list leaf: a YAML list, a repeated flag, or comma-separated text (the environment)."""
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        raise ValueError("must be a list of strings (comma-separated in the environment)")
    if not all(isinstance(v, str) for v in items):
        raise ValueError("must be a list of strings")
    return tuple(v.strip() for v in items if v.strip())


def add_arguments(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per config leaf. Flags default to 'not given', so lower sources still apply."""
    for leaf in leaves(cls):
        if leaf.name in skip:
            continue
        tp, _ = _unwrap_optional(leaf.type)
        shown = "" if leaf.default in (None, ()) else f" (default: {leaf.default})"
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "dest": leaf.name}
        if typing.get_origin(tp) is Literal:
            kwargs["choices"] = typing.get_args(tp)
        help_text = f"{leaf.help}{shown} [env {leaf.env}]".replace("%", "%%")  # argparse formats help with %
        if tp is bool:
            parser.add_argument(leaf.flag, action=argparse.BooleanOptionalAction, help=help_text, **kwargs)
        elif _is_str_list(tp):
            parser.add_argument(leaf.flag, action="append", metavar=leaf.name.upper(), help=help_text + " (repeatable)",
                                **kwargs)  # fmt: skip
        else:
            parser.add_argument(leaf.flag, metavar=leaf.name.upper(), help=help_text, **kwargs)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A flat mapping of config names from a YAML file (dashes or underscores in keys)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of option names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def load_config(
    cls: type[T],
    *,
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Build a frozen `cls` from defaults < YAML `file` < `env` (KVHARBOR_*) < `overrides`.

    Unknown names in the file or in overrides raise ConfigError with the closest valid name.
    """
    by_name = {leaf.name: leaf for leaf in leaves(cls)}
    values: dict[str, Any] = {}
    env = os.environ if env is None else env
    file = file or env.get(ENV_PREFIX + "CONFIG")
    sources: list[tuple[str, Mapping[str, Any]]] = []
    if file:
        sources.append((f"config file {file}", read_yaml(file)))
    sources.append(("the environment", {n: env[leaf.env] for n, leaf in by_name.items() if leaf.env in env}))
    sources.append(("flags", dict(overrides or {})))
    for source, mapping in sources:
        for name, value in mapping.items():
            leaf = by_name.get(name)
            if leaf is None:
                raise ConfigError(_unknown(name, source, by_name))
            values[name] = coerce(leaf, value, source)
    return _build(cls, values)


def _unknown(name: str, source: str, by_name: Mapping[str, Leaf]) -> str:
    close = difflib.get_close_matches(name, list(by_name), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid names: {', '.join(sorted(by_name))}"
    return f"unknown option {name!r} in {source}{hint}"


def _build(cls: type[T], values: Mapping[str, Any]) -> T:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_bytes(text: str | int) -> int:
    """'2GiB' -> 2147483648, '500MB' -> 500000000, 1024 -> 1024. Raises ValueError otherwise."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 2GiB, 512MiB or 1000000")
    number, unit = float(m.group(1)), (m.group(2) or "").upper()
    if "I" in unit:
        scale = 1024 ** ("KMGT".index(unit[0]) + 1)
    else:
        scale = _UNITS[unit.rstrip("B") or unit]
    return int(number * scale)


def config_from_argv(cls: type[T], argv: list[str], prog: str, description: str) -> T:
    """A command's config from its argv: --help, --version and --config FILE, one flag per leaf, then
    load_config. Exits with argparse's usage error (status 2) on bad values."""
    from kvharbor.common import __version__

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=f"kvharbor {__version__}")
    parser.add_argument("--config", metavar="FILE", help="YAML file of options [env KVHARBOR_CONFIG]")
    add_arguments(parser, cls)
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k not in ("config", "version")}
    try:
        return load_config(cls, file=args.config, overrides=overrides)
    except ConfigError as exc:
        parser.error(str(exc))
