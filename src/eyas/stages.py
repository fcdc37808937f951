"""The pipeline's job: its config (:class:`PipelineConfig`, read from YAML by :mod:`eyas.config`) and
its stages, declared once, in the order they run.

Each stage names its settings dataclass (its CLI and its YAML section), its entry point
``run(cfg) -> Path``, its folder in the workdir, the stages whose output it reads, and the settings
the pipeline wires itself (the target, the folders between stages): those are no keys of its YAML
section (:mod:`eyas.config` refuses them there) and are filled in by :func:`build`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable

from eyas.errors import EyasError
from eyas.train.config import FeatureSource


@dataclass
class PipelineConfig:
    """One pipeline job: the target, the workdir, the feature source, the launcher, and each stage's
    YAML section as written (checked by :func:`eyas.config.validate`)."""

    target: str
    workdir: Path
    # online: no extraction store; offline: extract, then train from the store; vllm: no store, a vLLM
    # engine makes the features as training goes (the train section's feature_* settings)
    features: FeatureSource = "online"
    launcher: dict[str, Any] = field(default_factory=dict)  # e.g. {"nproc_per_node": 8} -> torchrun
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: str = "<default>"

    def section(self, name: str) -> dict[str, Any]:
        return dict(self.sections.get(name) or {})


@dataclass(frozen=True)
class Job:
    """What the wiring reads: the pipeline's config and every stage's folder."""

    pipeline: PipelineConfig
    folders: dict[str, Path]

    @property
    def draft(self) -> Path:
        return self.folders["train"] / "draft"


Wire = Callable[[Job], Any]


def _target(job: Job) -> str:
    return job.pipeline.target


def _folder(stage: str) -> Wire:
    return lambda job: job.folders[stage]


def _fixed(value: Any) -> Wire:
    return lambda job: value


def _has_checkpoints(job: Job) -> bool:
    """Train resumes where an earlier run left checkpoints."""
    ckpts = job.folders["train"] / "checkpoints"
    return ckpts.is_dir() and any(ckpts.iterdir())


def _servable_export(job: Job) -> Path | None:
    """The export stage's folder where the vllm engine can serve it as it is (a vllm-format export
    at the draft's own dtype), so evaluate does not export the draft a second time."""
    export = job.pipeline.section("export")
    ready = export.get("format", "vllm") == "vllm" and export.get("dtype", "auto") == "auto"
    return job.folders["export"] if ready else None


@dataclass(frozen=True)
class StageSpec:
    settings: str  # "module:Class", the stage's settings dataclass
    entry: str  # "module:function", its run(cfg) -> Path
    folder: str  # its folder in the workdir; {name}: that setting's value
    reads: tuple[str, ...] = ()  # the stages whose output it reads (the last that runs is upstream)
    wired: dict[str, Wire] = field(default_factory=dict)  # settings the pipeline sets, from the job
    runs: Callable[[PipelineConfig], bool] = lambda cfg: True


STAGES: dict[str, StageSpec] = {
    "prepare": StageSpec(
        "eyas.data.config:PrepareOptions",
        "eyas.data.prepare:run",
        "prepared",
        wired={"target": _target, "out": _folder("prepare"), "progress": _fixed(True)},
    ),
    "extract": StageSpec(
        "eyas.extract.config:ExtractConfig",
        "eyas.extract.run:run",
        "store",
        reads=("prepare",),
        wired={
            "target": _target,
            "data": _folder("prepare"),
            "out": _folder("extract"),
            "progress": _fixed(True),
            "plan_only": _fixed(False),
        },
        runs=lambda cfg: cfg.features == "offline",
    ),
    "train": StageSpec(
        "eyas.train.config:TrainConfig",
        "eyas.train.trainer:run",
        "train",
        reads=("prepare", "extract"),
        wired={
            "target": _target,
            "data": _folder("prepare"),
            "out": _folder("train"),
            "features": lambda job: job.pipeline.features,
            "store": lambda job: job.folders["extract"] if job.pipeline.features == "offline" else None,
            "resume": _has_checkpoints,
            "progress": _fixed(True),
        },
    ),
    "export": StageSpec(
        "eyas.export.config:ExportConfig",
        "eyas.export.run:run",
        "export-{format}",
        reads=("train",),
        # the card with evaluate's serving speed is written after evaluate (eyas.pipeline)
        wired={
            "ckpt": lambda job: job.draft,
            "target": _target,
            "out": _folder("export"),
            "overwrite": _fixed(True),
            "speed_report": _fixed(None),
        },
    ),
    "evaluate": StageSpec(
        "eyas.evaluate.config:EvaluateConfig",
        "eyas.evaluate.run:run",
        "eval",
        reads=("train",),
        wired={
            "target": _target,
            "draft": lambda job: job.draft,
            "out": _folder("evaluate"),
            "progress": _fixed(True),
            "vllm_draft": _servable_export,
        },
    ),
}
WIRED: dict[str, set[str]] = {name: set(spec.wired) for name, spec in STAGES.items()}


