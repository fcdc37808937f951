"""The model card of an export: ``README.md`` beside the weights.

It says which target the draft serves, what it was trained on, how far it drafts (tau per k), how
much it speeds vLLM serving up where an evaluation measured it, and the exact ``vllm serve`` line.
Everything comes from files: the export's ``config.json``, the draft's ``config.json`` and
``tau.json``, what its training run recorded beside it (``train_config.json``, ``summary.json``,
the prepared data's ``manifest.json``), and, when given, an ``eyas evaluate --engine vllm
--speed-concurrency`` report (``OUT/vllm/report.json``): `eyas export --speed-report`, or the
pipeline once its evaluate stage is done, which also gives the tau per k its evaluation measured
with whichever engine (:func:`evaluated_tau`). Nothing is measured here.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.evaluate.report import recommended_k, recommended_k_lines, speedups_at
from eyas.evaluate.step_cost import step_cost_lines

CARD = "README.md"
# what the card says an evaluation's tau was measured on; ENGINE_NAMES: how it names the engine
_MEASURED_ON = ("prompts", "temperature", "max_new_tokens", "dtype", "vllm_version")
ENGINE_NAMES = {"vllm": "vLLM", "replay": "replay", "builtin": "builtin loop"}


def read_speed_report(path: Path, draft_dir: Path) -> dict[str, Any]:
    """The evaluation report at ``path``, refused unless it is an ``eyas evaluate --engine vllm``
    report of exactly ``draft_dir``'s weights with the serving speed measured."""
    from eyas.fsio import sha256_file

    path = Path(path)
    try:
        rep = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise EyasError(
            f"--speed-report {path}: not a readable report ({e}); pass the report.json that "
            "`eyas evaluate --engine vllm --speed-concurrency 1,8,32` wrote in OUT/vllm/"
        ) from e
    if not isinstance(rep, dict) or rep.get("kind") != "eyas-evaluation" or rep.get("engine") != "vllm":
        raise EyasError(
            f"--speed-report {path}: not the vllm engine's report of `eyas evaluate`; pass "
            "OUT/vllm/report.json of `eyas evaluate --engine vllm` (or both)"
        )
    try:
        draft_sha256 = sha256_file(Path(draft_dir) / "model.safetensors")
    except OSError as e:
        raise EyasError(f"draft {draft_dir}: no readable model.safetensors ({e})") from e
    if rep.get("draft_sha256") != draft_sha256:
        raise EyasError(
            f"--speed-report {path}: an evaluation of another draft than {draft_dir} (or by an "
            "older eyas that did not record which); evaluate this draft (a re-run of the same "
            "evaluation resumes from its records)"
        )
    if not (rep.get("serving_speed") or {}).get("plain"):
        raise EyasError(
            f"--speed-report {path}: no serving speed in it; evaluate with --speed-concurrency "
            "(e.g. 1,8,32) to time vLLM serving with and without the draft"
        )
    return rep


def evaluated_tau(reports: dict[str, Any]) -> dict[str, Any] | None:
    """The tau per k of one evaluation, from what ``eyas.evaluate.run.read_reports`` read back (any
    engine; vLLM's where it ran, else replay's, else the builtin loop's), with what it was measured
    on: the card's "tau in evaluate" column. None when no engine reported."""
    for engine in ("vllm", "replay", "builtin"):
        first = reports.get(engine)
        if not first:
            continue
        found = [first] + [sub[engine] for key, sub in reports.items() if key.startswith("k") and engine in sub]
        return _evaluation(engine, {str(r["num_speculative_tokens"]): r["overall"]["tau"] for r in found}, first)
    return None


def _evaluation(engine: str, tau_by_k: dict[str, float] | None, report: dict[str, Any]) -> dict[str, Any]:
    """An evaluation as the card's tau column takes it: engine, tau per k, what it was measured on."""
    return {"engine": engine, "tau_by_k": tau_by_k, **{key: report.get(key) for key in _MEASURED_ON}}


