"""`eyas pipeline [CONFIG]`: prepare -> (extract) -> train -> export -> evaluate, resumable.

The stages are declared in :mod:`eyas.stages`; the pipeline makes every stage's settings before
anything runs, records what made each output (``pipeline-config.json``), refuses to mix settings
over expensive outputs, and runs the stages in order. Every stage writes into its folder of the
workdir and is itself idempotent (a complete output is checked and skipped, an interrupted one
resumed), so re-running after a crash continues where it stopped.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from eyas.config import PipelineConfig, load_config
from eyas.device import release_device_memory
from eyas.errors import EyasError
from eyas.fsio import atomic_write_text, sha256_file
from eyas.stages import Stage, build, evaluate_settings, folders, stage_names, upstream

console = Console(stderr=True)


RECORD = "pipeline-config.json"
TIMINGS = "pipeline-timings.json"  # seconds per stage over every run (a resumed job adds up)
RECORD_KEYS = {"fingerprint", "settings", "inputs", "status", "seconds", "runs"}  # of each stage's record
# Stages whose outputs hold expensive work (hours of GPU for train): a changed setting is refused,
# never silently redone over them. export and evaluate are derived from the draft in minutes, so a
# changed setting simply redoes them (the old evaluation is moved aside, not deleted).
GUARDED = ("prepare", "extract", "train")


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _file_sha(spec: Any) -> str | None:
    p = Path(str(spec))
    return sha256_file(p) if p.is_file() else None


def stage_records(cfg: PipelineConfig) -> dict[str, dict[str, Any]]:
    """Per stage: its settings (config section plus what it depends on) and a fingerprint that also
    covers the stage it reads from, so a change upstream makes everything after it stale."""
    prep = cfg.section("prepare")
    data = prep.get("data", ["sharegpt"])
    data = [data] if isinstance(data, str) else list(data)
    ev = evaluate_settings(cfg)
    settings: dict[str, dict[str, Any]] = {
        "prepare": {"target": cfg.target, **prep},
        "extract": cfg.section("extract"),
        "train": {"features": cfg.features, "launcher": cfg.launcher, **cfg.section("train")},
        "export": cfg.section("export"),
        "evaluate": ev,
    }
    inputs: dict[str, dict[str, Any]] = {
        "prepare": {"data_sha256": [_file_sha(d) for d in data]},
        "evaluate": {"prompts_sha256": _file_sha(ev["prompts"]) if ev.get("prompts") else None},
    }
    out: dict[str, dict[str, Any]] = {}
    for stage in stage_names(cfg):
        st, up = settings[stage], upstream(cfg, stage)
        fp = _digest({"settings": st, "inputs": inputs.get(stage), "upstream": out[up]["fingerprint"] if up else None})
        out[stage] = {"fingerprint": fp, "settings": st, "inputs": inputs.get(stage, {}), "upstream": up}
    return out


def _diff(old: dict[str, Any], new: dict[str, Any], stage: str) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [
        f"{stage}.{k}: {old.get(k, '(unset)')!r} there, {new.get(k, '(unset)')!r} now"
        for k in keys
        if json.dumps(old.get(k), sort_keys=True, default=str) != json.dumps(new.get(k), sort_keys=True, default=str)
    ]


def _recorded(work: Path) -> dict[str, dict[str, Any]] | None:
    """The stage records of ``work``; None when the workdir has no record."""
    path = work / RECORD
    if not path.is_file():
        return None
    try:
        rec = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EyasError(
            f"{path}: unreadable ({e}); it records what made the outputs in {work}. "
            "Use a new workdir, or delete this one to start over"
        ) from e
    stages = rec.get("stages") if isinstance(rec, dict) else None
    if not isinstance(stages, dict) or not all(
        isinstance(s, dict) and RECORD_KEYS <= s.keys() for s in stages.values()
    ):
        raise EyasError(
            f"{path}: no stage records with their status and time, so a pre-release eyas wrote "
            "it. Use a new workdir, or delete this one to start over"
        )
    return stages


def _only_answer_cache(prepared: Path) -> bool:
    """``prepared`` holds nothing but a regeneration's answers (seeded from another run)."""
    from eyas.data.regenerate import CACHE, HEADER

    return prepared.is_dir() and {p.name for p in prepared.iterdir()} <= {CACHE, HEADER}


