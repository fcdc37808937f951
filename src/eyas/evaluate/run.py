"""`eyas evaluate`: acceptance length, per-position acceptance and speedup of a draft, with the
built-in speculative loop, with vLLM's own metrics, or both (then compared)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from eyas import deadline
from eyas.errors import EyasError
from eyas.evaluate.config import EvaluateConfig


def run(cfg: EvaluateConfig) -> Path:
    """The evaluate stage's entry point (`eyas evaluate`, the pipeline): :func:`evaluate`, then its
    summary on stdout; returns the output directory (OUT/<engine>/report.json, plots, records)."""
    from eyas.evaluate.report import summary_lines

    for line in summary_lines(evaluate(cfg), cfg.out):
        print(line, flush=True)
    return Path(cfg.out)


def evaluate(cfg: EvaluateConfig) -> dict[str, Any]:
    """:func:`run_evaluation` with ``out`` checked first (a folder this process can write, apart from
    the inputs) and held by this process alone while it is written; returns the reports for callers
    that want the figures (:func:`run` is the stage's entry point)."""
    from eyas.outdir import check_out, writer_lock

    check_out(
        cfg.out,
        inputs={
            "the --draft": cfg.draft,
            "the --prompts file": cfg.prompts,
            "the --target": cfg.target,
            "the --vllm-draft": cfg.vllm_draft,
        },
    )
    with writer_lock(cfg.out, command="eyas evaluate"):
        return run_evaluation(cfg)


def run_evaluation(
    cfg: EvaluateConfig, plain_speed: list[dict[str, Any]] | None = None, plain_answers: Path | None = None
) -> dict[str, Any]:
    """Evaluate; writes OUT/<engine>/report.json + plots (and OUT/comparison.json for both).
    Returns {engine: report} (plus "comparison", and "k<N>" for each ``also_k``).

    ``device`` (auto: cuda when there is a GPU, else cpu) is where the builtin engine runs the HF
    target and the draft; vLLM runs where its build runs. ``dtype`` auto is bfloat16 on CUDA and
    float32 on the CPU, for both engines. ``vllm_draft``: an already exported vLLM-format directory
    of the draft (the pipeline's export stage), checked to be an export of that draft; without
    it the vllm engine exports one into OUT/vllm/draft-vllm. ``speed_concurrency`` (vllm engine):
    also time vLLM serving the first turns with and without the draft at each of these numbers of
    concurrent requests (report's ``serving_speed``), at -k and every ``also_k`` (:func:`_also_k`:
    ``plain_speed`` hands those runs the -k run's serving without the draft, ``plain_answers`` its
    greedy answers without the draft, for each k's ``greedy_vs_plain``)."""
    from eyas.evaluate.engines import ENGINES, engines_of
    from eyas.evaluate.report import build_report, write_report

    _check_choices(cfg)
    started = time.monotonic()
    ctx, meta = _context(cfg, plain_speed)
    ctx = replace(ctx, plain_answers=plain_answers)
    out, k, draft = Path(cfg.out), cfg.k, Path(cfg.draft)
    reports: dict[str, Any] = {}
    for name in engines_of(cfg.engine):
        sub = out / name
        sub.mkdir(parents=True, exist_ok=True)
        by_k, extra = ENGINES[name](cfg, replace(ctx, out=sub, settings={**ctx.settings, "engine": name}))
        for other, records in by_k.items():  # replay: every k from its one pass, into OUT/k<N>/ as --also-k
            if other != k:
                rep = build_report(records, other, {"engine": name, **meta, **_training_tau(draft, other), **extra})
                write_report(out / f"k{other}" / name, rep)
                reports[f"k{other}"] = {name: rep}
        report = build_report(by_k[k], k, {"engine": name, **meta, **extra})
        write_report(sub, report)
        reports[name] = report
    if "builtin" in reports and "vllm" in reports:
        reports["comparison"] = _compare(reports["builtin"], reports["vllm"], out)
    if cfg.engine != "replay":
        # the baseline's engine is this run's alone: the later k reuse its serving speed and answers
        baseline = (reports.get("vllm") or {}).get("plain_seconds_this_run") or 0.0
        _also_k(cfg, reports, summarize=plain_speed is None, took=time.monotonic() - started - baseline)
    return reports


def read_reports(cfg: EvaluateConfig) -> dict[str, Any]:
    """The reports :func:`run_evaluation` returned for ``cfg``, read back from what it wrote in OUT."""
    from eyas.evaluate.engines import engines_of
    from eyas.evaluate.report import REPORT_NAME

    out = Path(cfg.out)
    reports: dict[str, Any] = {}
    for other in dict.fromkeys(cfg.also_k) if cfg.engine == "replay" else ():  # from replay's one pass
        if other != cfg.k:
            reports[f"k{other}"] = {"replay": json.loads((out / f"k{other}" / "replay" / REPORT_NAME).read_text())}
    for name in engines_of(cfg.engine):
        reports[name] = json.loads((out / name / REPORT_NAME).read_text())
    if cfg.engine == "both":
        reports["comparison"] = json.loads((out / "comparison.json").read_text())
    if cfg.engine != "replay":
        for other in dict.fromkeys(cfg.also_k):
            if other != cfg.k:
                reports[f"k{other}"] = read_reports(replace(cfg, k=other, also_k=[], out=out / f"k{other}"))
    return reports


def _check_choices(cfg: EvaluateConfig) -> None:
    """The settings that only some engines take, refused where the engine cannot use them."""
    if cfg.k < 1:
        raise EyasError(f"-k {cfg.k}: need at least one draft token per step")
    if any(n < 1 for n in cfg.also_k):
        raise EyasError(f"--also-k {cfg.also_k}: each needs at least one draft token per step")
    if any(c < 1 for c in cfg.speed_concurrency):
        raise EyasError(f"--speed-concurrency {cfg.speed_concurrency}: each must be at least 1 request")
    if cfg.speed_concurrency and cfg.engine in ("builtin", "replay"):
        raise EyasError("--speed-concurrency times vLLM serving: use it with --engine vllm or both")
    if cfg.engine == "replay" and cfg.temperature > 0:
        raise EyasError(
            f"--engine replay --temperature {cfg.temperature}: replay measures greedy acceptance "
            "only (with sampling the output depends on the draft); use --engine builtin or vllm"
        )


def _recorded_target(config: Any, draft: Path) -> str:
    """The target a draft was trained for, from its config.json (``target_spec``)."""
    spec = getattr(config, "target_spec", "") or ""
    if not spec:
        raise EyasError(
            f"draft {draft}: its config.json records no target (target_spec); pass --target "
            "(an HF dir, a .gguf file or a built-in name)"
        )
    return spec


def _context(cfg: EvaluateConfig, plain_speed: list[dict[str, Any]] | None) -> tuple[Any, dict[str, Any]]:
    """What every engine shares (:class:`~eyas.evaluate.engines.EngineContext`: the target, its
    tokenizer, the questions, the records' settings), and the reports' common fields. The device,
    the draft against the target and the vLLM export are checked before any model loads."""
    from eyas.data.chat import stop_token_ids
    from eyas.device import resolve_device
    from eyas.draft.checks import check_against_target, load_checkpoint
    from eyas.evaluate.engines import EngineContext
    from eyas.evaluate.prompts import read_questions
    from eyas.fsio import sha256_file
    from eyas.target import resolve_target

    draft, prompts = Path(cfg.draft), Path(cfg.prompts)
    device = resolve_device(cfg.device)  # a bad spelling or a missing GPU stops here, before any model
    dtype = cfg.dtype if cfg.dtype != "auto" else "bfloat16" if device.startswith("cuda") else "float32"
    checkpoint = load_checkpoint(draft)
    target_spec = cfg.target or _recorded_target(checkpoint.config, draft)
    target = resolve_target(target_spec)
    check_against_target(checkpoint, target.config(), target.identity, f"target {target_spec!r}")
    if cfg.vllm_draft is not None and cfg.engine in ("vllm", "both"):
        check_export_of(Path(cfg.vllm_draft), draft)
    questions = read_questions(prompts, cfg.max_prompts, cfg.max_per_category)
    tokenizer = target.load_tokenizer()
    _warn_past_context(questions, tokenizer, target.config(), cfg.max_new_tokens, prompts)
    # the draft's content, not only its path: a draft retrained in place never reuses old records
    # (and `eyas export --speed-report` checks that a report is of the draft it exports)
    draft_sha256 = sha256_file(draft / "model.safetensors")
    meta = {
        **_training_tau(draft, cfg.k),
        "target": target.identity,
        "target_name": target_spec,
        "draft": str(cfg.draft),
        "prompts": str(cfg.prompts),
        "temperature": cfg.temperature,
        "max_new_tokens": cfg.max_new_tokens,
        "dtype": dtype,
        "device": device,
        "seed": cfg.seed,
        "max_prompts": cfg.max_prompts,
        "max_per_category": cfg.max_per_category,
        "draft_sha256": draft_sha256,
    }
    settings = {
        "target_id": target.id,
        "draft": str(draft.resolve()),
        "draft_sha256": draft_sha256,
        "k": cfg.k,
        "temperature": cfg.temperature,
        "max_new_tokens": cfg.max_new_tokens,
        "dtype": dtype,
        "seed": cfg.seed,
        "prompts": str(prompts.resolve()),
        # the prompts' content too: a file rewritten in place never reuses old answers
        "prompts_sha256": sha256_file(prompts),
        "device": device.split(":")[0],
    }
    ctx = EngineContext(
        target=target,
        tokenizer=tokenizer,
        questions=questions,
        stop_ids=set(stop_token_ids(tokenizer, target.path)),
        device=device,
        dtype=dtype,
        out=Path(cfg.out),
        settings=settings,
        plain_speed=plain_speed,
    )
    return ctx, meta


def _also_k(cfg: EvaluateConfig, reports: dict[str, Any], summarize: bool = True, took: float = 0.0) -> None:
    """Each ``also_k`` on its own, into OUT/k<N>/, resumable as -k is; its serving speed (vllm) is
    compared with the -k run's serving without the draft. Then (``summarize``: in the -k run, not in
    an ``also_k`` one) OUT/vllm/report.json gains every k's serving speed and the best k at each
    concurrency. Under ``EYAS_STOP_AT`` no k starts that would not end in time by the longest part
    of this run so far (``took``: the -k run's without its baseline, a first engine's start included,
    so the estimate errs long: a stop costs a restart, a cut costs the k)."""
    from eyas.evaluate.engines import PLAIN_ANSWERS, engines_of
    from eyas.evaluate.report import REPORT_NAME, serving_summary, write_report

    vllm = reports.get("vllm")
    plain = ((vllm or {}).get("serving_speed") or {}).get("plain")
    longest = took  # the longest part of this run: what the next k may take
    for other in dict.fromkeys(cfg.also_k):
        if other != cfg.k:
            done = all((Path(cfg.out) / f"k{other}" / name / REPORT_NAME).is_file() for name in engines_of(cfg.engine))
            if not done:  # a finished k is only read back
                deadline.check(longest, f"k={other}")
            t = time.monotonic()
            reports[f"k{other}"] = run_evaluation(
                replace(cfg, k=other, also_k=[], out=Path(cfg.out) / f"k{other}"),
                plain_speed=plain,
                plain_answers=Path(cfg.out) / "vllm" / PLAIN_ANSWERS,
            )
            longest = max(longest, time.monotonic() - t)
    if plain and summarize:
        by_k = {
            cfg.k: vllm,
            **{
                int(key[1:]): rep["vllm"]
                for key, rep in reports.items()
                if key.startswith("k") and key[1:].isdigit() and "vllm" in rep
            },
        }
        vllm.update(serving_summary(by_k))
        write_report(Path(cfg.out) / "vllm", vllm)


def _warn_past_context(questions, tokenizer, target_config: dict[str, Any], max_new_tokens: int, prompts) -> None:
    """Say so when first turns, with the tokens to generate, exceed the target's context
    (``max_position_embeddings``): their answers would be cut off or wrong, and later turns longer
    still. Only first turns can be measured before the model answers."""
    import sys

    from eyas.evaluate.prompts import render_turn

    tc = target_config.get("text_config", target_config)
    ctx = tc.get("max_position_embeddings")
    if not isinstance(ctx, int) or ctx <= 0:
        return
    over = [
        (q.question_id, n) for q in questions if (n := len(render_turn(tokenizer, q, 0, []))) + max_new_tokens > ctx
    ]
    if over:
        qid, n = max(over, key=lambda x: x[1])
        print(
            f"warning: prompts {prompts}: the first turn of {len(over)} of {len(questions)} questions, with "
            f"--max-new-tokens {max_new_tokens}, exceeds the target's context of {ctx:,} tokens "
            f"(max_position_embeddings), e.g. question {qid}: {n:,} tokens; their answers are cut off or "
            "wrong. Shorten those questions or leave them out",
            file=sys.stderr,
            flush=True,
        )


def _training_tau(draft_dir: Path, k: int) -> dict[str, Any]:
    """The tau `eyas train --tau` measured for ``k`` draft tokens, with what it was measured on
    (None: not measured, or not at this k)."""
    from eyas.train.tau import TAU_FILE

    try:
        rec = json.loads((draft_dir / TAU_FILE).read_text())
        return {
            "training_tau": rec["tau"].get(str(k)),
            "training_tau_on": {key: rec[key] for key in ("step", "turns", "prompts", "max_new_tokens")},
        }
    except (OSError, ValueError, KeyError, AttributeError):
        return {"training_tau": None}


def check_export_of(exported: Path, draft_dir: Path) -> None:
    """Refuse ``exported`` unless it is a vLLM-format export of exactly ``draft_dir``'s weights."""
    from eyas.fsio import sha256_file

    cfg_path = exported / "config.json"
    try:
        info = json.loads(cfg_path.read_text()).get("eyas", {})
    except (OSError, json.JSONDecodeError) as e:
        raise EyasError(
            f"vLLM draft {exported}: no readable config.json ({e}); pass the directory "
            "`eyas export --format vllm` wrote"
        ) from e
    if info.get("format") != "vllm":
        raise EyasError(f"vLLM draft {exported}: not an eyas vllm-format export")
    want = sha256_file(draft_dir / "model.safetensors")
    if info.get("source_sha256") != want:
        raise EyasError(
            f"vLLM draft {exported}: exported from another draft than {draft_dir} (or by an "
            "older eyas that did not record it); export it again, or leave it out and "
            "`eyas evaluate` exports one"
        )


def _compare(builtin: dict, vllm: dict, out: Path) -> dict[str, Any]:
    from eyas.evaluate.report import plot_report

    tb, tv = builtin["overall"]["tau"], vllm["overall"]["tau"]
    same = [a["output_ids"] == b["output_ids"] for a, b in zip(builtin["per_prompt"], vllm["per_prompt"])]
    comp = {
        "tau_builtin": tb,
        "tau_vllm": tv,
        "tau_relative_difference": (abs(tb - tv) / tv) if (tb and tv) else None,
        "acceptance_rate_per_pos_builtin": builtin["overall"]["acceptance_rate_per_pos"],
        "acceptance_rate_per_pos_vllm": vllm["overall"]["acceptance_rate_per_pos"],
        "identical_outputs": sum(same),
        "prompts": len(same),
        "per_category_tau": {
            c: {"builtin": builtin["per_category"][c]["tau"], "vllm": vllm["per_category"].get(c, {}).get("tau")}
            for c in builtin["per_category"]
        },
    }
    path = Path(out) / "comparison.json"
    tmp = path.with_name(f".comparison.json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(comp, indent=2) + "\n")
    os.replace(tmp, path)
    plot_report(builtin, Path(out), others={"vllm": vllm})
    return comp
