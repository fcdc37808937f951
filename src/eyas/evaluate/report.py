"""Evaluation reports: per-prompt records aggregated per category and overall, JSON + PNG plots.

tau is pooled the way vLLM pools its counters: 1 + sum(accepted) / sum(rounds); the acceptance
rate at draft position j is the fraction of rounds in which position j was accepted.
"""

from __future__ import annotations

import json
import os
import platform
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from eyas.evaluate.step_cost import step_cost_lines, step_costs
from eyas.evaluate.step_profile import profile_line

REPORT_NAME = "report.json"
ENGINE_NAMES = ("builtin", "vllm", "replay")  # the engines that write a report of their own
HOST_DRIFT = 1.2  # the host probes' ratio past which a k's speedups are said to mix host speeds


def host_speeds_mixed(ratio: float | None) -> bool:
    """Whether a k's draft points and the baseline's were timed at two host speeds: the ratio of
    their host probes (``serving_speed.host_probe_ratio``) outside [1 / HOST_DRIFT, HOST_DRIFT]."""
    return ratio is not None and not 1 / HOST_DRIFT <= ratio <= HOST_DRIFT


def aggregate(records: list[dict[str, Any]], k: int) -> dict[str, Any]:
    """Pool per-prompt records (each with rounds, accepted_per_pos, new_tokens, seconds, and
    optionally plain_tokens/plain_seconds/matches_plain) into one summary."""
    rounds = sum(r["rounds"] for r in records)
    per_pos = [sum(r["accepted_per_pos"][j] for r in records) for j in range(k)]
    out: dict[str, Any] = {
        "prompts": len(records),
        "rounds": rounds,
        "new_tokens": sum(r["new_tokens"] for r in records),
        "accepted_tokens": sum(per_pos),
        "accepted_per_pos": per_pos,
        "tau": (1.0 + sum(per_pos) / rounds) if rounds else None,
        "acceptance_rate_per_pos": [a / rounds if rounds else None for a in per_pos],
    }
    secs = [r["seconds"] for r in records if r.get("seconds") is not None]
    if secs and len(secs) == len(records) and sum(secs) > 0:
        out["tokens_per_s"] = out["new_tokens"] / sum(secs)
    plain = [r for r in records if r.get("plain_seconds")]
    if plain and len(plain) == len(records):
        out["plain_tokens_per_s"] = sum(r["plain_tokens"] for r in plain) / sum(r["plain_seconds"] for r in plain)
        if "tokens_per_s" in out:
            out["speedup"] = out["tokens_per_s"] / out["plain_tokens_per_s"]
    matches = [r["matches_plain"] for r in records if r.get("matches_plain") is not None]
    if matches:
        out["matches_plain"] = sum(matches)
    return out


def build_report(records: list[dict[str, Any]], k: int, meta: dict[str, Any]) -> dict[str, Any]:
    by_cat: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_cat[r["category"]].append(r)
    return {
        "kind": "eyas-evaluation",
        **meta,
        "num_speculative_tokens": k,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "overall": aggregate(records, k),
        "per_category": {c: aggregate(rs, k) for c, rs in sorted(by_cat.items())},
        "per_prompt": records,
    }


