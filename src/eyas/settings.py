"""One declaration per setting: each stage's settings are the fields of one dataclass.

A field made with :func:`setting` carries everything about that setting: its type (the annotation;
``Literal[...]`` where its values are a fixed set), its one default, its help text, its allowed
range, and, only where the flag is not simply ``--field-name``, its CLI spelling. From those fields

- :func:`command` generates the stage's typer command (``eyas <stage> --help`` lists them all);
- :mod:`eyas.config` checks the pipeline's YAML section against the same fields;
- ``__post_init__`` (:func:`eyas.checks.check_dataclass`) checks types, ranges and values on
  construction, whichever way the settings came in (CLI, YAML or Python), before any model loads.

typer stays the CLI library (its parsing, help and errors are what users, scripts and tests know);
this module is the generic bridge from a dataclass to a typer command, written once.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import types
import typing
from typing import Any, Callable

MISSING = dataclasses.MISSING


def setting(
    default: Any = MISSING,
    help: str = "",
    *flags: str,
    check: Any = None,
    parse: Callable[[Any], Any] | None = None,
    cli_type: Any = None,
    cli: bool = True,
    factory: Callable[[], Any] | None = None,
    aliases: dict[str, Any] | None = None,
) -> Any:
    """A dataclass field with its help, range and CLI spelling.

    ``flags``: typer's declarations where the flag is not ``--field-name`` (``"--heldout"``,
    ``"-k", "--num-speculative-tokens"``, ``"--progress/--quiet"``); ``check``: an
    :class:`eyas.checks.Range`; ``parse``: turns the CLI's text into the field's value (``cli_type``
    is then what typer reads, usually ``str``); ``cli=False``: not on the command line (set by the
    caller, e.g. the pipeline); ``aliases``: on/off flags that are short for one value of this
    setting (``{"--online": "online"}``: ``--online`` is ``--features online``), declared here and
    nowhere else. A list or dict default is copied per instance."""
    md = {
        "help": help,
        "flags": flags,
        "check": check,
        "parse": parse,
        "cli_type": cli_type,
        "cli": cli,
        "aliases": dict(aliases or {}),
    }
    if factory is None and isinstance(default, (list, dict)):

        def copy_of_default(d: Any = default) -> Any:  # bound here: each setting copies its own default
            return copy.deepcopy(d)

        factory = copy_of_default
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=md)
    return dataclasses.field(default=default, metadata=md)


def default_of(f: dataclasses.Field) -> Any:
    """A field's default value (MISSING when it is required)."""
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def flag(cls: type, name: str) -> str:
    """How the CLI spells field ``name`` of ``cls`` in messages: its first declared flag (``--heldout``,
    ``-k``), else ``--field-name``."""
    f = {f.name: f for f in dataclasses.fields(cls)}.get(name)
    decls = f.metadata.get("flags") if f is not None else None
    return decls[0].split("/")[0] if decls else "--" + name.replace("_", "-")


def nested_class(tp: Any) -> type | None:
    """The dataclass inside ``tp`` (``X`` or ``X | None``), or None."""
    for a in (tp, *typing.get_args(tp)):
        if isinstance(a, type) and dataclasses.is_dataclass(a):
            return a
    return None


def _option(f: dataclasses.Field, tp: Any, positional: bool, required: bool) -> inspect.Parameter:
    import typer

    md = f.metadata
    annotation = md.get("cli_type") or tp
    default = default_of(f)
    if default is MISSING:
        default = ... if required else None
    elif (
        md.get("parse") is not None
        and md.get("cli_type") is not None
        and default is not None
        and not isinstance(default, str)
    ):
        default = None  # the CLI text of a parsed setting; None means "the field's default"
    if default is None and not _optional(annotation):
        annotation = annotation | None
    help_ = _literal(md.get("help") or "")
    # spelled out, not left to typer: a nested field's parameter is named "<outer>__<field>"
    name = "--" + f.name.replace("_", "-")
    decls = md.get("flags") or ((f"{name}/--no-{name[2:]}",) if tp is bool else (name,))
    info = (
        typer.Argument(default, help=help_, show_default=default is not None)
        if positional
        else typer.Option(default, *decls, help=help_)
    )
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)


def _literal(text: str) -> str:
    """Help text as written: typer renders help as rich markup, where "[tokens, vocab]" is a tag."""
    from rich.markup import escape

    return escape(text)


