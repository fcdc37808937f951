"""Every stage entered one way (`run(cfg) -> Path` on its dataclass), the pipeline's table of stages,
the evaluate engines' registry, and the feature source's one spelling."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from eyas.config import validate
from eyas.errors import EyasError
from eyas.settings import command, from_json, to_json
from eyas.stages import STAGES, WIRED, build, stage_settings
from eyas.train.config import TrainConfig


@pytest.mark.parametrize("name", list(STAGES))
def test_each_stage_is_run_on_its_dataclass(name):
    """The entry point the pipeline runs is `run(cfg: <the stage's dataclass>) -> Path`, and the
    settings the pipeline wires itself are fields of that dataclass."""
    import importlib

    module, fn = STAGES[name].entry.split(":")
    run = getattr(importlib.import_module(module), fn)
    assert fn == "run"
    hints = typing.get_type_hints(run)
    assert list(inspect.signature(run).parameters) == ["cfg"]
    assert hints["cfg"] is stage_settings(name) and hints["return"] is Path
    assert WIRED[name] <= {f.name for f in dataclasses.fields(stage_settings(name))}


def _job(tmp_path: Path, **raw) -> object:
    return validate({"target": "x", "workdir": str(tmp_path / "w"), **raw}, "t.yaml")


def test_the_pipeline_builds_every_stage_from_its_section_and_the_wiring(tmp_path):
    cfg = _job(
        tmp_path,
        features="offline",
        prepare={"data": "a.jsonl", "regenerate": True},
        train={"betas": [0.8, 0.9], "device": "cpu"},
        export={"format": "sglang"},
        evaluate={"prompts": "q.jsonl", "max_new_tokens": 8},
    )
    stages = {s.name: s for s in build(cfg)}
    assert list(stages) == ["prepare", "extract", "train", "export", "evaluate"]
    w = tmp_path / "w"
    prep, tr, ev = stages["prepare"].config, stages["train"].config, stages["evaluate"].config
    assert prep.data == ["a.jsonl"] and prep.regenerate is not None and prep.out == w / "prepared"
    assert (tr.features, tr.store, tr.data, tr.betas) == ("offline", str(w / "store"), str(w / "prepared"), (0.8, 0.9))
    assert tr.tau_max_new_tokens == 8  # evaluate's answer length
    assert stages["export"].out == w / "export-sglang" and stages["export"].config.ckpt == w / "train" / "draft"
    assert ev.prompts == Path("q.jsonl") and ev.device == "cpu"  # train's device
    assert ev.vllm_draft is None  # an sglang export is no draft the vllm engine serves as it is
    online = {s.name: s for s in build(_job(tmp_path))}
    assert "extract" not in online and online["train"].config.store is None
    assert online["evaluate"].config.vllm_draft == w / "export-vllm"


def test_a_setting_refused_by_its_dataclass_stops_the_pipeline_before_anything_runs(tmp_path):
    """A value each key allows alone but the stage's dataclass refuses with another (here a setting
    that needs --experimental) stops `run_pipeline` before the workdir is made."""
    from eyas.pipeline import run_pipeline

    cfg = _job(tmp_path, train={"compile_scope": "regions"})
    with pytest.raises(EyasError, match=r"t\.yaml: the train section: .*--compile-scope regions.*Nothing was run"):
        run_pipeline(cfg)
    assert not (tmp_path / "w").exists()


def test_the_torchrun_spec_round_trips_the_train_config():
    cfg = TrainConfig(
        target="t",
        data="d",
        out="o",
        features="offline",
        store="s",
        betas=(0.8, 0.9),
        budget="1m30s",
        layers=[1, 2, 3],
        draft_config={"intermediate_size": 64},
        tau_k=[2, 4],
        tau_prompts=Path("q.jsonl"),
    )
    again = from_json(TrainConfig, to_json(cfg))
    assert again == cfg and again.betas == (0.8, 0.9) and again.tau_prompts == Path("q.jsonl")


def test_the_evaluate_engines_are_one_registry_keyed_by_the_engine_values():
    from eyas.evaluate.config import Engine, EngineName
    from eyas.evaluate.engines import ENGINES, engines_of

    assert set(ENGINES) == set(typing.get_args(EngineName)) == set(typing.get_args(Engine)) - {"both"}
    assert all(list(inspect.signature(fn).parameters) == ["cfg", "ctx"] for fn in ENGINES.values())
    assert engines_of("both") == ["builtin", "vllm"] and engines_of("replay") == ["replay"]


def _parse(*args: str) -> TrainConfig:
    got = []
    app = typer.Typer()
    command(app, "train", TrainConfig, got.append)
    app.command("noop")(lambda: None)
    res = CliRunner().invoke(app, ["train", *args])
    if res.exit_code:
        raise res.exception
    return got[0]


def test_features_is_the_one_setting_of_the_feature_source():
    """--online is short for --features online (and says so); --store is only the offline store's path."""
    assert _parse("--data", "d", "--out", "o", "--online").features == "online"
    assert _parse("--data", "d", "--out", "o", "--online", "--features", "online").features == "online"
    offline = _parse("--data", "d", "--out", "o", "--features", "offline", "--store", "s")
    assert (offline.features, offline.store) == ("offline", "s")
    with pytest.raises(EyasError, match="--online is short for --features online; it does not go with --features vllm"):
        _parse("--data", "d", "--out", "o", "--online", "--features", "vllm")
    with pytest.raises(EyasError, match="--store s: the store is read with --features offline"):
        TrainConfig(data="d", out="o", store="s")
    with pytest.raises(EyasError, match="--features online does not go with --store"):
        TrainConfig(data="d", out="o", features="online", store="s")
    with pytest.raises(EyasError, match="--features offline needs --store"):
        TrainConfig(data="d", out="o", features="offline")
    from eyas.cli import app

    res = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "250"}, terminal_width=250)
    assert "Short for --features online." in " ".join(res.output.split())
