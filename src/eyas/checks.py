"""Typed, range-checked settings, the same for YAML configs, CLI flags and the Python API.

Every stage's settings are the fields of a dataclass (``PrepareOptions``, ``TrainConfig``) or the
keyword arguments of a function (``run_extract``, ``export_checkpoint``, ``evaluate_draft``). Their
annotations give the type; :data:`RANGES` gives the allowed range of each number. :func:`check_values`
checks a mapping of them (a config section) and returns it with numbers YAML left as strings
(``lr: 1e-4``) read as numbers; :func:`check_dataclass` and :func:`checked` apply the same checks
where the settings are constructed, before any model loads.
"""

from __future__ import annotations

import dataclasses
import functools
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
    what: str = ""        # what the value means, for the message
    hint: str = ""        # what to do instead

    def problem(self, v: float) -> str | None:
        if isinstance(v, float) and math.isnan(v):
            return "is not a number"
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return f"must be {'>' if self.lo_open else '>='} {_num(self.lo)}"
        if self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)):
            return f"must be {'<' if self.hi_open else '<='} {_num(self.hi)}"
        return None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _min(n: float, what: str = "", hint: str = "") -> Range:
    return Range(lo=n, what=what, hint=hint)


def _pos(what: str = "", hint: str = "") -> Range:
    return Range(lo=0, lo_open=True, what=what, hint=hint)


def _frac(what: str = "", hi_open: bool = False) -> Range:
    return Range(lo=0, hi=1, hi_open=hi_open, what=what)


# section -> field -> allowed range (None values are always allowed where the type says Optional).
RANGES: dict[str, dict[str, Range]] = {
    "prepare": {
        "max_samples": _min(1, "conversations taken"),
        "max_length": _min(2, "tokens per sample"),
        "draft_vocab_size": _min(1, "tokens in the draft vocabulary"),
        "workers": _min(0, "tokenizer processes", "0 picks automatically"),
        "chunk_size": _min(1, "records per shard"),
    },
    "regenerate": {
        "temperature": _min(0, "sampling temperature", "0 is greedy"),
        "top_p": Range(lo=0, hi=1, lo_open=True, what="nucleus sampling mass"),
        "max_new_tokens": _min(1, "answer length limit"),
        "seed": _min(0),
        "batch_size": _min(1, "prompts per batch"),
        "max_turns": _min(0, "assistant turns answered", "0 answers all"),
    },
    "extract": {
        "batch_tokens": _min(1, "padded tokens per batch", "leave it out (0 on the CLI) for auto"),
        "writers": _min(1, "shard writer threads", "leave it out (0 on the CLI) for auto"),
        "tensor_parallel_size": _min(1),
        "data_parallel_size": _min(1),
        "self_check": _min(0, "samples checked against hf on an untested vLLM", "0 skips the check"),
    },
    "train": {
        "ttt_steps": _min(1, "training-time-test steps unrolled", "use 1 for plain next-token training"),
        "step_decay": _pos("loss weight ratio between TTT steps", "e.g. 0.8"),
        "lr": _pos("peak learning rate", "e.g. 1e-4"),
        "min_lr_ratio": _frac("final LR as a fraction of the peak"),
        "weight_decay": _min(0),
        "epochs": _min(1),
        "max_steps": _min(1, "optimizer steps", "leave it out to run --epochs"),
        "max_train_seconds": _pos("training time budget"),
        # a pack of fewer than 3 tokens has no position with both an input and a next-token target
        # left after the shift, and the first backward fails
        "tokens_per_batch": _min(3, "tokens per pack", "use at least the dataset's max_length, e.g. 2048"),
        "batch_size": _min(1, "packs per micro-batch"),
        "grad_accum": _min(1, "micro-batches per optimizer step"),
        "warmup": _min(0, "warmup steps"),
        "clip": _min(0, "gradient-norm clip", "0 turns clipping off"),
        "save_every": _min(0, "steps between checkpoints", "0 saves only at the end"),
        "keep_checkpoints": _min(0, "checkpoints kept", "0 keeps all"),
        "eval_every": _min(0, "steps between held-out evaluations", "0 evaluates only at the end"),
        "eval_batches": _min(1, "held-out micro-batches per evaluation"),
        "heldout_fraction": _frac("fraction of samples held out", hi_open=True),
        "log_every": _min(1, "steps between training records"),
        "seed": _min(0),
        "loss_chunk": _min(1, "rows per chunk of the fused loss"),
    },
    "export": {
        "num_speculative_tokens": _min(1, "draft tokens per step recorded"),
    },
    "evaluate": {
        "k": _min(1, "draft tokens per step"),
        "temperature": _min(0, "sampling temperature", "0 is greedy"),
        "max_prompts": _min(1, "questions used", "leave it out to use all"),
        "max_new_tokens": _min(1, "tokens generated per turn", "e.g. 256"),
        "max_per_category": _min(1, "questions per category", "leave it out to use all"),
        "seed": _min(0),
    },
}

