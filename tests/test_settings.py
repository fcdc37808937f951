"""One declaration per setting: each stage's CLI and its YAML section come from one dataclass."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest
import typer
from typer.testing import CliRunner

from eyas.config import STAGES, WIRED, stage_settings, validate
from eyas.errors import EyasError
from eyas.settings import command, flag, nested_class
from eyas.train.config import TrainConfig

COMMANDS = {"prepare": "prepare", "extract": "extract", "train": "train", "export": "export", "evaluate": "evaluate"}


def _help(stage: str) -> str:
    from eyas.cli import app

    res = CliRunner().invoke(app, [stage, "--help"], env={"COLUMNS": "250"}, terminal_width=250)
    assert res.exit_code == 0, res.output
    return res.output


def _fields(cls: type) -> list[tuple[type, dataclasses.Field]]:
    """(class, field) of ``cls`` and of the dataclasses its fields hold (prepare's regenerate)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        out.append((cls, f))
        inner = nested_class(hints[f.name])
        if inner is not None:
            out += [(inner, g) for g in dataclasses.fields(inner)]
    return out


@pytest.mark.parametrize("stage", list(COMMANDS))
def test_every_setting_is_an_option_with_help(stage):
    """`eyas <stage> --help` lists every field of the stage's dataclass under its flag, with the
    field's own help text."""
    text = re.sub(r"\s+", " ", re.sub(r"[│╭╮╰╯─]", " ", _help(stage)))
    for cls, f in _fields(stage_settings(stage)):
        if not f.metadata.get("cli", True):
            continue
        assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"
        spelled = f.name if (stage, f.name) == ("export", "ckpt") else flag(cls, f.name)  # the one argument
        assert re.search(rf"(^|\s){re.escape(spelled)}(\s|,|$)", text), f"{spelled} missing from {stage} --help"
        assert " ".join(f.metadata["help"].split()[:4]) in text, f"{cls.__name__}.{f.name}'s help"


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_yaml_section_takes_exactly_the_dataclass_fields(stage):
    cls = stage_settings(stage)
    names = {f.name for f in dataclasses.fields(cls)}
    assert WIRED[stage] <= names
    for key in names - WIRED[stage]:  # every field is a key: an unknown one would be refused
        try:
            validate({"target": "x", stage: {key: None}}, "t.yaml")
        except EyasError as e:
            assert "unknown keys" not in str(e), (stage, key, e)
    with pytest.raises(EyasError, match=r"unknown keys \['no_such_setting'\]"):
        validate({"target": "x", stage: {"no_such_setting": 1}}, "t.yaml")


def _parse(*args: str) -> TrainConfig:
    got = []
    app = typer.Typer()
    command(app, "train", TrainConfig, got.append)
    app.command("noop")(lambda: None)
    res = CliRunner().invoke(app, ["train", *args])
    assert res.exit_code == 0, (res.output, res.exception)
    return got[0]


def test_cli_defaults_are_the_dataclass_defaults_and_flags_keep_their_names():
    assert _parse("--data", "d", "--out", "o") == TrainConfig(data="d", out="o")
    cfg = _parse(
        "--data",
        "d",
        "--out",
        "o",
        "--heldout",
        "0.1",
        "--draft-config",
        "intermediate_size=80",
        "--layers",
        "1,4,6",
        "--betas",
        "0.8",
        "0.9",
        "--keep-checkpoints",
        "5",
        "--min-lr-ratio",
        "0.2",
        "--no-compile",
        "--fused-loss",
        "--online",
        "--quiet",
        "--ttt-steps",
        "3",
    )
    assert (cfg.heldout, cfg.draft_config, cfg.layers, cfg.betas, cfg.keep_checkpoints, cfg.min_lr_ratio) == (
        0.1,
        {"intermediate_size": 80},
        [1, 4, 6],
        (0.8, 0.9),
        5,
        0.2,
    )
    assert (cfg.compile, cfg.fused_loss, cfg.features, cfg.progress, cfg.ttt_steps) == (False, True, "online", False, 3)
    # unset: decided by the device (on for CUDA, off on the CPU); the CPU job is unchanged
    assert TrainConfig(data="d", out="o").compile is None and TrainConfig(data="d", out="o").fused_loss is None


@pytest.mark.parametrize(
    "kw, flagname",
    [
        ({"compile_scope": "regions"}, "--compile-scope regions"),
        ({"compile_mode": "reduce-overhead"}, "--compile-mode reduce-overhead"),
        ({"draft_config": {"fc_norm": True}}, "--draft-config fc_norm=true"),
    ],
)
def test_settings_that_measured_no_gain_need_experimental(kw, flagname):
    with pytest.raises(EyasError, match=rf"{re.escape(flagname)}.*measured no gain.*--experimental"):
        TrainConfig(data="d", out="o", **kw)
    TrainConfig(data="d", out="o", experimental=True, **kw)  # allowed with the switch


def _choice_settings(wired: bool = False) -> list[tuple[str, str, str, tuple]]:
    """(stage, YAML key, flag, allowed values) of every setting declared with ``Literal[...]`` (also
    those the pipeline wires itself, which are no YAML keys, with ``wired``)."""
    from eyas.checks import choices

    out = []
    for stage in STAGES:
        cls = stage_settings(stage)
        for owner, f in _fields(cls):
            allowed = choices(typing.get_type_hints(owner)[f.name])
            if allowed and (wired or owner is not cls or f.name not in WIRED[stage]):
                key = f.name if owner is cls else f"regenerate.{f.name}"
                out.append((stage, key, flag(owner, f.name), allowed))
    return out


def test_the_settings_with_a_fixed_set_of_values_are_declared_so():
    """The settings whose values are a fixed set carry it in their annotation (one list, eyas.checks)."""
    declared = {(s, k) for s, k, _, _ in _choice_settings(wired=True)}
    assert {
        ("train", k)
        for k in (
            "features",
            "schedule",
            "precision",
            "compile_scope",
            "compile_mode",
            "optimizer",
            "parallel",
            "attention",
        )
    } <= declared
    assert {
        ("evaluate", "engine"),
        ("evaluate", "dtype"),
        ("export", "format"),
        ("export", "dtype"),
        ("extract", "backend"),
        ("extract", "dtype"),
        ("extract", "model_dtype"),
        ("prepare", "regenerate.backend"),
        ("prepare", "regenerate.dtype"),
    } <= declared


@pytest.mark.parametrize(
    "stage, key, flagname, allowed", _choice_settings(), ids=[f"{s}.{k}" for s, k, _, _ in _choice_settings()]
)
def test_a_value_outside_a_settings_choices_is_refused_at_load_and_on_the_cli(stage, key, flagname, allowed):
    """The YAML, the CLI and the constructor refuse the same values, naming the allowed ones."""
    listed = ", ".join(map(repr, allowed))
    with pytest.raises(
        EyasError, match=re.escape(f"t.yaml: {stage}.{key} = 'nope' is not one of {listed}; choose one of them")
    ):
        validate({"target": "x", stage: _nested(key, "nope")}, "t.yaml")
    validate({"target": "x", stage: _nested(key, allowed[0])}, "t.yaml")  # each allowed value loads
    validate({"target": "x", stage: _nested(key, allowed[-1])}, "t.yaml")
    from eyas.cli import app

    args = [stage, "--regenerate"] if key.startswith("regenerate.") else [stage]
    res = CliRunner().invoke(app, [*args, flagname, "nope"], terminal_width=250)
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", res.output).split())
    assert res.exit_code == 2 and f"'nope' is not one of {listed}" in text, text
    assert f"<{'|'.join(allowed)}>" in " ".join(_help(stage).split())  # --help lists them


def _nested(key: str, value: object) -> dict:
    head, _, rest = key.partition(".")
    return {head: _nested(rest, value) if rest else value}


def test_the_tables_keyed_by_a_settings_values_cover_exactly_them():
    """Where code keeps a table per value (extract's backends, the stores' dtypes), its keys are the
    declared values: a value added to one is added to the other."""
    from eyas.extract.config import Backend, ModelDtype, StoreDtype
    from eyas.extract.run import BACKENDS
    from eyas.features.format import FLOAT_DTYPES, FP8, STORE_DTYPES

    assert set(BACKENDS) | {"auto"} == set(typing.get_args(Backend))
    assert set(FLOAT_DTYPES) == set(typing.get_args(ModelDtype))
    assert set(STORE_DTYPES) == set(typing.get_args(StoreDtype)) == {*FLOAT_DTYPES, FP8}
