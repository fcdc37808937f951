"""Markdown summary of a run_quality.py results.json (for benchmarks/quality/RESULTS.md).

Usage: python summarize.py results.json [--command "the device call"] [--machine "1x H200"]
Prints only what the file holds; fields a run did not produce are shown as "-".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _f(x, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _rates(r: dict | None) -> str:
    if not r or not r.get("acceptance_rate_per_pos"):
        return "-"
    return " / ".join(_f(v, 2) for v in r["acceptance_rate_per_pos"])


def summarize(res: dict, command: str | None = None, machine: str | None = None) -> str:
    am = res.get("args", {}).get("main", {})
    ar = res.get("args", {}).get("rest", {})
    ev = res.get("evaluations", {})
    lines = [f"## Quality run {res.get('started', {}).get('main', '?')}", ""]
    if machine:
        lines.append(f"Machine: {machine}.")
    if command:
        lines.append(f"Commands: {command}")
    el = res.get("elapsed_s", {})
    lines.append(
        f"Elapsed: main phase {_f(el.get('main'), 0)} s, rest phase {_f(el.get('rest'), 0)} s. "
        f"Errors: {res.get('errors') or 'none'}."
    )
    lines.append("")
    data = res.get("data", {})
    if data:
        lines += [
            "| data | conversations | tokens | trained tokens | draft vocab | vocab coverage |",
            "|---|---|---|---|---|---|",
        ]
        for name, m in data.items():
            c = m.get("counts") or {}
            lines.append(
                f"| {name} | {_f(c.get('samples'))} | {_f(c.get('tokens'))} | {_f(c.get('trained_tokens'))} "
                f"| {_f(m.get('draft_vocab_size'))} | {_f(m.get('coverage'))} |"
            )
        lines.append("")
    em, sm = res.get("eyas_main", {}), res.get("spec_main", {})
    run = sm.get("run", {}) if isinstance(sm, dict) else {}
    es = em.get("summary") or {}
    lines += [
        "| main run | budget s | steps | steady s/step | setup s | wall s | notes |",
        "|---|---|---|---|---|---|---|",
        f"| eyas | {_f(am.get('main_budget_s'), 0)} | {_f(es.get('steps', em.get('max_steps')))} "
        f"| {_f(em.get('probe', {}).get('step_s'))} | {_f(em.get('probe', {}).get('setup_s'), 1)} "
        f"| {_f(em.get('wall_s'), 1)} | rc {em.get('rc')}; {' '.join(em.get('args', []))} |",
        f"| speculators 0.9.0 | {_f(sm.get('budget_s'), 0)} | {_f(run.get('steps'))} "
        f"| {_f(run.get('step_s_median'))} | {_f(run.get('setup_s'), 1)} | {_f(run.get('wall_s'), 1)} "
        f"| plan {sm.get('plan')}; first step {_f(run.get('first_step_s'), 1)} s; "
        f"interrupted {run.get('interrupted')} |",
        "",
    ]
    lines += ["| draft | k | tau | acceptance rate per position | prompts (question turns) |", "|---|---|---|---|---|"]
    for name, r in ev.items():
        k = name.rsplit("_k", 1)[-1]
        done = "" if r.get("complete", True) else " (cut at the deadline)"
        lines.append(
            f"| {name.rsplit('_k', 1)[0]} | {k} | {_f(r.get('tau'))} | {_rates(r)} | {_f(r.get('prompts'))}{done} |"
        )
    v = res.get("verdict", {})
    if v:
        lines.append("")
        for k, d in v.items():
            lines.append(
                f"* {k}: eyas tau {_f(d['eyas_tau'])} vs speculators {_f(d['speculators_tau'])}: "
                f"{d['difference']:+.3f} ({100 * d['relative']:+.1f}%), "
                f"{'eyas >= speculators' if d['eyas_at_least_speculators'] else 'eyas BELOW speculators'}"
            )
    abl = res.get("ablations")
    if abl:
        lines.append(
            f"\nAblations: {abl.get('steps')} steps each (the main eyas run's), two per GPU; "
            f"reference: {abl.get('reference')}; evaluated with k in {ar.get('abl_ks')}, "
            f"{ar.get('abl_eval_max_per_category')} questions per category."
        )
        lines += ["", "| ablation | data | wall s | rc |", "|---|---|---|---|"]
        for name, x in abl.get("runs", {}).items():
            lines.append(f"| {name} | {x.get('data')} | {_f(x.get('wall_s'), 0)} | {x.get('rc')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--command", default=None)
    ap.add_argument("--machine", default=None)
    a = ap.parse_args(argv)
    sys.stdout.write(summarize(json.loads(a.results.read_text()), a.command, a.machine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
