"""Numbers of benchmarks/gpu_job.md's pipeline section, from the records the H200 calls brought back.

python3 benchmarks/gpu_job/summarize_pipeline.py benchmarks/gpu_job/pipeline-2026-12-01
"""

import json
import sys
from pathlib import Path


def records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()[1:]]


def tau(rs: list[dict]) -> float:
    return 1 + sum(sum(r["accepted_per_pos"]) for r in rs) / sum(r["rounds"] for r in rs)


d = Path(sys.argv[1])
b = records(d / "builtin-records.jsonl")
v = records(d / "vllm-records-partial.jsonl")
by = {(r["question_id"], r["turn"]): r for r in b}
same = [by[(r["question_id"], r["turn"])] for r in v]
# the held-out prediction of the eyas that ran this job (since removed from eyas train)
pred = json.loads((d / "prediction.json").read_text())["predicted_tau"]
out = {
    "k": 5,
    "builtin_turns": len(b),
    "builtin_tau": tau(b),
    "builtin_acceptance_per_pos": [
        sum(r["accepted_per_pos"][j] for r in b) / sum(r["rounds"] for r in b) for j in range(5)
    ],
    "builtin_plain_identical": sum(bool(r.get("matches_plain")) for r in b),
    "vllm_turns": len(v),
    "vllm_tau": tau(v),
    "builtin_tau_same_turns": tau(same),
    "identical_outputs_same_turns": sum(r["output_ids"] == by[(r["question_id"], r["turn"])]["output_ids"] for r in v),
    "predicted_tau_k5": pred["5"],
    "predicted_over_builtin": pred["5"] / tau(b) - 1,
}
out["tau_relative_difference_same_turns"] = abs(out["builtin_tau_same_turns"] - out["vllm_tau"]) / out["vllm_tau"]
(d / "tau.json").write_text(json.dumps(out, indent=1) + "\n")
print(json.dumps(out, indent=1))
