"""The table of every measured draft in summary.json, written into RESULTS.md between its markers.

One row per draft and prompt set: tau at each k measured, with its 95% CI over questions ("[-]"
where the per-turn records did not come home), and what stands behind it (trainer, budget, steps,
conversations, turns). RESULTS.md's table is this script's output; after add_summary.py or
recipe/to_summary.py:

    python benchmarks/quality/summary_table.py            # rewrite the table in RESULTS.md
    python benchmarks/quality/summary_table.py --print    # print it only
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- summary.json table: begin -->", "<!-- summary.json table: end -->"


def table(rows: list[dict]) -> str:
    ks = sorted({r["k"] for r in rows})
    drafts: dict[tuple[str, str], dict[int, dict]] = {}
    for r in rows:
        drafts.setdefault((r["name"], r["prompt_set"]), {})[r["k"]] = r
    head = ["draft", "target", "trainer", "budget s", "steps", "conversations", "prompt set", "turns"]
    lines = [
        "| " + " | ".join(head + [f"tau k={k} [95% CI]" for k in ks]) + " |",
        "|" + "---|" * (len(head) + len(ks)),
    ]
    for (name, prompt_set), by_k in drafts.items():
        first = next(iter(by_k.values()))
        cells = [
            name,
            first["target"],
            first["trainer"],
            "-" if first["budget_s"] is None else f"{first['budget_s']:.0f}",  # a run of --max-steps
            f"{first['steps']:,}",
            f"{first['data_conversations']:,}",
            prompt_set,
            str(first["turns"]),
        ]
        for k in ks:
            r = by_k.get(k)
            if r is None:
                cells.append("-")
            elif r.get("tau_ci_low") is None:  # no per-turn records came home: the tau alone
                cells.append(f"{r['tau']:.3f} [-]")
            else:
                cells.append(f"{r['tau']:.3f} [{r['tau_ci_low']:.3f}, {r['tau_ci_high']:.3f}]")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write(results: Path, text: str) -> None:
    doc = results.read_text()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{results}: no table markers ({BEGIN} ... {END}); add them where the table goes")
    a, b = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    results.write_text(doc[:a] + "\n" + text + doc[b:])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--summary", type=Path, default=HERE / "summary.json")
    ap.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    ap.add_argument("--print", action="store_true", help="print the table, write nothing")
    a = ap.parse_args()
    text = table(json.loads(a.summary.read_text()))
    if a.print:
        print(text, end="")
    else:
        write(a.results, text)
        print(f"wrote the table of {a.summary} into {a.results}")