def _optional(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def command(
    app: Any,
    name: str,
    cls: type,
    run: Callable[..., Any],
    *,
    positional: tuple[str, ...] = (),
    loose: tuple[str, ...] = (),
    extra: dict[str, tuple[Any, Any]] | None = None,
    missing: str = "",
    intercept: Callable[..., bool] | None = None,
    doc: str | None = None,
) -> None:
    """Add ``eyas <name>``: one option per field of ``cls`` (a field holding a dataclass, such as
    ``PrepareOptions.regenerate``, becomes an on/off flag plus that dataclass's own options), then
    ``run(cls(**values))``.

    ``positional``: fields read as arguments; ``loose``: required fields the command lets through
    empty until ``intercept`` has run, then refuse with ``missing``; ``extra``: CLI-only parameters
    (name -> (annotation, typer.Option(...))) handed to ``intercept`` as keywords; ``intercept(**extras)``
    runs first and, returning True, ends the command there (``eyas extract --verify STORE``)."""
    hints = typing.get_type_hints(cls)
    params: list[inspect.Parameter] = []
    nested: dict[str, tuple[type, list[str]]] = {}
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        inner = nested_class(hints[f.name])
        if inner is not None:
            import typer

            params.append(
                inspect.Parameter(
                    f.name,
                    inspect.Parameter.KEYWORD_ONLY,
                    annotation=bool,
                    default=typer.Option(False, *(f.metadata.get("flags") or ()), help=f.metadata.get("help", "")),
                )
            )
            inner_hints = typing.get_type_hints(inner)
            names = []
            for g in dataclasses.fields(inner):
                if g.metadata.get("cli", True):
                    p = _option(g, inner_hints[g.name], False, True)
                    params.append(p.replace(name=f"{f.name}__{g.name}"))
                    names.append(g.name)
            nested[f.name] = (inner, names)
            continue
        params.append(_option(f, hints[f.name], f.name in positional, f.name not in loose))
        params += _alias_options(cls, f)
    for pname, (annotation, info) in (extra or {}).items():
        params.append(inspect.Parameter(pname, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation))
    # typer orders arguments by position in the signature: put them first
    params.sort(key=lambda p: p.name not in positional)
    by_name = {f.name: f for f in dataclasses.fields(cls)}

    def callback(**given: Any) -> Any:
        extras = {k: given.pop(k) for k in list(given) if k in (extra or {})}
        _apply_aliases(cls, given)
        if intercept is not None and intercept(**extras):
            return None
        if any(given.get(k) is None for k in loose):
            from eyas.errors import EyasError

            raise EyasError(missing or f"eyas {name} needs " + " and ".join(flag(cls, k) for k in loose))
        values: dict[str, Any] = {}
        for fname, (inner, names) in nested.items():
            sub = {g: given.pop(f"{fname}__{g}") for g in names}
            on = given.pop(fname)
            values[fname] = inner(**_parsed(inner, sub)) if on else None
        values.update(_parsed(cls, {k: v for k, v in given.items() if k in by_name}))
        return run(cls(**values))

    callback.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    callback.__annotations__ = {}
    callback.__doc__ = _literal(doc or (run.__doc__ or "").strip().split("\n\n")[0])
    callback.__name__ = name.replace("-", "_")
    app.command(name)(callback)


def _alias_name(field: str, value: Any) -> str:
    return f"{field}__is__{value}"


def _alias_options(cls: type, f: dataclasses.Field) -> list[inspect.Parameter]:
    """One on/off option per alias of field ``f``; its help names the setting it is short for."""
    import typer

    return [
        inspect.Parameter(
            _alias_name(f.name, value),
            inspect.Parameter.KEYWORD_ONLY,
            annotation=bool,
            default=typer.Option(False, alias, help=f"Short for {flag(cls, f.name)} {value}."),
        )
        for alias, value in f.metadata.get("aliases", {}).items()
    ]


def _apply_aliases(cls: type, given: dict[str, Any]) -> None:
    """Turn the aliases given on the command line into their setting's value, in ``given``; an alias
    that contradicts the setting given beside it is refused."""
    for f in dataclasses.fields(cls):
        for alias, value in f.metadata.get("aliases", {}).items():
            if not given.pop(_alias_name(f.name, value), False):
                continue
            if given.get(f.name) not in (None, value):
                from eyas.errors import EyasError

                raise EyasError(
                    f"{alias} is short for {flag(cls, f.name)} {value}; it does not go with "
                    f"{flag(cls, f.name)} {given[f.name]}: pass one of them"
                )
            given[f.name] = value


def to_json(obj: Any) -> str:
    """A settings dataclass as JSON, which :func:`from_json` reads back into an equal one (paths and
    tuples as text and lists: the class's own checks turn them back)."""
    return json.dumps(dataclasses.asdict(obj), default=str)


def from_json(cls: type, text: str) -> Any:
    """The ``cls`` that :func:`to_json` wrote."""
    return from_values(cls, json.loads(text))


def from_values(cls: type, values: dict[str, Any]) -> Any:
    """``cls`` from plain values (a YAML section, JSON). A field that holds a dataclass takes a
    mapping of its fields, ``true`` for its defaults, or ``false``/null for none; every other value
    is the class's own to check and convert (``__post_init__``: text to a path, a list to a tuple)."""
    hints = typing.get_type_hints(cls)
    out = dict(values)
    for key, value in values.items():
        inner = nested_class(hints.get(key))
        if inner is not None:
            out[key] = (
                inner(**value)
                if isinstance(value, dict)
                else inner()
                if value is True
                else None
                if value in (False, None)
                else value
            )
    return cls(**out)


def _parsed(cls: type, given: dict[str, Any]) -> dict[str, Any]:
    """CLI values -> field values: ``parse`` where a field declares one; None where the CLI left a
    required-but-loose or parsed setting out, so that the field's own default applies."""
    out = {}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k, v in given.items():
        f = fields[k]
        parse = f.metadata.get("parse")
        if v is None and default_of(f) is not None:
            continue  # left out: the dataclass's default (or its "missing" error)
        out[k] = parse(v) if parse is not None else v
    return out
