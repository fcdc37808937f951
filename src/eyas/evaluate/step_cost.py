"""Where serving time goes, from what `eyas evaluate --engine vllm` measures at several k.

At ``c`` concurrent requests a plain decoding step yields ``c`` tokens, a speculative one ``c * tau``
(tau counts the verified bonus token), so the measured output tokens/s give each step's time. The
tau is the timed requests' own (``tau_timed``, vLLM's counters over the timed waves) where the row
has it: the speed prompts (first turns) are not the acceptance pass's, and their tau differs. Else,
the acceptance pass's tau at that k:
``plain_ms = 1000 c / T_plain`` and ``step_ms(k) = 1000 c tau_k / T_k``. A straight line through
``step_ms`` over k splits a speculative step into its fixed part (the target's forward over the k+1
tokens, scheduling and sampling; ``fixed_ms``) and the draft's share per proposed token
(``per_draft_token_ms``). A draft pays at k when its tau is above ``step_ms(k) / plain_ms``: the
break-even tau, which the fit extends to every k.
"""

from __future__ import annotations

import statistics
from typing import Any


def step_costs(rows: list[dict[str, Any]], tau_by_k: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Per concurrency (its string, as in ``best_k``): the plain step's ms, each k's step ms, tau and
    break-even tau, and the line ``fixed_ms + per_draft_token_ms * k`` where two or more k were
    measured. ``rows`` are ``serving_speed_by_k``'s (k, concurrency, tokens/s with and without)."""
    out: dict[str, dict[str, Any]] = {}
    for c in sorted({r["concurrency"] for r in rows}):
        mine = [
            r
            for r in rows
            if r["concurrency"] == c
            and r["tokens_per_s_draft"]
            and r["tokens_per_s_plain"]
            and (r.get("tau_timed") or tau_by_k.get(str(r["k"]))) is not None
        ]
        if not mine:
            continue
        plain_ms = sum(1000.0 * c / r["tokens_per_s_plain"] for r in mine) / len(mine)
        steps = []
        for r in sorted(mine, key=lambda r: r["k"]):
            timed = r.get("tau_timed")
            tau = timed or tau_by_k[str(r["k"])]
            ms = 1000.0 * c * tau / r["tokens_per_s_draft"]
            steps.append(
                {
                    "k": r["k"],
                    "step_ms": ms,
                    "tau": tau,
                    "tau_from": "timed requests" if timed else "acceptance pass",
                    "breakeven_tau": ms / plain_ms,
                }
            )
        entry: dict[str, Any] = {"plain_step_ms": plain_ms, "by_k": steps}
        if len(steps) >= 2:  # distinct k: one row per k and concurrency
            fit = statistics.linear_regression([s["k"] for s in steps], [s["step_ms"] for s in steps])
            entry["fixed_ms"], entry["per_draft_token_ms"] = fit.intercept, fit.slope
        out[str(c)] = entry
    return out


def step_cost_lines(costs: dict[str, dict[str, Any]]) -> list[str]:
    """A line per concurrency: what a step costs and the tau each k needs to pay."""
    lines = []
    for c, e in sorted(costs.items(), key=lambda kv: int(kv[0])):
        parts = [f"plain step {e['plain_step_ms']:.2f} ms"]
        if "fixed_ms" in e:
            parts.append(f"speculative {e['fixed_ms']:.2f} ms + {e['per_draft_token_ms']:.2f} ms per draft token")
        need = ", ".join(f"k={s['k']} {s['breakeven_tau']:.2f} (has {s['tau']:.2f})" for s in e["by_k"])
        lines.append(f"vllm serving, {c} concurrent: {'; '.join(parts)}; tau to break even: {need}")
    return lines
