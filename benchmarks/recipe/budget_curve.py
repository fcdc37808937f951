"""Tau against the training budget: the recipe's end points, one training per point (issue 30).

Each line of ``results-*.jsonl`` that trained the recipe of ``README.md`` ("The recipe now") on all
of ShareGPT to a budget is one end point: greedy answers with or without the loops masked
(`sweep.py`'s lines), or the configured job's sampled answers (`keep_pipeline.py`'s lines of `eyas
pipeline` runs). Each is a training to its own budget, so annealed at its end. They are grouped by
data and GPU kind, and drawn against the budget with each group's mean, beside the curves of tau
while training of the runs of 10 minutes or more that kept one (``evals/<run>/tau_curve.jsonl``;
the LR held at its peak until the last 20% of that run's budget, so below the end points):

    python benchmarks/recipe/budget_curve.py    # -> budget_curve.json, budget_curve.png

A later end point (20 or 30 minutes) needs only its line in a results file.
"""

from __future__ import annotations

import datetime
import json
import re
import statistics
import subprocess
from pathlib import Path

from results import runs

HERE = Path(__file__).resolve().parent
RECIPE = "--ttt-steps 3 --lr 1e-3 --batch-size 8 --optimizer muon --schedule wsd"
DATA = {"prep-regen": "loops trained", "prep-regen-ml": "loops masked"}
PIPELINE = "eyas train's CUDA defaults"  # keep_pipeline.py's args: the recipe, as eyas pipeline ran it
SETS = ("mt_bench", "humaneval")
K = "5"
CURVE_MIN_S = 600  # shorter runs' curves would crowd the picture


def kind(machine: str) -> str:
    for gpu in ("H200", "H100"):
        if gpu in machine:
            return gpu
    return machine


def data_of(r: dict) -> str | None:
    """The group of a results line that trained the recipe on all of ShareGPT; None for the rest."""
    args = re.sub(r" --seed \d+", "", r["args"])
    if args == RECIPE:
        return DATA.get(Path(r["data"]).name)
    regen = r.get("regenerate") or {}
    if args == PIPELINE and regen.get("temperature", 0) > 0:
        trimmed = ", trimmed" if r.get("trimmed_leading_assistant") else ""
        return f"sampled{trimmed}, loops " + ("masked" if regen.get("loop_tokens_masked") else "trained")
    return None


def end_points() -> list[dict]:
    points = []
    for _, r in runs():
        data = data_of(r)
        if data is None or not r.get("budget_s") or not r.get("finite"):
            continue
        points.append(
            {
                "run": r["name"],
                "data": data,
                "gpu": kind(r.get("machine", "")),
                "budget_s": r["budget_s"],
                "steps": r["steps"],
                "epochs": r.get("epochs"),
                "tau_k5": {s: round(r["tau"][s][K]["tau"], 3) for s in SETS if s in r["tau"]},
                "date": r["date"],
            }
        )
    return points


def groups(points: list[dict]) -> list[dict]:
    out: dict[tuple, list[dict]] = {}
    for p in points:
        out.setdefault((p["data"], p["gpu"], p["budget_s"]), []).append(p)
    return [group(d, g, b, ps) for (d, g, b), ps in sorted(out.items())]


def group(data: str, gpu: str, budget_s: float, ps: list[dict]) -> dict:
    """One group's mean and range per prompt set, over the points that measured it (a run may lack HumanEval)."""
    by_set = {s: t for s in SETS if (t := [p["tau_k5"][s] for p in ps if s in p["tau_k5"]])}
    return {
        "data": data,
        "gpu": gpu,
        "budget_s": budget_s,
        "trainings": len(ps),
        "tau_k5_mean": {s: round(statistics.mean(t), 3) for s, t in by_set.items()},
        "tau_k5_range": {s: [min(t), max(t)] for s, t in by_set.items()},
    }


def curve(run: str) -> list[tuple[float, float]]:
    path = HERE / "evals" / run / "tau_curve.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [(r["train_s"] / 60, r["tau"][K]) for r in rows]


def plot(points: list[dict], summary: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    style = {
        ("loops masked", "H100"): "tab:blue",
        ("loops trained", "H100"): "tab:orange",
        ("loops trained", "H200"): "tab:red",
        ("loops masked", "H200"): "tab:cyan",
        ("sampled, loops masked", "H100"): "tab:green",
        ("sampled, loops masked", "H200"): "tab:olive",
        ("sampled, trimmed, loops masked", "H100"): "tab:purple",
    }
    curves = {p["run"]: c for p in points if p["budget_s"] >= CURVE_MIN_S and (c := curve(p["run"]))}
    for ax, s in zip(axes, SETS):
        for (d, g), color in style.items():
            ps = [p for p in points if (p["data"], p["gpu"]) == (d, g) and s in p["tau_k5"]]
            if not ps:
                continue
            ax.scatter([p["budget_s"] / 60 for p in ps], [p["tau_k5"][s] for p in ps], color=color, s=18, alpha=0.6)
            means = [m for m in summary if (m["data"], m["gpu"]) == (d, g) and s in m["tau_k5_mean"]]
            ax.plot(
                [m["budget_s"] / 60 for m in means],
                [m["tau_k5_mean"][s] for m in means],
                "-o",
                color=color,
                label=f"{d}, {g} (end points)",
            )
        if s == "mt_bench":
            for (run, c), ls in zip(curves.items(), (":", "--", "-.", (0, (1, 3)), (0, (5, 1)))):
                ax.plot(*zip(*c), linestyle=ls, color="gray", label=f"{run}: tau while training")
        ax.set_title(f"{s}, k={K}")
        ax.set_xscale("log")  # budgets from 2 to 30 minutes, each point a training of its own
        ax.set_xticks([1, 2, 5, 10, 20, 30], ["1", "2", "5", "10", "20", "30"])
        ax.set_xlabel("training budget (minutes of steps, log scale)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("tau (replay, bf16, 256 tokens)")
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle("SmolLM2-135M: the recipe's tau against its budget (one training per dot)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    points = end_points()
    summary = groups(points)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout
    record = {
        "what": f"tau at k={K} against the training budget, the recipe's end points (budget_curve.py)",
        "date": datetime.date.today().isoformat(),
        "commit": commit.strip(),
        "command": "python benchmarks/recipe/budget_curve.py",
        "groups": summary,
        "points": points,
    }
    (HERE / "budget_curve.json").write_text(json.dumps(record, indent=1) + "\n")
    plot(points, summary, HERE / "budget_curve.png")
    for m in summary:
        print(
            f"{m['data']:30} {m['gpu']} {m['budget_s'] / 60:4.1f} min  n={m['trainings']}  "
            + "  ".join(f"{s} {t:.3f}" for s, t in m["tau_k5_mean"].items())
        )


if __name__ == "__main__":
    main()