def greedy_vs_plain(records: list[dict[str, Any]], plain: dict[str, list[int]]) -> dict[str, Any]:
    """Turn by turn, the answers decoded with the draft against the same engine's without it (both
    greedy; ``plain`` maps "question_id/turn" to output ids): how many are identical, and where the
    others first differ. Speculative decoding leaves greedy outputs unchanged in exact arithmetic;
    in bf16 the verification's batched forward can flip a near-tie, and a later turn then differs
    wherever its history does."""
    diffs, turns, same, first, first_same = [], 0, 0, 0, 0
    for r in records:
        other = plain.get(f"{r['question_id']}/{r['turn']}")
        if other is None:
            continue
        ids = r["output_ids"]
        at = next((i for i, (a, b) in enumerate(zip(ids, other)) if a != b), None)
        if at is None and len(ids) != len(other):
            at = min(len(ids), len(other))
        turns += 1
        same += at is None
        if r["turn"] == 0:
            first, first_same = first + 1, first_same + (at is None)
        if at is not None:
            diffs.append(at)
    diffs.sort()
    return {
        "turns": turns,
        "identical": same,
        "first_turns": first,
        "first_turns_identical": first_same,
        # the median position of the first differing token in the turns that differ
        "first_difference_median": diffs[len(diffs) // 2] if diffs else None,
    }


def serving_summary(reports: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The vllm reports of each k (k -> report, each with its ``serving_speed``) side by side:

    - ``serving_speed_by_k``: one row per k and concurrency, output tokens/s with and without the
      draft, their ratio (``speedup``) and the tau of the timed requests (``tau_timed``);
    - ``best_k``: per concurrency, the k of the highest measured speedup with that speedup, and
      ``pays``: whether it is above 1 (where no k speeds serving up, the least slow is named, unpaid);
      on a tie the smaller k (fewer draft tokens to propose);
    - ``recommended_k``: the one k to serve with (:func:`recommended_k`);
    - ``tau_by_k``: each k's tau in its evaluation;
    - ``step_cost``: per concurrency, each step's time and the tau each k needs to pay
      (:mod:`eyas.evaluate.step_cost`);
    - ``step_profile`` (with ``--speed-profile-steps``): each k's decoding step at 1 request, part by
      part, and the baseline's (:mod:`eyas.evaluate.step_profile`)."""
    rows = []
    for k, rep in sorted(reports.items()):
        speed = rep.get("serving_speed") or {}
        for d, p in zip(speed.get("draft", []), speed.get("plain", [])):
            with_, without = d.get("tokens_per_s"), p.get("tokens_per_s")
            rows.append(
                {
                    "k": k,
                    "concurrency": d["concurrency"],
                    "tokens_per_s_draft": with_,
                    "tokens_per_s_plain": without,
                    "speedup": with_ / without if with_ and without else None,
                    # tokens per verification round over the timed waves (vLLM's counters), where known
                    "tau_timed": d.get("acceptance_length"),
                    # this k's host probes over the baseline's (older reports have none)
                    **({"host_probe_ratio": speed["host_probe_ratio"]} if "host_probe_ratio" in speed else {}),
                }
            )
    rows.sort(key=lambda r: (r["concurrency"], r["k"]))
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        b = best.get(str(r["concurrency"]))
        if r["speedup"] is not None and (b is None or r["speedup"] > b["speedup"]):
            best[str(r["concurrency"])] = {"k": r["k"], "speedup": r["speedup"], "pays": r["speedup"] > 1.0}
    tau_by_k = {str(k): rep["overall"]["tau"] for k, rep in sorted(reports.items())}
    out = {
        "serving_speed_by_k": rows,
        "best_k": best,
        **({"recommended_k": rec} if (rec := recommended_k(rows)) else {}),
        "tau_by_k": tau_by_k,
        "step_cost": step_costs(rows, tau_by_k),
    }
    speeds = {k: rep.get("serving_speed") or {} for k, rep in sorted(reports.items())}
    by_k = {str(k): sp["draft_profile"] for k, sp in speeds.items() if sp.get("draft_profile")}
    plain = next((sp["plain_profile"] for sp in speeds.values() if sp.get("plain_profile")), None)
    if by_k or plain:
        out["step_profile"] = {"plain": plain, "by_k": by_k}
    return out


def finished_summary(report: dict[str, Any], eval_dir: Path | None) -> tuple[dict[str, Any], list[int]]:
    """``report`` (OUT/vllm/report.json of the -k run) with the summary of :func:`serving_summary`
    over the k that were timed, and those k: the -k run's and each OUT/k<N>/vllm/report.json's of
    the same draft (the -k run's baseline is theirs too; ``eval_dir`` None: the -k run's alone). A
    run stopped between two k has no summary yet; this is the one it would have over the k done,
    and what a single k's report gives. A k's report measured otherwise (another draft, prompts,
    dtype, vLLM) is left out."""
    same = ("draft_sha256", "prompts", "max_new_tokens", "temperature", "dtype", "vllm_version")
    by_k = {report["num_speculative_tokens"]: report} if (report.get("serving_speed") or {}).get("plain") else {}
    for sub in sorted(Path(eval_dir).glob(f"k*/vllm/{REPORT_NAME}")) if eval_dir is not None else ():
        other = json.loads(sub.read_text())
        if (other.get("serving_speed") or {}).get("draft") and all(other.get(x) == report.get(x) for x in same):
            by_k[other["num_speculative_tokens"]] = other
    return {**report, **serving_summary(by_k)}, sorted(by_k)


def recommended_k(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The k to serve with, of those timed at every measured concurrency: the one whose slowest
    concurrency is fastest, as one ``vllm serve`` line meets every load (the smaller k on a tie).
    The best k at 1 request alone may slow a loaded server: a longer draft pays at batch 1 and
    costs more in a full batch. None where no k has a speedup at every concurrency."""
    concurrencies = sorted({r["concurrency"] for r in rows})
    by_k: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        if r["speedup"] is not None:
            by_k[r["k"]][r["concurrency"]] = r
    full = {k: rs for k, rs in by_k.items() if sorted(rs) == concurrencies}
    if not full:
        return None
    worst = {k: min(r["speedup"] for r in rs.values()) for k, rs in full.items()}
    k = max(sorted(worst), key=worst.__getitem__)
    ratio = next(iter(full[k].values())).get("host_probe_ratio")
    return {
        "k": k,
        "speedup": {str(c): full[k][c]["speedup"] for c in concurrencies},
        "worst": worst[k],
        "pays": worst[k] > 1.0,
        # its points and the baseline's at two host speeds: its speedups to be timed again
        "host_speeds_mixed": host_speeds_mixed(ratio),
    }


def write_report(out_dir: Path, report: dict[str, Any]) -> Path:
    """Write report.json atomically, then the two plots beside it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / REPORT_NAME
    tmp = path.with_name(f".{REPORT_NAME}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)
    plot_report(report, out_dir)
    return path


def plot_report(report: dict[str, Any], out_dir: Path, others: dict[str, dict[str, Any]] | None = None) -> list[Path]:
    """acceptance_per_position.png and tau_per_category.png; ``others`` adds reports to compare
    (label -> report), e.g. the vLLM engine's next to the built-in one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {report.get("engine", "eyas"): report, **(others or {})}
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rep in series.items():
        rates = rep["overall"]["acceptance_rate_per_pos"]
        xs = list(range(1, len(rates) + 1))
        ax.plot(
            xs,
            [r if r is not None else float("nan") for r in rates],
            marker="o",
            label=f"{label} (tau={_fmt(rep['overall']['tau'])})",
        )
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.02)
    ax.set_xticks(xs)
    ax.set_title(_title(report))
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(_save(fig, Path(out_dir) / "acceptance_per_position.png"))

    cats = sorted({c for rep in series.values() for c in rep["per_category"]})
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(cats) + 2), 4))
    width = 0.8 / len(series)
    for i, (label, rep) in enumerate(series.items()):
        taus = [rep["per_category"].get(c, {}).get("tau") or 0 for c in cats]
        ax.bar([x + i * width for x in range(len(cats))], taus, width=width, label=label)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(cats))])
    ax.set_xticklabels(cats, rotation=30, ha="right")
    ax.set_ylabel("acceptance length tau")
    ax.set_title(_title(report))
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    paths.append(_save(fig, Path(out_dir) / "tau_per_category.png"))
    return paths


def _title(report: dict[str, Any]) -> str:
    k = report.get("num_speculative_tokens")
    t = report.get("temperature", 0)
    return f"{report.get('target_name', 'target')}, k={k}, T={t}"


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.png")
    fig.tight_layout()
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def summary_lines(reports: dict[str, Any], out: Path, top: bool = True) -> list[str]:
    """What `eyas evaluate` and `eyas pipeline` print of ``evaluate``'s reports: tau and acceptance per
    engine, the two engines compared, vLLM's serving speed, then each ``also_k`` run's own, then the
    best k at each concurrency."""
    lines = []
    ks = [reports[n].get("num_speculative_tokens") for n in ENGINE_NAMES if n in reports]
    label = f"k={ks[0]} " if ks else ""
    for name in ENGINE_NAMES:
        if name not in reports:
            continue
        rep, o = reports[name], reports[name]["overall"]
        rates = ", ".join(f"{r:.3f}" for r in o["acceptance_rate_per_pos"] if r is not None)
        tau = "n/a (no draft rounds)" if o["tau"] is None else f"{o['tau']:.3f}"
        line = f"{label}{name}: tau {tau}, acceptance per position [{rates}]"
        if rep.get("training_tau") is not None:
            on = rep.get("training_tau_on") or {}
            line += (
                f" (measured while training: {rep['training_tau']:.3f}, on {on.get('turns')} turns of "
                f"{on.get('prompts')}, {on.get('max_new_tokens')} tokens)"
            )
        if o.get("tokens_per_s"):
            line += f", {o['tokens_per_s']:.1f} tok/s"
        if o.get("speedup"):
            line += f", speedup {o['speedup']:.2f}x"
        lines.append(line)
    c = reports.get("comparison")
    if c and c["tau_relative_difference"] is not None:
        lines.append(
            f"{label}tau builtin vs vllm: relative difference {c['tau_relative_difference']:.3f}, "
            f"identical outputs {c['identical_outputs']}/{c['prompts']}"
        )
    vllm = reports.get("vllm", {})
    g = vllm.get("greedy_vs_plain")
    if g and g["turns"]:
        lines.append(
            f"{label}vllm greedy answers identical with and without the draft: {g['identical']}/{g['turns']} "
            f"turns ({g['first_turns_identical']}/{g['first_turns']} first turns)"
        )
    speed = vllm.get("serving_speed")
    for d, p in zip(speed["draft"], speed.get("plain", [])) if speed else ():
        lines.append(
            f"{label}vllm serving, {d['concurrency']} concurrent: {d['tokens_per_s']:.0f} tok/s with "
            f"the draft, {p['tokens_per_s']:.0f} without ({d['tokens_per_s'] / p['tokens_per_s']:.2f}x)"
        )
    for key, name in (("draft_profile", f"{label}with the draft".lstrip()), ("plain_profile", "no draft")):
        prof = (speed or {}).get(key)
        if prof:
            lines.append(
                profile_line(name, prof) if "parts_ms" in prof else f"vllm profile, {name}: {prof.get('error')}"
            )
    for key, rep in reports.items():
        if key.startswith("k") and key[1:].isdigit():  # also_k: that k's own reports, in OUT/k<N>/
            lines += summary_lines(rep, Path(out) / key, top=False)
    lines += best_k_lines(vllm.get("best_k") or {})
    lines += recommended_k_lines(vllm.get("recommended_k"), vllm.get("serving_speed_by_k") or [])
    lines += step_cost_lines(vllm.get("step_cost") or {})
    if top:
        lines.append(f"reports (report.json, acceptance_per_position.png, tau_per_category.png) in {out}")
    return lines


def best_k_lines(best: dict[str, dict[str, Any]]) -> list[str]:
    """The best k per concurrency (:func:`serving_summary`), a line each."""
    lines = []
    for c, b in sorted(best.items(), key=lambda kv: int(kv[0])):
        if b["pays"]:
            lines.append(f"vllm serving, {c} concurrent: best k={b['k']}, {b['speedup']:.2f}x")
        else:
            lines.append(
                f"vllm serving, {c} concurrent: no k speeds it up (the least slow: k={b['k']}, "
                f"{b['speedup']:.2f}x); serve without the draft at this load"
            )
    return lines


def speedups_at(rec: dict[str, Any]) -> str:
    """A recommended k's speedup at each concurrency, e.g. ``1.48x at 1, 1.52x at 32``."""
    return ", ".join(f"{x:.2f}x at {c}" for c, x in rec["speedup"].items())


def recommended_k_lines(rec: dict[str, Any] | None, rows: list[dict[str, Any]]) -> list[str]:
    """The k to serve with (:func:`recommended_k`), and each k of ``rows`` (``serving_speed_by_k``)
    whose speedups mix two host speeds."""
    lines = []
    if rec and len(rec["speedup"]) > 1:  # at one concurrency it is that concurrency's best k
        lines.append(
            f"vllm serving: serve with k={rec['k']}, the best at its slowest load ({speedups_at(rec)} concurrent)"
            + ("" if rec["pays"] else "; it slows the slowest load down")
        )
    mixed = sorted({r["k"]: r for r in rows if host_speeds_mixed(r.get("host_probe_ratio"))}.items())
    if mixed:
        lines.append(
            "vllm serving: timed at two host speeds (host probe ratio "
            + ", ".join(f"k={k} {r['host_probe_ratio']:.2f}" for k, r in mixed)
            + f", outside {1 / HOST_DRIFT:.2f}-{HOST_DRIFT:.2f}): time those k again before trusting their speedups"
        )
    return lines
