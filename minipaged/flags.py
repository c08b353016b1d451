"""Command-line flags made from ``EngineConfig``'s fields, each with its real type.

Owns turning a dataclass field into one argparse option, and a parsed command line back into
engine keywords. ``minipaged serve`` and ``minipaged bench`` call :func:`add_engine_flags`, so
a new ``EngineConfig`` field is a new flag by itself, typed from its annotation:

- ``bool``: ``--x`` / ``--no-x`` (``argparse.BooleanOptionalAction``); ``--x false`` works too;
- ``bool | None``: the same, and ``--x auto`` for None ("decide for me");
- ``int``, ``float``, ``str`` (and ``| None``, with ``auto`` for None); ``Literal[...]``: its choices;
- ``tuple[T, ...]`` / ``list[T]``: comma-separated values of T;
- ``dict`` (and ``| None``): a JSON object, e.g. ``--speculative-config '{"method": "ngram", ...}'``.

A flag the user does not give is left out, so the engine's own default applies; ``auto`` is
given explicitly as None. An annotation none of these cover raises TypeError when the parser
is built (tests/test_server_loop.py builds both parsers), never a silently untyped flag.
"""
from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Callable

AUTO = "auto"
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); ``X`` -> (X, False)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        if len(args) == 1:
            return args[0], optional
        raise TypeError(f"a union of {args} has no one command-line type")
    return tp, False


def parse_bool(text: str, optional: bool) -> bool | None:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    if optional and t == AUTO:
        return None
    allowed = "true or false" + (", or auto (decide)" if optional else "")
    raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")


class BoolFlag(argparse.BooleanOptionalAction):
    """``--x`` (True), ``--no-x`` (False), and ``--x VALUE`` with VALUE true/false (or auto, for
    a ``bool | None`` field: None)."""

    def __init__(self, option_strings: list[str], dest: str, optional: bool = False, **kw: Any) -> None:
        super().__init__(option_strings, dest, **kw)
        self.nargs = "?"
        self.optional = optional
        self.metavar = "{true,false,auto}" if optional else "{true,false}"

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001 - argparse's signature
        if option_string is not None and option_string.startswith("--no-"):
            if values is not None:
                parser.error(f"{option_string} takes no value (got {values!r}); use {option_string.replace('--no-', '--', 1)} {values}")
            setattr(namespace, self.dest, False)
            return
        if values is None:
            setattr(namespace, self.dest, True)
            return
        try:
            setattr(namespace, self.dest, parse_bool(values, self.optional))
        except argparse.ArgumentTypeError as e:
            parser.error(f"{option_string}: {e}")


def _json_object(text: str) -> dict:
    """A JSON object on the command line, e.g. ``--speculative-config '{"method": "ngram", ...}'``."""
    import json

    value = json.loads(text)  # a JSONDecodeError is a ValueError: reported below as "expected a JSON object"
    if not isinstance(value, dict):
        raise ValueError(text)
    return value


_json_object.__name__ = "a JSON object"


def _scalar(tp: Any, optional: bool, name: str) -> Callable[[str], Any]:
    base = {int: int, float: float, str: str, dict: _json_object}.get(tp)
    if base is None:
        raise TypeError(f"EngineConfig.{name}: no command-line type for {tp!r}")

    def convert(text: str) -> Any:
        if optional and text.strip().lower() == AUTO:
            return None
        try:
            return base(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {base.__name__}" + (" or auto" if optional else "") + f", got {text!r}") from None

    convert.__name__ = base.__name__
    return convert


def flag_spec(name: str, tp: Any, default: Any) -> dict:
    """The ``add_argument`` keywords (besides the flag) for a field ``name: tp = default``."""
    inner, optional = _unwrap_optional(tp)
    shown = AUTO if default is None and optional else default
    if inner is bool:
        return dict(action=BoolFlag, optional=optional, help=f"default {shown}")
    origin = typing.get_origin(inner)
    if origin is typing.Literal:
        choices = list(typing.get_args(inner)) + ([None] if optional else [])

        def pick(text: str) -> Any:
            if optional and text.strip().lower() == AUTO and AUTO not in choices:
                return None
            for c in choices:
                if c is not None and str(c) == text:
                    return c
            raise argparse.ArgumentTypeError(f"choose from {', '.join(map(str, [c for c in choices if c is not None]))}"
                                             + (", auto" if optional else "") + f"; got {text!r}")

        return dict(type=pick, metavar="{" + ",".join(str(c) if c is not None else AUTO for c in choices) + "}",
                    help=f"default {shown}")
    if origin in (tuple, list):
        args = [a for a in typing.get_args(inner) if a is not Ellipsis]
        if len(args) != 1:
            raise TypeError(f"EngineConfig.{name}: no command-line form for {inner!r} (use tuple[T, ...])")
        item = _scalar(args[0], False, name)
        make = tuple if origin is tuple else list

        def seq(text: str) -> Any:
            if optional and text.strip().lower() == AUTO:
                return None
            return make(item(x.strip()) for x in text.split(",") if x.strip())

        return dict(type=seq, metavar=f"{getattr(args[0], '__name__', 'X').upper()},...", help=f"default {shown}")
    conv = _scalar(inner, optional, name)
    metavar = {int: "N", float: "X", str: "S", dict: "JSON"}[inner] + ("|auto" if optional else "")
    return dict(type=conv, metavar=metavar, help=f"default {shown}")


def config_fields() -> list[tuple[str, Any, Any]]:
    """(name, resolved type, default) of every EngineConfig field."""
    from .config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    out = []
    for f in dataclasses.fields(EngineConfig):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        out.append((f.name, hints[f.name], default))
    return out


def option_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_flags(parser: argparse.ArgumentParser, skip: dict[str, str] | None = None,
                     title: str = "engine options (minipaged.config.EngineConfig)") -> argparse._ArgumentGroup:
    """One typed flag per EngineConfig field, except those in ``skip`` (field -> why, for the help)."""
    skip = skip or {}
    g = parser.add_argument_group(title, "; ".join(f"{option_of(k)}: {v}" for k, v in skip.items()) or None)
    for name, tp, default in config_fields():
        if name in skip:
            continue
        g.add_argument(option_of(name), dest=name, default=argparse.SUPPRESS, **flag_spec(name, tp, default))
    return g


def engine_kwargs(args: argparse.Namespace, skip: dict[str, str] | None = None) -> dict[str, Any]:
    """The EngineConfig keywords a parsed command line gives: only the flags that were given."""
    skip = skip or {}
    return {name: getattr(args, name) for name, _, _ in config_fields() if name not in skip and hasattr(args, name)}


__all__ = ["add_engine_flags", "engine_kwargs", "flag_spec", "config_fields", "option_of", "BoolFlag", "parse_bool", "AUTO"]
