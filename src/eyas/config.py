"""Pipeline configuration: one YAML file, one section per stage.

Each section's keys are exactly the keyword arguments of that stage's Python function, so the
CLI, the config file and the API can never drift apart: :func:`validate` checks every key
against the function's signature and names the unknown ones.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import yaml

from eyas.errors import EyasError

# section -> "module:function". Arguments the pipeline wires itself (paths between stages,
# the target) are listed in WIRED and must not appear in a config.
STAGES: dict[str, str] = {
    "prepare": "eyas.data.prepare:PrepareOptions",
    "extract": "eyas.extract.run:run_extract",
    "train": "eyas.train.trainer:TrainConfig",
    "export": "eyas.export.cli:export_checkpoint",
    "evaluate": "eyas.evaluate.cli:evaluate_draft",
}
WIRED: dict[str, set[str]] = {
    "prepare": {"target", "out", "progress"},
    "extract": {"target", "data", "out", "progress", "plan_only"},
    "train": {"target", "data", "store", "out", "online", "progress"},
    "export": {"ckpt_dir", "target_spec", "out", "overwrite"},
    "evaluate": {"target_spec", "draft_dir", "out", "progress", "vllm_draft"},
}
# Config spellings of parameters whose Python names differ (the CLI's flag names).
ALIASES: dict[str, dict[str, str]] = {"export": {"format": "fmt"}}
TOP_LEVEL = {"target", "workdir", "features", "launcher", *STAGES}


@dataclass
class PipelineConfig:
    target: str
    workdir: Path
    features: str = "online"  # online: no extraction store; offline: extract, then train from the store
    launcher: dict[str, Any] = field(default_factory=dict)  # e.g. {"nproc_per_node": 8} -> torchrun
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: str = "<default>"

    def section(self, name: str) -> dict[str, Any]:
        return dict(self.sections.get(name) or {})


def stage_function(section: str) -> Callable[..., Any]:
    module, name = STAGES[section].split(":")
    return getattr(importlib.import_module(module), name)


def default_config_text() -> str:
    return resources.files("eyas").joinpath("default.yaml").read_text()


def load_config(path: str | Path | None = None) -> PipelineConfig:
    """Load and validate a pipeline config; ``None`` gives the default job."""
    if path is None:
        raw, source = yaml.safe_load(default_config_text()), "<default>"
    else:
        p = Path(path)
        if not p.is_file():
            raise EyasError(f"config {p}: no such file")
        try:
            raw, source = yaml.safe_load(p.read_text()), str(p)
        except yaml.YAMLError as e:
            raise EyasError(f"config {p}: not valid YAML ({e})") from e
    if not isinstance(raw, dict):
        raise EyasError(f"config {source}: expected a mapping of sections, got {type(raw).__name__}")
    return validate(raw, source)


def _check_section(name: str, section: dict[str, Any], source: str) -> dict[str, Any]:
    """Each value against its field's type and range (eyas.checks), so that a bad value stops the
    pipeline before prepare runs; returns the section with numbers YAML read as strings converted."""
    from eyas.checks import check_values, hints

    spell = {v: k for k, v in ALIASES.get(name, {}).items()}
    types_ = hints(stage_function(name))
    nested = {}
    if name == "prepare" and "regenerate" in section:
        regen = section["regenerate"]
        if isinstance(regen, dict):
            from eyas.data.prepare import RegenerateOptions

            params = set(inspect.signature(RegenerateOptions).parameters)
            bad = sorted(set(regen) - params)
            if bad:
                raise EyasError(f"config {source}: prepare.regenerate has unknown keys {bad}; "
                                f"allowed: {sorted(params)}")
            nested["regenerate"] = check_values("regenerate", regen, hints(RegenerateOptions),
                                                lambda k: f"config {source}: prepare.regenerate.{k}")
        elif regen not in (True, False, None):
            raise EyasError(f"config {source}: prepare.regenerate = {regen!r}: expected true, false or "
                            "a mapping of regenerate settings")
        else:
            nested["regenerate"] = regen
    plain = {k: v for k, v in section.items() if k not in nested}
    out = check_values(name, plain, types_, lambda k: f"config {source}: {name}.{spell.get(k, k)}")
    if name in ("extract", "evaluate") and "device" in plain:
        from eyas.device import DEVICE_FORM

        if not DEVICE_FORM.fullmatch(str(plain["device"])):  # the form only: the GPU is looked for at run time
            raise EyasError(f"config {source}: {name}.device {plain['device']!r}: choose auto, cpu, cuda "
                            "or cuda:N")
    # keep the config's own spelling except for numbers YAML left as strings (lr: 1e-4)
    kept = {k: out[k] if isinstance(v, str) and isinstance(out[k], (int, float)) else v for k, v in plain.items()}
    return {**kept, **nested}


def validate(raw: dict[str, Any], source: str = "<config>") -> PipelineConfig:
    unknown = set(raw) - TOP_LEVEL
    if unknown:
        raise EyasError(f"config {source}: unknown top-level keys {sorted(unknown)}; "
                        f"allowed: {sorted(TOP_LEVEL)}")
    if "target" not in raw:
        raise EyasError(f"config {source}: 'target' is required (a model dir, .gguf or built-in name)")
    features = raw.get("features", "online")
    if features not in ("online", "offline"):
        raise EyasError(f"config {source}: features must be 'online' or 'offline', not {features!r}")
    sections: dict[str, dict[str, Any]] = {}
    for name in STAGES:
        section = raw.get(name) or {}
        if not isinstance(section, dict):
            raise EyasError(f"config {source}: section {name!r} must be a mapping")
        section = {ALIASES.get(name, {}).get(k, k): v for k, v in section.items()}
        params = inspect.signature(stage_function(name)).parameters
        allowed = set(params) - WIRED[name]
        bad = sorted(set(section) - allowed)
        if bad:
            raise EyasError(f"config {source}: section {name!r} has unknown keys {bad}; "
                            f"allowed: {sorted(allowed)}")
        sections[name] = _check_section(name, section, source)
    launcher = raw.get("launcher") or {}
    bad = sorted(set(launcher) - {"nproc_per_node", "nnodes", "rdzv_endpoint", "node_rank"})
    if bad:
        raise EyasError(f"config {source}: launcher has unknown keys {bad}")
    return PipelineConfig(target=str(raw["target"]),
                          workdir=Path(raw.get("workdir", "runs/default")),
                          features=features, launcher=launcher, sections=sections, source=source)