# The CLI spelling of fields whose flag is not just --field-name.
FLAGS: dict[str, dict[str, str]] = {
    "train": {"heldout_fraction": "--heldout", "draft_overrides": "--draft-config"},
    "evaluate": {"k": "-k", "compare_plain": "--no-plain"},
    "export": {"fmt": "--format", "num_speculative_tokens": "-k"},
    "regenerate": {"batch_size": "--gen-batch-size", "backend": "--gen-backend", "dtype": "--gen-dtype"},
}


def flag(section: str, key: str) -> str:
    return FLAGS.get(section, {}).get(key, "--" + key.replace("_", "-"))


class _Mismatch(Exception):
    pass


def describe(tp: Any) -> str:
    """A type as a user reads it: 'a number', 'an integer', 'a list of integers', ..."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
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
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value.strip())
            except ValueError:
                raise _Mismatch from None
            if f.is_integer():
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


def check_values(section: str, values: Mapping[str, Any], types_: Mapping[str, Any],
                 name: Callable[[str], str], sep: str = " = ") -> dict[str, Any]:
    """Type-check and range-check ``values``; returns them coerced. ``name(key)`` spells a key in
    messages (``config X: train.lr`` or ``--lr``), ``sep`` goes between it and the value."""
    out = dict(values)
    for key, value in values.items():
        tp = types_.get(key, Any)
        try:
            v = coerce(value, tp)
        except _Mismatch:
            raise EyasError(f"{name(key)}{sep}{value!r} is {_kind(value)}; expected {describe(tp)}") from None
        out[key] = v
        rule = RANGES.get(section, {}).get(key)
        for x in (v if isinstance(v, tuple) else (v,)):
            if rule is None or x is None or isinstance(x, bool) or not isinstance(x, (int, float)):
                continue
            problem = rule.problem(x)
            if problem:
                what = f" ({rule.what})" if rule.what else ""
                hint = f"; {rule.hint}" if rule.hint else ""
                raise EyasError(f"{name(key)}{sep}{value!r}{what} {problem}: change it{hint}")
    if section == "train" and "betas" in out and out["betas"] is not None:
        if not all(0 <= b < 1 for b in out["betas"]):
            raise EyasError(f"{name('betas')}{sep}{values['betas']!r}: each beta must be in [0, 1), e.g. (0.9, 0.95)")
    return out


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping"}.get(type(value), f"a {type(value).__name__}")


def check_dataclass(obj: Any, section: str) -> None:
    """``__post_init__`` helper: check (and coerce in place) every field of ``obj``."""
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    types_ = hints(type(obj))
    types_ = {k: v for k, v in types_.items() if not _is_dataclass_type(v)}
    checked_ = check_values(section, {k: v for k, v in values.items() if k in types_}, types_,
                            lambda k: f"{section}: {flag(section, k)}", sep=" ")
    for k, v in checked_.items():
        if v is not values[k]:
            object.__setattr__(obj, k, v)


def _is_dataclass_type(tp: Any) -> bool:
    return any(dataclasses.is_dataclass(a) for a in (tp, *typing.get_args(tp)) if isinstance(a, type))


def checked(section: str) -> Callable:
    """Decorator: check a stage function's keyword settings on every call, before its body runs."""

    def wrap(fn: Callable) -> Callable:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            types_ = hints(fn)
            types_.pop("return", None)
            given = check_values(section, dict(bound.arguments), types_,
                                 lambda k: f"{section}: {flag(section, k)}", sep=" ")
            bound.arguments.update(given)
            return fn(*bound.args, **bound.kwargs)

        return inner

    return wrap