def _load(spec: str) -> Any:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def stage_settings(name: str) -> type:
    """The settings dataclass of stage ``name``."""
    return _load(STAGES[name].settings)


def stage_names(cfg: PipelineConfig) -> list[str]:
    """The stages ``cfg`` runs, in order (extract only for offline features)."""
    return [name for name, spec in STAGES.items() if spec.runs(cfg)]


def upstream(cfg: PipelineConfig, name: str) -> str | None:
    """The stage whose output ``name`` reads last in ``cfg``'s job (its fingerprint covers that one's)."""
    ran = stage_names(cfg)
    return next((s for s in reversed(STAGES[name].reads) if s in ran), None)


def folders(cfg: PipelineConfig) -> dict[str, Path]:
    """Every stage's output folder in the workdir."""
    out = {}
    for name, spec in STAGES.items():
        cls = stage_settings(name)
        values = {f.name: f.default for f in fields(cls)} | cfg.section(name)
        out[name] = Path(cfg.workdir) / spec.folder.format_map(values)
    return out


def train_settings(cfg: PipelineConfig) -> dict[str, Any]:
    """The train section, with ``tau_max_new_tokens``: the section's own, else the evaluate section's
    ``max_new_tokens``, so that the tau measured while training is that of the evaluation this
    pipeline runs. The derived length is not part of train's record: it changes no weight, so a
    changed evaluate section must not make the draft stale (tau.json names the length it used)."""
    tr = cfg.section("train")
    new_tokens = cfg.section("evaluate").get("max_new_tokens")
    if "tau_max_new_tokens" not in tr and new_tokens is not None:
        tr["tau_max_new_tokens"] = new_tokens
    return tr


def evaluate_settings(cfg: PipelineConfig) -> dict[str, Any]:
    """The evaluate section, with its device: the section's own ``device``, else the train
    section's (one machine runs both), else none (evaluate's default, auto)."""
    ev = cfg.section("evaluate")
    train_device = cfg.section("train").get("device")
    if "device" not in ev and train_device is not None:
        ev["device"] = train_device
    return ev


# the sections with settings derived from another section; the others are the YAML as written
DERIVED: dict[str, Callable[[PipelineConfig], dict[str, Any]]] = {
    "train": train_settings,
    "evaluate": evaluate_settings,
}


@dataclass(frozen=True)
class Stage:
    """One stage of a job, ready to run: ``run(config)`` writes ``out`` and returns its product."""

    name: str
    config: Any
    out: Path
    run: Callable[[Any], Path]


def build(cfg: PipelineConfig) -> list[Stage]:
    """Every stage of ``cfg``'s job with its settings dataclass made (and so checked) from its section
    and the wiring, before anything runs; an error names the section and says nothing was run."""
    from eyas.settings import from_values

    job = Job(cfg, folders(cfg))
    stages = []
    for name in stage_names(cfg):
        spec = STAGES[name]
        section = DERIVED[name](cfg) if name in DERIVED else cfg.section(name)
        values = {**section, **{key: wire(job) for key, wire in spec.wired.items()}}
        try:
            config = from_values(stage_settings(name), values)
        except EyasError as e:
            raise EyasError(f"config {cfg.source}: the {name} section: {e}. Nothing was run") from None
        stages.append(Stage(name, config, job.folders[name], _load(spec.entry)))
    if int(cfg.launcher.get("nproc_per_node", 1)) > 1 or int(cfg.launcher.get("nnodes", 1)) > 1:
        from eyas.train.launch import torchrun  # several processes: torchrun starts them, each runs train

        stages = [replace(s, run=partial(torchrun, launcher=cfg.launcher)) if s.name == "train" else s for s in stages]
    return stages