def check_stale(cfg: PipelineConfig, records: dict[str, dict[str, Any]]) -> list[str]:
    """Refuse (EyasError) a guarded stage whose outputs on disk were made with other settings;
    returns the derived stages to redo."""
    work, dirs = cfg.workdir, folders(cfg)
    old = _recorded(work)
    redo: list[str] = []
    for stage, rec in records.items():
        out = dirs[stage]
        if not out.exists() or (stage == "prepare" and _only_answer_cache(out)):
            continue  # a seeded answer cache: prepare checks its settings itself
        was = (old or {}).get(stage)
        if was is None:
            if stage in GUARDED:
                raise EyasError(
                    f"{out} exists but {work / RECORD} has no record of the settings that made "
                    f"it; nothing was run. Use a new workdir, or delete {out} to redo the stage"
                )
            redo.append(stage)
            continue
        if was.get("fingerprint") == rec["fingerprint"]:
            continue
        if stage not in GUARDED:
            redo.append(stage)
            continue
        diffs = _diff(was.get("settings", {}), rec["settings"], stage)
        if was.get("inputs") != rec["inputs"]:
            diffs += [f"{stage} inputs: {was.get('inputs')} there, {rec['inputs']} now"]
        if not diffs:
            diffs = [f"the {rec['upstream']} stage it reads from changed (see above)"]
        raise EyasError(
            f"{out} was made with other settings than {cfg.source} now gives: "
            + "; ".join(diffs)
            + f". Nothing was run. Put the settings back to continue, "
            f"use another workdir, or delete {out} (and the stages after it) to redo it "
            "with these settings"
        )
    return redo


def _write_record(cfg: PipelineConfig, stages: dict[str, dict[str, Any]]) -> None:
    """pipeline-config.json: what made each stage's outputs in the workdir, as they are on disk."""
    sections = {
        s: {k: v for k, v in rec["settings"].items() if k not in ("target", "features", "launcher")}
        for s, rec in stages.items()
    }
    atomic_write_text(
        cfg.workdir / RECORD,
        json.dumps(
            {
                "source": cfg.source,
                "target": cfg.target,
                "features": cfg.features,
                "launcher": cfg.launcher,
                "sections": sections,
                "stages": stages,
            },
            indent=2,
            default=str,
        ),
    )


class _Records:
    """pipeline-config.json as the run goes: a stage is recorded when it starts (its outputs then hold
    its work) and marked done when it ends."""

    def __init__(self, cfg: PipelineConfig, records: dict[str, dict[str, Any]], redo: list[str]):
        self.cfg, self.records = cfg, records
        old = _recorded(cfg.workdir) or {}
        self.old = old
        self.stages: dict[str, dict[str, Any]] = {}
        dirs = folders(cfg)
        for stage, rec in records.items():  # keep the records of outputs that stay on disk
            if stage in old and dirs[stage].exists() and stage not in redo:
                self.stages[stage] = {**rec, **{k: old[stage][k] for k in ("status", "seconds", "runs")}}
        _write_record(cfg, self.stages)

    @contextlib.contextmanager
    def stage(self, name: str):
        """Run a stage; its seconds add up over the runs it took (a stopped run's time counts too),
        so a job done in resumed parts still reports its time per stage."""
        t = time.perf_counter()
        kept = self.stages.get(name, {})
        self.stages[name] = {
            **self.records[name],
            "status": "running",
            "seconds": kept.get("seconds", 0.0),
            "runs": kept.get("runs", 0),
        }
        _write_record(self.cfg, self.stages)
        try:
            yield
            self.stages[name]["status"] = "done"
        finally:
            self.stages[name]["seconds"] = round(self.stages[name]["seconds"] + time.perf_counter() - t, 1)
            self.stages[name]["runs"] += 1
            _write_record(self.cfg, self.stages)
            self.write_timings()

    def write_timings(self) -> dict[str, float]:
        """pipeline-timings.json: seconds per stage, summed over the runs of its current outputs."""
        timings = {name: st["seconds"] for name, st in self.stages.items() if "seconds" in st}
        atomic_write_text(
            self.cfg.workdir / TIMINGS,
            json.dumps(
                {
                    "seconds": timings,
                    "runs": {n: st["runs"] for n, st in self.stages.items() if "runs" in st},
                    "done": [n for n, st in self.stages.items() if st.get("status") == "done"],
                },
                indent=2,
            ),
        )
        return timings

    def done(self, name: str) -> bool:
        return self.stages.get(name, {}).get("status") == "done"


def run_pipeline(cfg: PipelineConfig) -> dict[str, Any]:
    """Run every stage of ``cfg``; returns the evaluation's reports (a dict).

    Every stage's settings are made first (an error in any of them stops the job before anything
    runs). Each stage's settings and fingerprint are recorded in ``workdir/pipeline-config.json``
    when it starts and marked done when it ends. A re-run whose prepare, extract or train settings
    differ from the recorded ones is refused naming the fields, before anything runs; changed export
    or evaluate settings redo those stages. Each stage consumes the one before: train the prepared
    data (or extract's store), export train's draft, evaluate that export (vllm engine) and draft."""
    from eyas.outdir import check_out, writer_lock

    stages = build(cfg)
    check_out(cfg.workdir, flag="workdir", inputs={"the target": cfg.target})
    with writer_lock(cfg.workdir, flag="workdir", command="eyas pipeline"):
        return _run_pipeline(cfg, stages)


