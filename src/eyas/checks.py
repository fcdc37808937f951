"""Typed, range-checked settings, the same for YAML configs, CLI flags and the Python API.

Every stage's settings are the fields of one dataclass (:mod:`eyas.settings`). Their annotations
give the type, and a setting with a fixed set of values declares them there (``Literal["ddp",
"fsdp2"]``); each field's ``check`` (a :class:`Range`) gives the allowed range of a number.
:func:`check_values` checks a mapping of them (a config section) and returns it with numbers YAML
left as strings (``lr: 1e-4``) read as numbers; :func:`check_dataclass` applies the same checks
where the settings are constructed, before any model loads.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types
import typing
from pathlib import Path
from typing import Any, Callable, Mapping

from eyas.errors import EyasError


@dataclasses.dataclass(frozen=True)
class Range:
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is not allowed
    hi_open: bool = False
    what: str = ""  # what the value means, for the message
    hint: str = ""  # what to do instead

    def problem(self, v: float) -> str | None:
        if isinstance(v, float) and math.isnan(v):
            return "is not a number"
        if isinstance(v, float) and math.isinf(v):
            return "is not finite"
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return f"must be {'>' if self.lo_open else '>='} {_num(self.lo)}"
        if self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)):
            return f"must be {'<' if self.hi_open else '<='} {_num(self.hi)}"
        return None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def at_least(n: float, what: str = "", hint: str = "") -> Range:
    return Range(lo=n, what=what, hint=hint)


def positive(what: str = "", hint: str = "") -> Range:
    return Range(lo=0, lo_open=True, what=what, hint=hint)


def fraction(what: str = "", hi_open: bool = False) -> Range:
    return Range(lo=0, hi=1, hi_open=hi_open, what=what)


_UNITS = {"s": 1, "m": 60, "h": 3600}


def seconds(text: Any) -> float | None:
    """A duration as seconds: a number (seconds) or a text such as ``90s``, ``10m``, ``1h30m``."""
    import re

    if text is None or (isinstance(text, (int, float)) and not isinstance(text, bool)):
        return None if text is None else float(text)
    s = str(text).strip().lower().replace(" ", "")
    try:
        return float(s)
    except ValueError:
        pass
    parts = re.findall(r"(\d+(?:\.\d*)?)([smh])", s)
    if not parts or "".join(n + u for n, u in parts) != s:
        raise EyasError(f"duration {text!r}: expected seconds or a number with a unit, e.g. 90s, 10m, 1h30m")
    return float(sum(float(n) * _UNITS[u] for n, u in parts))


def int_list(flag: str, example: str) -> Callable[[Any], list[int]]:
    """The parser of ``flag``'s comma-separated integers (a YAML list passes as it is)."""

    def parse(text: str | list[int] | None) -> list[int]:
        if text is None or isinstance(text, list):
            return list(text or [])
        try:
            return [int(x) for x in text.split(",") if x.strip()]
        except ValueError as e:
            raise EyasError(f"{flag} {text!r}: expected comma-separated integers, e.g. {example}") from e

    return parse


def key_values(flag: str, example: str) -> Callable[[Any], dict[str, Any]]:
    """The parser of ``flag``'s ``key=value`` pairs separated by commas, each value read as a bool,
    int or float where it is one, else kept as text (a YAML mapping passes as it is)."""

    def parse(text: str | dict[str, Any] | None) -> dict[str, Any]:
        if text is None or isinstance(text, dict):
            return dict(text or {})
        out: dict[str, Any] = {}
        for part in text.split(","):
            if not part.strip():
                continue
            if "=" not in part:
                raise EyasError(f"{flag} {text!r}: expected key=value pairs separated by commas, e.g. {example}")
            k, v = (x.strip() for x in part.split("=", 1))
            out[k] = _scalar(v)
        return out

    return parse


def _scalar(v: str) -> Any:
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return v


class _Mismatch(Exception):
    pass


def choices(tp: Any) -> tuple[Any, ...]:
    """The values a ``Literal[...]`` annotation allows (also inside ``Literal[...] | None``); () for
    any other type."""
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return tuple(v for a in typing.get_args(tp) for v in choices(a))
    return ()


