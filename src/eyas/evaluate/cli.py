"""`eyas evaluate`: acceptance length, per-position acceptance and speedup of a draft, with the
built-in speculative loop, with vLLM's own metrics, or both (then compared)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import typer

from eyas.checks import checked
from eyas.errors import EyasError

ENGINES = ("builtin", "vllm", "both")


@checked("evaluate")
def evaluate_draft(target_spec: str, draft_dir: Path, prompts: Path | None = None,
                   out: Path = Path("runs/evaluate"), engine: str = "builtin",
                   k: int = 3, temperature: float = 0.0, max_prompts: int | None = None,
                   max_new_tokens: int = 256, dtype: str = "float32", vllm: str | None = None,
                   seed: int = 0, compare_plain: bool = True, progress: bool = True,
                   max_per_category: int | None = None) -> dict[str, Any]:
    """Evaluate; writes OUT/<engine>/report.json + plots (and OUT/comparison.json for both).
    Returns {engine: report} (plus "comparison")."""
    from eyas.data.chat import stop_token_ids
    from eyas.evaluate.prompts import DEFAULT_PROMPTS, read_questions
    from eyas.export.checks import check_against_target, load_checkpoint
    from eyas.target import resolve_target

    if engine not in ENGINES:
        raise EyasError(f"--engine {engine!r}: choose one of {', '.join(ENGINES)}")
    if k < 1:
        raise EyasError(f"-k {k}: need at least one draft token per step")
    prompts = Path(prompts) if prompts else DEFAULT_PROMPTS
    target = resolve_target(target_spec)
    ckpt = load_checkpoint(draft_dir)
    check_against_target(ckpt, target.config(), target.identity, f"target {target_spec!r}")
    questions = read_questions(prompts, max_prompts, max_per_category)
    tokenizer = target.load_tokenizer()
    stop_ids = set(stop_token_ids(tokenizer, target.path))
    meta = {"target": target.identity, "target_name": target_spec, "draft": str(draft_dir),
            "prompts": str(prompts), "temperature": temperature, "max_new_tokens": max_new_tokens,
            "dtype": dtype, "seed": seed, "max_prompts": max_prompts, "max_per_category": max_per_category}
    from eyas.fsio import sha256_file

    # the draft's content, not only its path: a draft retrained in place never reuses old records
    settings_base = {"target_id": target.id, "draft": str(Path(draft_dir).resolve()),
                     "draft_sha256": sha256_file(Path(draft_dir) / "model.safetensors"), "k": k,
                     "temperature": temperature, "max_new_tokens": max_new_tokens, "dtype": dtype,
                     "seed": seed, "prompts": str(Path(prompts).resolve())}
    reports: dict[str, Any] = {}
    engines = ["builtin", "vllm"] if engine == "both" else [engine]
    for name in engines:
        sub = Path(out) / name
        sub.mkdir(parents=True, exist_ok=True)
        settings = {**settings_base, "engine": name}
        if name == "builtin":
            records, extra = _run_builtin(target, draft_dir, questions, tokenizer, stop_ids, k,
                                          temperature, max_new_tokens, dtype, seed, compare_plain,
                                          sub, settings, progress)
        else:
            records, extra = _run_vllm(target, draft_dir, questions, tokenizer, stop_ids, k, temperature,
                                       max_new_tokens, dtype, seed, vllm, sub, settings, progress)
        from eyas.evaluate.report import build_report, write_report

        report = build_report(records, k, {"engine": name, **meta, **extra})
        write_report(sub, report)
        reports[name] = report
    if len(reports) == 2:
        reports["comparison"] = _compare(reports["builtin"], reports["vllm"], Path(out))
    return reports


def _run_builtin(target, draft_dir, questions, tokenizer, stop_ids, k, temperature, max_new_tokens,
                 dtype, seed, compare_plain, sub, settings, progress):
    import torch

    from eyas.draft.model import Eagle3Draft
    from eyas.evaluate.runner import run_questions
    from eyas.evaluate.speculative import BuiltinEngine

    torch_dtype = getattr(torch, dtype)
    model = target.load_model(dtype=torch_dtype)
    draft = Eagle3Draft.from_pretrained(draft_dir, dtype=torch_dtype)
    eng = BuiltinEngine(model, draft, k, temperature, seed, compare_plain)
    try:
        records = run_questions(eng, questions, tokenizer, max_new_tokens, stop_ids,
                                sub / "records.jsonl", settings, progress)
    finally:
        eng.close()
    return records, {"torch_threads": torch.get_num_threads()}


def _run_vllm(target, draft_dir, questions, tokenizer, stop_ids, k, temperature, max_new_tokens,
              dtype, seed, vllm, sub, settings, progress):
    from eyas.evaluate.runner import run_questions
    from eyas.evaluate.vllm_metrics import VllmEngine, VllmSpecEngine, find_vllm_python
    from eyas.export.cli import export_checkpoint

    python = find_vllm_python(vllm)
    exported = export_checkpoint(Path(draft_dir), "vllm", sub / "draft-vllm", str(target.path),
                                 num_speculative_tokens=k, overwrite=True)
    with VllmEngine(python, target.path, exported, k=k, dtype=dtype, seed=seed,
                    log_path=sub / "vllm.log") as eng:
        records = run_questions(VllmSpecEngine(eng, k, temperature, seed), questions, tokenizer,
                                max_new_tokens, stop_ids, sub / "records.jsonl", settings, progress)
        info = dict(eng.info)
    return records, {"vllm_version": info.get("vllm"), "vllm_python": str(python),
                     "exported_draft": str(exported)}


def _compare(builtin: dict, vllm: dict, out: Path) -> dict[str, Any]:
    from eyas.evaluate.report import plot_report

    tb, tv = builtin["overall"]["tau"], vllm["overall"]["tau"]
    same = [a["output_ids"] == b["output_ids"] for a, b in zip(builtin["per_prompt"], vllm["per_prompt"])]
    comp = {"tau_builtin": tb, "tau_vllm": tv,
            "tau_relative_difference": (abs(tb - tv) / tv) if (tb and tv) else None,
            "acceptance_rate_per_pos_builtin": builtin["overall"]["acceptance_rate_per_pos"],
            "acceptance_rate_per_pos_vllm": vllm["overall"]["acceptance_rate_per_pos"],
            "identical_outputs": sum(same), "prompts": len(same),
            "per_category_tau": {c: {"builtin": builtin["per_category"][c]["tau"],
                                     "vllm": vllm["per_category"].get(c, {}).get("tau")}
                                 for c in builtin["per_category"]}}
    path = Path(out) / "comparison.json"
    tmp = path.with_name(f".comparison.json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(comp, indent=2) + "\n")
    os.replace(tmp, path)
    plot_report(builtin, Path(out), others={"vllm": vllm})
    return comp


def register(app: typer.Typer) -> None:
    from eyas.evaluate.prompts import DEFAULT_PROMPTS

    @app.command()
    def evaluate(
        draft: Path = typer.Option(..., help="Draft checkpoint directory (RUN_DIR/draft from `eyas train`)."),
        target: str = typer.Option("smollm2-135m-instruct", help="HF dir, .gguf file or built-in name."),
        prompts: Path = typer.Option(DEFAULT_PROMPTS, help="MT-bench style question.jsonl."),
        engine: str = typer.Option("builtin", help="builtin (HF target + draft here), vllm (vLLM's "
                                   "own metrics), or both (and compare)."),
        out: Path = typer.Option(Path("runs/evaluate"), help="Output directory (reports, plots, resumable records)."),
        k: int = typer.Option(3, "-k", "--num-speculative-tokens", help="Draft tokens per step."),
        temperature: float = typer.Option(0.0, help="0 = greedy; > 0 samples with rejection sampling."),
        max_prompts: int = typer.Option(None, help="Use only the first N questions."),
        max_per_category: int = typer.Option(None, help="Use only the first N questions of each category."),
        max_new_tokens: int = typer.Option(256, help="Tokens generated per turn at most."),
        dtype: str = typer.Option("float32", help="Target/draft dtype for both engines (float32, bfloat16)."),
        vllm: str = typer.Option(None, "--vllm", help="vLLM env: version (.venvs/vllm-VERSION), venv dir or "
                                 "python path (default: $EYAS_VLLM_PYTHON, this Python if it has vLLM, "
                                 "else the newest .venvs/vllm-*)."),
        seed: int = typer.Option(0, help="Sampling seed."),
        no_plain: bool = typer.Option(False, "--no-plain", help="builtin: skip the plain-decoding baseline (no speedup)."),
    ) -> None:
        """Measure a draft: tau (tokens per target forward), acceptance per draft position, speed."""
        if dtype not in ("float32", "bfloat16", "float16"):
            raise EyasError(f"--dtype {dtype!r}: choose float32, bfloat16 or float16")
        reports = evaluate_draft(target, draft, prompts, out, engine, k, temperature, max_prompts,
                                 max_new_tokens, dtype, vllm, seed, not no_plain,
                                 max_per_category=max_per_category)
        for name in ("builtin", "vllm"):
            if name in reports:
                o = reports[name]["overall"]
                rates = ", ".join(f"{r:.2f}" for r in o["acceptance_rate_per_pos"] if r is not None)
                tau = "n/a (no draft rounds)" if o["tau"] is None else f"{o['tau']:.3f}"
                line = f"{name}: tau {tau}  acceptance/pos [{rates}]"
                if o.get("tokens_per_s"):
                    line += f"  {o['tokens_per_s']:.1f} tok/s"
                if o.get("speedup"):
                    line += f"  speedup {o['speedup']:.2f}x"
                typer.echo(line)
        if "comparison" in reports:
            c = reports["comparison"]
            if c["tau_relative_difference"] is not None:
                typer.echo(f"tau builtin vs vllm: relative difference {c['tau_relative_difference']:.3f}, "
                           f"identical outputs {c['identical_outputs']}/{c['prompts']}")
        typer.echo(f"reports in {out}")
