"""Every config in the repo validates against the stages' real signatures."""

from __future__ import annotations

from pathlib import Path

import pytest

from eyas.config import load_config, validate
from eyas.errors import EyasError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_repo_has_configs():
    names = {p.name for p in CONFIGS}
    assert {"smollm2-h200.yaml", "deepseek-v3-8gpu.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_validates(path):
    cfg = load_config(path)
    assert cfg.target and cfg.workdir
    assert cfg.section("export").get("format", "vllm") in ("vllm", "sglang")


def test_default_config_is_the_cpu_job():
    cfg = load_config(None)
    assert cfg.target == "smollm2-135m-instruct"
    assert cfg.features == "online"
    assert cfg.section("prepare")["data"] == "sharegpt"


def test_seed_case_config():
    cfg = load_config(ROOT / "configs" / "deepseek-v3-8gpu.yaml")
    assert cfg.section("extract")["layers"] == [2, 30, 58]
    assert cfg.section("extract")["tensor_parallel_size"] == 8
    assert cfg.launcher["nproc_per_node"] == 8
    assert cfg.features == "offline"
    assert cfg.section("train")["parallel"] == "fsdp2"


@pytest.mark.parametrize(
    "raw, match",
    [
        ({"target": "x", "train": {"ttt_step": 3}}, r"section 'train' has unknown keys \['ttt_step'\]"),
        ({"target": "x", "extract": {"out": "/tmp/x"}}, r"unknown keys \['out'\]"),  # wired by the pipeline
        ({"target": "x", "trian": {}}, r"unknown top-level keys \['trian'\]"),
        ({"train": {}}, "'target' is required"),
        ({"target": "x", "features": "disk"}, "features = 'disk' is not one of 'offline', 'online', 'vllm'"),
    ],
)
def test_bad_configs_are_named(raw, match):
    with pytest.raises(EyasError, match=match):
        validate(raw, "test.yaml")


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(EyasError, match="no such file"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: [unclosed\n")
    with pytest.raises(EyasError, match="not valid YAML"):
        load_config(bad)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_a_configs_answers_kept_in_git_are_the_ones_its_regeneration_makes(path):
    """The device scripts seed a config's run with data/regenerated/<target>-sharegpt/; prepare
    accepts those answers only under the sampling and length they were made with, so a config that
    drifts from them would fail on the device (or start a regeneration engine) instead of here."""
    import json

    from eyas.stages import build

    cfg = load_config(path)
    kept = ROOT / "data" / "regenerated" / f"{cfg.target}-sharegpt" / "regenerate.json"
    prepare = next((s.config for s in build(cfg) if s.name == "prepare"), None)
    if prepare is None or prepare.regenerate is None or not kept.is_file() or prepare.data != ["sharegpt"]:
        pytest.skip(f"{path.name} regenerates no ShareGPT answers kept in git")
    made = json.loads(kept.read_text())
    wanted = prepare.regenerate.settings()
    assert {k: made[k] for k in wanted} == wanted
    assert made["max_length"] == prepare.max_length