def describe(tp: Any) -> str:
    """A type as a user reads it: 'a number', 'an integer', 'a list of integers', ..."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [describe(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" (or null)" if type(None) in args else "")
    if tp is float:
        return "a number"
    if tp is int:
        return "an integer"
    if tp is bool:
        return "true or false"
    if tp is str:
        return "a string"
    if tp is Path:
        return "a path (string)"
    if origin is list:
        return f"a list of {describe(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    if origin is tuple:
        return f"a list of {len(args)} numbers" if args and all(a is float for a in args) else "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any) -> Any:
    """``value`` as type ``tp`` where that is lossless (a numeric string for a number), else _Mismatch."""
    if tp is Any or tp is inspect.Parameter.empty:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:  # one of the declared values, of its type (True is not 1)
        if any(type(value) is type(a) and value == a for a in args):
            return value
        raise _Mismatch
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a)
            except _Mismatch:
                continue
        raise _Mismatch
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value.strip())
            except ValueError:
                raise _Mismatch from None
        raise _Mismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        # an integral float up to 2^53 (exact in a float): 1e30 is no count anyone meant
        if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value.strip())
            except ValueError:
                raise _Mismatch from None
            if f.is_integer() and abs(f) <= 2**53:
                return int(f)
        raise _Mismatch
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, Path):  # a path passed from Python for a path-like string field
            return str(value)
        raise _Mismatch
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise _Mismatch
    if origin is list:
        if isinstance(value, str) and args and args[0] is str:
            return [value]  # `data: sharegpt` means [sharegpt]
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        return [coerce(v, args[0]) for v in value] if args else list(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or (args and args[-1] is not Ellipsis and len(value) != len(args)):
            raise _Mismatch
        return tuple(coerce(v, a) for v, a in zip(value, args)) if args else tuple(value)
    if origin is dict or tp is dict:
        if isinstance(value, dict):
            return value
        raise _Mismatch
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise _Mismatch
    return value


def hints(obj: Any) -> dict[str, Any]:
    """Field/parameter name -> annotation (resolved) of a dataclass or a function."""
    return typing.get_type_hints(obj)


def ranges_of(cls: type) -> dict[str, Range]:
    """Field name -> its declared range (``setting(..., check=...)``)."""
    return {f.name: f.metadata["check"] for f in dataclasses.fields(cls) if f.metadata.get("check")}


def check_values(
    values: Mapping[str, Any],
    types_: Mapping[str, Any],
    ranges: Mapping[str, Range],
    name: Callable[[str], str],
    sep: str = " = ",
) -> dict[str, Any]:
    """Type-check and range-check ``values``; returns them coerced. ``name(key)`` spells a key in
    messages (``config X: train.lr`` or ``--lr``), ``sep`` goes between it and the value."""
    out = dict(values)
    for key, value in values.items():
        tp = types_.get(key, Any)
        try:
            v = coerce(value, tp)
        except _Mismatch:
            allowed = choices(tp)
            if any(type(value) is type(c) for c in allowed):  # the right kind, not one of the values
                raise EyasError(
                    f"{name(key)}{sep}{value!r} is not one of {', '.join(map(repr, allowed))}; choose one of them"
                ) from None
            what = "a number too large to be a count (above 2^53)" if _too_large(value, tp) else _kind(value)
            raise EyasError(f"{name(key)}{sep}{value!r} is {what}; expected {describe(tp)}") from None
        out[key] = v
        rule = ranges.get(key)
        for x in v if isinstance(v, tuple) else (v,):
            if rule is None or x is None or isinstance(x, bool) or not isinstance(x, (int, float)):
                continue
            problem = rule.problem(x)
            if problem:
                what = f" ({rule.what})" if rule.what else ""
                hint = f"; {rule.hint}" if rule.hint else ""
                raise EyasError(f"{name(key)}{sep}{value!r}{what} {problem}: change it{hint}")
    return out


def check_choice(value: Any, tp: Any, name: str) -> Any:
    """``value`` where it is one of the ``Literal`` ``tp``'s values, else the settings' error naming
    ``name`` (a flag): for functions handed a setting's value directly rather than through its
    dataclass (``flex.resolve(attention, ...)``)."""
    return check_values({name: value}, {name: tp}, {}, lambda k: k, sep=" ")[name]


def _too_large(value: Any, tp: Any) -> bool:
    """An integer setting given a number too large to be a count (``max_steps: 1e30``)."""
    if int not in (tp, *typing.get_args(tp)) or isinstance(value, bool):
        return False
    try:
        f = float(value)
    except (TypeError, ValueError):
        return False
    return math.isfinite(f) and abs(f) > 2**53


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
    }.get(type(value), f"a {type(value).__name__}")


def check_dataclass(obj: Any, section: str) -> None:
    """``__post_init__`` helper: check (and coerce in place) every field of ``obj``; a message names
    the setting as the CLI spells it (``train: --heldout 1.0 ...``)."""
    from eyas.settings import flag, nested_class

    cls = type(obj)
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    types_ = {k: v for k, v in hints(cls).items() if nested_class(v) is None}
    checked_ = check_values(
        {k: v for k, v in values.items() if k in types_},
        types_,
        ranges_of(cls),
        lambda k: f"{section}: {flag(cls, k)}",
        sep=" ",
    )
    for k, v in checked_.items():
        if v is not values[k]:
            object.__setattr__(obj, k, v)