def write_card(
    export_dir: Path,
    draft_dir: Path,
    speed_report: Path | None = None,
    report: dict[str, Any] | None = None,
    evaluation: dict[str, Any] | None = None,
) -> Path:
    """Write ``export_dir``/README.md for the export of ``draft_dir``; ``report``: ``speed_report``
    already read by :func:`read_speed_report` (else it is read and checked here); ``evaluation``:
    an evaluation's tau per k (:func:`evaluated_tau`), for a card without a speed report."""
    from eyas.fsio import atomic_write_text

    if speed_report is not None and report is None:
        report = read_speed_report(speed_report, draft_dir)
    path = Path(export_dir) / CARD
    atomic_write_text(path, card_text(Path(export_dir), Path(draft_dir), report, speed_report, evaluation))
    return path


def card_text(
    export_dir: Path,
    draft_dir: Path,
    report: dict[str, Any] | None = None,
    report_path: Path | None = None,
    evaluation: dict[str, Any] | None = None,
) -> str:
    from eyas.evaluate.report import finished_summary

    if report and "serving_speed_by_k" not in report:
        # a run stopped between two k, or one k (no --also-k): the summary over the k timed beside it
        report = finished_summary(report, Path(report_path).parent.parent if report_path else None)[0]
    if report:  # the speed report's own tau per k
        evaluation = _evaluation("vllm", report.get("tau_by_k"), report)
    export = _json(export_dir / "config.json") or {}
    draft = _json(draft_dir / "config.json") or {}
    fmt = (export.get("eyas") or {}).get("format", "vllm")
    target = draft.get("target_spec") or draft.get("target_name_or_path") or "(not recorded)"
    verifier = (
        ((export.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
        or draft.get("target_name_or_path")
        or target
    )
    lines = [
        f"# EAGLE-3 draft for {target}",
        "",
        f"An EAGLE-3 draft model trained by eyas, exported in the {fmt} format "
        f"({'vLLM speculators' if fmt == 'vllm' else 'SGLang LlamaForCausalLMEagle3, also loaded by vLLM'}).",
        "",
        "## Target",
        "",
        f"- name: `{target}`",
        f"- loaded from: `{verifier}`",
        f"- eyas target id: `{(draft.get('target') or {}).get('id', '(not recorded)')}` (weights and "
        "tokenizer fingerprint; `eyas export --target` checks a target against it)",
        f"- draft: one decoder layer over the target's hidden states at layers "
        f"{', '.join(map(str, draft.get('aux_layer_ids') or []))}, draft vocabulary "
        f"{_n(draft.get('draft_vocab_size'))} of {_n(draft.get('vocab_size'))} tokens",
    ]
    options = [o for o in ("fc_norm", "norm_before_fc", "norm_output") if export.get(o)]
    if options:
        lines.append(
            f"- head options {', '.join(options)}: vLLM 0.32 or later serves them (older vLLM "
            "ignores them and would serve a different draft)"
        )
    lines += ["", "## Training data", "", *_data_lines(draft_dir)]
    lines += ["", "## Acceptance length (tau) per k", "", *_tau_lines(draft_dir, evaluation)]
    lines += ["", "## Serving speed (vLLM, output tokens/s)", "", *_speed_lines(report, report_path)]
    k, why = _serving_k(export, report)
    # the vLLM settings the speeds were measured with are part of what was measured
    options = (report or {}).get("speculative_options") or {}
    config = json.dumps(
        {"method": "eagle3", "model": str(Path(export_dir).resolve()), "num_speculative_tokens": k, **options}
    )
    lines += [
        "",
        "## Serve it",
        "",
        "```",
        f"vllm serve {shlex.quote(str(verifier))} --speculative-config {shlex.quote(config)}",
        "```",
        "",
        f"k = {k}: {why}."
        + (f" The other keys are those the serving speed was measured with ({', '.join(options)})." if options else ""),
        "",
    ]
    return "\n".join(lines)


def _json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _n(x: Any) -> str:
    return f"{x:,}" if isinstance(x, int) else str(x)


def _data_lines(draft_dir: Path) -> list[str]:
    """What the draft's training run recorded about its data: the run directory (the draft's
    parent, as `eyas train` writes it) names the prepared dataset, whose manifest says the rest."""
    run = draft_dir.resolve().parent
    cfg = _json(run / "train_config.json")
    if not isinstance(cfg, dict) or not cfg.get("data"):
        return [f"Not recorded: no train_config.json of `eyas train` beside the draft (in {run})."]
    lines = []
    summary = _json(run / "summary.json") or {}
    if summary.get("steps"):
        lines.append(
            f"- trained {_n(summary['steps'])} steps, {_n(summary.get('tokens_seen'))} tokens seen "
            f"({summary.get('epochs')} epochs); the target's hidden states {_features(cfg)}"
        )
    data = Path(cfg["data"])
    # a relative path is the training's working folder's: try it here, then beside the run (the
    # pipeline's workdir holds prepared/ and train/)
    found = [
        m
        for d in ([data] if data.is_absolute() else [data, run.parent / data.name])
        if isinstance(m := _json(d / "manifest.json"), dict)
    ]
    manifest = found[0] if found else None
    if manifest is None:
        return lines + [f"- prepared dataset `{data}` (its manifest.json is no longer there)"]
    trained_on = _dataset_id(run)
    note = (
        ""
        if trained_on in (None, manifest.get("id"))
        else (f"; **changed since**: the draft was trained on dataset id `{trained_on}`")
    )
    c = manifest.get("counts") or {}
    lines.append(
        f"- prepared dataset `{data}` (id `{manifest.get('id')}`{note}): {_n(c.get('samples'))} "
        f"conversations, {_n(c.get('trained_tokens'))} trained-on tokens, at most "
        f"{_n(manifest.get('max_length'))} tokens each"
    )
    for s in manifest.get("sources") or []:
        said = [
            f"`{s['spec']}`" if s.get("spec") else "",
            f"{_n(s['records'])} records" if s.get("records") else "",
            f"sha256 `{s['sha256'][:16]}`" if s.get("sha256") else "",
        ]
        lines.append(f"- source `{s.get('name')}`" + "".join(f", {x}" for x in said if x))
    regen = manifest.get("regenerate")
    if regen:
        lines.append(
            f"- answers regenerated by the target: {_n(regen.get('answers'))} answers "
            f"({regen.get('engine', 'hf')}, {regen.get('settings')})"
        )
    return lines


def _features(cfg: dict[str, Any]) -> str:
    how = cfg.get("features") or ("online" if cfg.get("online") else "offline")
    return {
        "online": "computed while training (online)",
        "vllm": "made by a vLLM engine while training (--features vllm)",
        "offline": "read from a store of `eyas extract` (offline)",
    }.get(how, str(how))


def _dataset_id(run: Path) -> str | None:
    """The dataset id the run's newest checkpoint recorded (None: no checkpoint left)."""
    from eyas.train.checkpoint import STATE, checkpoint_dirs

    dirs = checkpoint_dirs(run)
    state = _json(dirs[-1] / STATE) if dirs else None
    return ((state or {}).get("run") or {}).get("dataset_id")


def _tau_lines(draft_dir: Path, evaluation: dict[str, Any] | None) -> list[str]:
    from eyas.train.tau import TAU_FILE

    measured = _json(draft_dir / TAU_FILE)
    measured = measured if isinstance(measured, dict) else None
    training = (measured or {}).get("tau") or {}
    evaluated = (evaluation or {}).get("tau_by_k") or {}
    ks = sorted({*training, *evaluated}, key=int)
    if not ks:
        return [f"Not measured: no {TAU_FILE} beside the draft (`eyas train --tau` writes it) and no evaluation given."]
    engine = (evaluation or {}).get("engine", "vllm")
    lines = [f"| k | tau while training | tau in evaluate ({ENGINE_NAMES[engine]}) |", "|---|---|---|"]
    lines += [f"| {k} | {_f(training.get(k))} | {_f(evaluated.get(k))} |" for k in ks]
    lines.append("")
    if measured:
        lines.append(
            f"While training: greedy, at step {measured.get('step')}, on {measured.get('turns')} turns "
            f"of {measured.get('prompts')}, {measured.get('max_new_tokens')} new tokens each."
        )
    else:
        lines.append(f"While training: not measured (no {TAU_FILE} beside the draft; `eyas train --tau` writes it).")
    if evaluated:
        how = f"vLLM {evaluation.get('vllm_version')}" if engine == "vllm" else ENGINE_NAMES[engine]
        lines.append(
            f"In evaluate: {how}, on {evaluation.get('prompts')}, temperature {evaluation.get('temperature')}, "
            f"{evaluation.get('max_new_tokens')} new tokens, {evaluation.get('dtype')}."
        )
    return lines


def _speed_lines(report: dict[str, Any] | None, report_path: Path | None) -> list[str]:
    if not report:
        return [
            "Not measured: `eyas evaluate --engine vllm --speed-concurrency 1,8,32 -k 1 --also-k 2,3,4,5` "
            "times it; `eyas export --speed-report EVAL/vllm/report.json` puts it here."
        ]
    rows = report["serving_speed_by_k"]
    speed = report.get("serving_speed") or {}
    lines = ["| concurrent requests | k | with the draft | without | speedup |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['concurrency']} | {r['k']} | {_f(r['tokens_per_s_draft'], 0)} | "
        f"{_f(r['tokens_per_s_plain'], 0)} | {_f(r['speedup'])}x |"
        for r in rows
    ]
    lines.append("")
    for c, b in sorted((report.get("best_k") or {}).items(), key=lambda kv: int(kv[0])):
        lines.append(
            f"- {c} concurrent: "
            + (
                f"best k = {b['k']}, {b['speedup']:.2f}x"
                if b["pays"]
                else f"no k speeds serving up (the least slow: k = {b['k']}, {b['speedup']:.2f}x); serve "
                "without the draft at this load"
            )
        )
    lines += [f"- {ln.removeprefix('vllm serving: ')}" for ln in recommended_k_lines(_recommended(report), rows)]
    costs = report.get("step_cost") or {}
    if costs:
        lines += [
            "",
            "Where a step's time goes (`eyas.evaluate.step_cost`: each step's time from the tokens/s and tau):",
        ]
        lines += [f"- {ln.removeprefix('vllm serving, ')}" for ln in step_cost_lines(costs)]
    lines += [
        "",
        f"Measured by `eyas evaluate` with vLLM {report.get('vllm_version')} on "
        f"{', '.join(filter(None, (report.get('gpu'), report.get('machine'))))}, "
        f"{report.get('dtype')}: {speed.get('prompts')} first turns of {report.get('prompts')}, greedy, up "
        f"to {speed.get('max_new_tokens')} new tokens, "
        + (
            "sent in waves of `concurrent requests` at once (the next wave once one is done)"
            if speed.get("load", "waves") == "waves"
            else "`concurrent requests` always in flight (a finished one replaced at once)"
        )
        + f", each point at least {speed.get('min_waves')} times as many requests and "
        f"{speed.get('min_seconds')} s of generation" + (f"; report {report_path}." if report_path else "."),
    ]
    return lines


def _serving_k(export: dict[str, Any], report: dict[str, Any] | None) -> tuple[int, str]:
    """The k of the serve line, and why: the evaluation's recommended k (the fastest at its slowest
    measured load; made from the rows of a report written before eyas named it), else the export's."""
    rec = _recommended(report)
    if rec:
        return int(rec["k"]), (
            f"of the k measured, the fastest at its slowest load ({speedups_at(rec)} concurrent requests"
            + ("" if rec["pays"] else "; slower than without the draft at the slowest")
            + ")"
            + (
                "; its points and the baseline's were timed at two host speeds, so time it again"
                if rec.get("host_speeds_mixed")
                else ""
            )
        )
    methods = (export.get("speculators_config") or {}).get("proposal_methods") or [{}]
    k = methods[0].get("speculative_tokens")
    if k is None:  # the sglang format records none
        return 3, "eyas's default (serving speed not measured)"
    return int(k), "the export's num_speculative_tokens (serving speed not measured)"


def _recommended(report: dict[str, Any] | None) -> dict[str, Any] | None:
    """The report's recommended k; for a report written before eyas named one, made from its rows."""
    report = report or {}
    return report.get("recommended_k") or recommended_k(report.get("serving_speed_by_k") or [])


def _f(x: Any, digits: int = 2) -> str:
    return "not measured" if x is None else f"{x:,.{digits}f}"