def _check_layers(cfg: PipelineConfig, target) -> None:
    """The layer ids of the extract and train sections against the target, before prepare runs (they
    were found wrong only when extract or train started, after prepare)."""
    from eyas.features.layers import parse_layers, resolve_layers

    tc = target.config()
    n = int(tc.get("text_config", tc)["num_hidden_layers"])
    for section in ("extract", "train"):
        layers = cfg.section(section).get("layers")
        if layers:
            try:
                resolve_layers(n, parse_layers(layers))
            except EyasError as e:
                raise EyasError(f"config {cfg.source}: {section}.layers = {layers!r}: {e}. Nothing was run") from None


def _run_pipeline(cfg: PipelineConfig, stages: list[Stage]) -> dict[str, Any]:
    from eyas.target import resolve_target

    work = cfg.workdir
    records = stage_records(cfg)
    redo = check_stale(cfg, records)  # before anything is written or run
    _check_layers(cfg, resolve_target(cfg.target))  # converts a built-in target once, up front
    work.mkdir(parents=True, exist_ok=True)
    rec = _Records(cfg, records, redo)
    by_name = {st.name: st for st in stages}
    if "evaluate" in redo:
        aside = work / f"eval.stale-{(rec.old.get('evaluate') or {}).get('fingerprint', 'unrecorded')}"
        os.replace(by_name["evaluate"].out, aside)
        console.print(f"evaluate: settings or draft changed; the earlier evaluation moved to {aside}")
    console.rule(f"eyas pipeline: target {cfg.target} -> {work}")
    for st in stages:
        console.rule(f"{st.name} [{time.strftime('%H:%M:%S')}]")  # when it began, to line up with other logs
        if st.name == "train" and _draft_complete(st.out / "draft") and rec.done("train"):
            console.print(
                f"train: {st.out / 'draft'} exists, made with these settings; skipping (delete {st.out} to train again)"
            )
            continue
        with rec.stage(st.name):
            st.run(st.config)
            if st.name == "evaluate":  # the export's card gains what evaluate measured
                _card(by_name["export"].out, by_name["train"].out / "draft", st.config)
        release_device_memory()  # a later stage's vLLM engine needs what this one cached on the GPU
    timings = rec.write_timings()
    console.print(
        f"pipeline done in {sum(timings.values()):.0f} s over its runs: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())
    )
    from eyas.evaluate.run import read_reports

    return read_reports(by_name["evaluate"].config)


def _draft_complete(draft: Path) -> bool:
    return (draft / "model.safetensors").is_file() and (draft / "config.json").is_file()


def _card(exported: Path, draft: Path, evaluate_cfg: Any) -> None:
    """The export's model card again, now with the tau per k the evaluation measured and, where
    the vllm engine timed it, the serving speed and best k. Each stage writes only its own folder;
    the pipeline owns both, so it is the one that puts evaluate's result into the export stage's
    card (through the export module)."""
    from eyas.evaluate.report import REPORT_NAME
    from eyas.evaluate.run import read_reports
    from eyas.export.card import ENGINE_NAMES, evaluated_tau, write_card

    reports = read_reports(evaluate_cfg)
    timed = ((reports.get("vllm") or {}).get("serving_speed") or {}).get("plain")
    evaluation = evaluated_tau(reports)
    report = Path(evaluate_cfg.out) / "vllm" / REPORT_NAME
    if timed or evaluation:
        path = write_card(exported, draft, report if timed else None, evaluation=evaluation)
        said = f"the serving speed of {report}" if timed else f"{ENGINE_NAMES[evaluation['engine']]}'s tau per k"
        console.print(f"export: model card {path} with {said}")


def register(app: typer.Typer) -> None:
    @app.command()
    def pipeline(
        config: Path = typer.Argument(
            None,
            help="YAML config (see configs/); default: the built-in CPU job on SmolLM2-135M-Instruct and ShareGPT.",
        ),
        workdir: Path = typer.Option(None, help="Override the config's workdir."),
        print_config: bool = typer.Option(False, "--print-config", help="Print the default config and exit."),
    ) -> None:
        """Run the whole job: prepare, (extract), train, export, evaluate. Re-run to resume."""
        from eyas.config import default_config_text

        if print_config:
            print(default_config_text())
            return
        cfg = load_config(config)
        if workdir is not None:
            cfg.workdir = workdir
        run_pipeline(cfg)
