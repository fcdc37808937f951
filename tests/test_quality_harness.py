"""benchmarks/quality/run_quality.py end to end on the CPU with the tiny target: both trainers, the
curve over their checkpoints on two prompt sets, and the paired rows, over two sessions joined by
benchmarks/gpu/stage_quality.sh. The harness drives eyas's CLI
as a subprocess, so a flag eyas drops or renames surfaces here rather than on the GPU (it once
passed a removed `--max-train-seconds` and went on with no eyas draft)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPEC_PY = ROOT / ".venvs" / "speculators" / "bin" / "python"
HARNESS = ROOT / "benchmarks" / "quality" / "run_quality.py"
STAGE = ROOT / "benchmarks" / "gpu" / "stage_quality.sh"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SPEC_PY.exists(), reason="no .venvs/speculators (speculators==0.9.0)"),
]


def _conversations(path: Path, n: int = 24) -> Path:
    words = "the draft learns what the target says next when it reads the hidden states".split()
    with path.open("w") as f:
        for i in range(n):
            q = " ".join(words[(i + j) % len(words)] for j in range(6))
            a = " ".join(words[(2 * i + j) % len(words)] for j in range(40))
            msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            f.write(json.dumps({"id": f"c{i}", "messages": msgs}) + "\n")
    return path


def _first_of_each_category(src: Path, dst: Path, per_set: int | None = None) -> Path:
    seen: dict[str, int] = {}
    keep = []
    for line in src.read_text().splitlines():
        q = json.loads(line)
        if seen.get(q["category"], 0) < 1:
            seen[q["category"]] = 1
            keep.append(line)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("\n".join(keep[:per_set]) + "\n")
    return dst


def test_quality_comparison_runs_through_on_the_cpu_over_two_sessions(tmp_path, tiny_llama_dir):
    """Session A trains both, speculators stopped part-way (--spec-stop-after-s), and evaluates;
    stage_quality.sh carries the comparison to session B on a wiped disk, which makes the data
    again, resumes speculators and evaluates; B's results hold both sessions' curves."""
    # enough conversations that one epoch of speculators' (its plan's least) outlasts its 3-s stop
    conv = _conversations(tmp_path / "conversations.jsonl", 64)
    mt = _first_of_each_category(ROOT / "data" / "mt_bench" / "question.jsonl", tmp_path / "mt_bench" / "q.jsonl", 3)
    he = _first_of_each_category(ROOT / "data" / "humaneval" / "question.jsonl", tmp_path / "humaneval" / "q.jsonl")
    work, out, stage = tmp_path / "work", tmp_path / "out", tmp_path / "stage"
    common = [sys.executable, str(HARNESS), "--target", str(tiny_llama_dir), "--prompts", str(mt)]
    common += ["--work", str(work), "--out", str(out), "--gpus", "0", "--python", sys.executable]
    common += ["--spec-python", str(SPEC_PY), "--ablations", "", "--eval-ks", "3,5", "--curve-k", "3"]
    common += ["--second-prompts", str(he), "--eval-dtype", "float32", "--eval-max-new", "8"]
    common += ["--eval-max-per-category", "1", "--curve-max-per-category", "1", "--marks-s", "4"]
    data = ["--regenerated", str(conv), "--max-length", "128", "--vocab", "64", "--mask-loops"]

    def phase(*args: str) -> None:
        r = subprocess.run([*common, *args], capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    phase(
        "--phase", "main", *data, "--main-budget-s", "16", "--eyas-probe-steps", "2", "--spec-probe-steps", "5",
        "--spec-workers", "0", "--eyas-args", "--tokens-per-batch 128", "--curve-every-s", "3",
        "--spec-save-every-s", "2", "--spec-stop-after-s", "3",
        "--spec-args", "--loss-implementation eager --total-seq-len 64",
    )  # fmt: skip
    phase("--phase", "rest", "--curve-every-s", "3")
    # the probe's steady step time plans the run to about the budget, so the stop comes well before its end
    res_a = json.loads((out / "results.json").read_text())
    assert json.loads((work / "prep_regen" / "manifest.json").read_text())["settings"]["mask_loops"] is True
    stop = res_a["spec_main"]["stopped"]
    assert stop and not res_a["spec_main"].get("draft")  # a session's stop, not a draft
    assert res_a["curve"]["speculators"] and res_a["curve"]["eyas"]

    # the stage: the small results, the record, speculators' stop checkpoint; no data, no kept saves
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # python3 with eyas
    r = subprocess.run(["bash", str(STAGE), str(work), str(stage)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    rel = Path(stop["checkpoint"]).relative_to(work)
    assert (stage / rel / "training_state.json").is_file()
    assert not any((stage / x).exists() for x in ("store_regenerated", "spec_data", "spec_main/kept", "prep_regen"))
    assert (stage / "references.jsonl").is_file() and (stage / "results.json").is_file()
    assert not (stage / "eyas_main" / "draft").exists()  # finished: its evaluations travel, not its weights
    # an eyas run cut before its end travels as its newest complete checkpoint alone
    cut = tmp_path / "cut" / "work"
    shutil.copytree(work, cut, symlinks=True)
    shutil.rmtree(cut / "eyas_main" / "draft")
    r = subprocess.run(
        ["bash", str(STAGE), str(cut), str(tmp_path / "cut_stage")], capture_output=True, text=True, env=env
    )
    assert r.returncode == 0, r.stderr
    kept = sorted(p.name for p in (tmp_path / "cut_stage" / "eyas_main" / "checkpoints").iterdir())
    assert kept == [max(p.name for p in (work / "eyas_main" / "checkpoints").glob("step-*"))]

    # session B: a fresh disk with the stage unpacked where the work was
    shutil.rmtree(work)
    shutil.rmtree(out)
    shutil.copytree(stage, work)
    # both trainers asked for: eyas, finished in A, is not trained again
    phase("--phase", "main", *data, "--train", "speculators,eyas", "--spec-workers", "0", "--spec-resume")
    phase("--phase", "rest", "--curve-every-s", "3")
    res = json.loads((out / "results.json").read_text())
    assert "made again" in (out / "results.json").read_text()  # the data, not on this disk
    assert Path(res["spec_main"]["draft"]).is_dir()
    assert res["spec_main"]["resumed_from"]["global_step"] == stop["global_step"]
    # speculators' curve: session A's points (their reports staged) and session B's, on one clock
    spec = res["curve"]["speculators"]
    assert {p["evaluated_in"] for p in spec} == {"rest", "rest-2"}
    a_end = max(p["train_s"] for p in res_a["curve"]["speculators"])
    assert all(p["train_s"] > a_end for p in spec if p["evaluated_in"] == "rest-2")
    assert [p["train_s"] for p in spec] == sorted(p["train_s"] for p in spec)
    # eyas finished in A: its points and final evaluations come from A's reports
    assert "eyas main: finished in an earlier session" in (out / "results.json").read_text()
    assert [p["step"] for p in res["curve"]["eyas"]] == [p["step"] for p in res_a["curve"]["eyas"]]
    assert {p["evaluated_in"] for p in res["curve"]["eyas"]} == {"rest"}
    for who in ("eyas", "speculators"):
        pts = res["curve"][who]
        assert pts, who
        for p in pts:
            assert set(p["taus"]) == {"mt_bench", "humaneval"}
            assert all(set(t) == {"3", "5"} for t in p["taus"].values())
            assert all(v >= 1.0 for t in p["taus"].values() for v in t.values())
            assert all((work / rel).is_file() for t in p["reports"].values() for rel in t.values())
    # the final drafts paired on each set and k over the same turns (3 MT-bench questions, 2 turns)
    final = {(r["prompt_set"], r["k"]): r for r in res["paired"] if r["at"] == "final"}
    assert set(final) == {(s, k) for s in ("mt_bench", "humaneval") for k in (3, 5)}
    assert final[("mt_bench", 3)]["turns"] == 6
    lo, hi = final[("mt_bench", 3)]["difference_ci95"]
    assert lo <= final[("mt_bench", 3)]["difference"] <= hi
    # and the checkpoints nearest the mark, found by the reports each curve point names
    assert {(r["prompt_set"], r["k"]) for r in res["paired"] if r["at"] == "4s"} == set(final)
    assert (out / "curve.png").is_file()

    # each run's last checkpoint is its final draft: that point is the final evaluation's
    assert spec[-1]["reports"]["mt_bench"]["3"].startswith("eval_speculators/")
    assert res["curve"]["eyas"][-1]["reports"]["mt_bench"]["3"].startswith("eval_eyas/")
    # a rest call too close to its deadline starts nothing, takes the earlier calls' reports and
    # saves them; a set whose reports went missing is left for the next call, which evaluates it alone
    shutil.rmtree(work / "eval_speculators-humaneval")
    phase("--phase", "rest", "--curve-every-s", "3", "--deadline-s", "5")
    late = json.loads((out / "results.json").read_text())
    log = "\n".join(late["log"]["rest-3"])
    assert " start " not in log and "its reports from an earlier call" in log
    assert "eval speculators@humaneval: " in log and "not started" in log
    assert set(res["evaluations"]) - set(late["evaluations"]) == {
        "speculators@humaneval_k3",
        "speculators@humaneval_k5",
    }
    assert set(late["curve"]["speculators"][-1]["taus"]) == {"mt_bench"}
    assert [p["taus"] for p in late["curve"]["eyas"]] == [p["taus"] for p in res["curve"]["eyas"]]
    phase("--phase", "rest", "--curve-every-s", "3")
    again = json.loads((out / "results.json").read_text())
    started = [line for line in again["log"]["rest-4"] if " start " in line]
    assert len(started) == 1 and "start eval_speculators@humaneval:" in started[0]
    assert again["evaluations"] == res["evaluations"]
    assert [p["taus"] for p in again["curve"]["speculators"]] == [p["taus"] for p in spec]
    res = again

    # pair_runs.py pairs the eyas run of one comparison with the speculators run of another (two
    # sessions); given the same comparison twice it gives the rest phase's own rows
    sys.path.insert(0, str(HARNESS.parent))
    from pair_runs import pair_runs

    assert pair_runs(work, work) == res["paired"]

    # quality_to_summary.py: a row of summary.json per checkpoint, prompt set and k, both trainers
    from quality_to_summary import rows

    got = rows(work, "t")
    want = {(w, ps, k) for w in ("eyas", "speculators") for ps in ("mt_bench", "humaneval") for k in (3, 5)}
    assert {(r["trainer"], r["prompt_set"], r["k"]) for r in got} == want
    assert len(got) == 4 * sum(len(res["curve"][w]) for w in ("eyas", "speculators"))


def test_the_data_of_one_trainer_hold_one_copy_of_the_states(tmp_path, tiny_llama_dir):
    """The chain's data phase (`--train ""`) for a session of one trainer: speculators' copy with its
    store deleted as it is copied, or eyas's store without a copy; a later main call finds them."""
    conv = _conversations(tmp_path / "conversations.jsonl", 16)
    mt = ROOT / "data" / "mt_bench" / "question.jsonl"
    for who in ("speculators", "eyas"):
        work = tmp_path / who
        cmd = [sys.executable, str(HARNESS), "--phase", "main", "--train", "", "--data-for", who]
        cmd += ["--target", str(tiny_llama_dir), "--prompts", str(mt), "--work", str(work)]
        cmd += ["--out", str(tmp_path / f"out-{who}"), "--gpus", "0", "--python", sys.executable]
        cmd += ["--spec-python", str(SPEC_PY), "--ablations", "", "--regenerated", str(conv)]
        cmd += ["--max-length", "128", "--vocab", "64"]
        for call in (1, 2):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        res = json.loads((work / "results.json").read_text())
        assert "data and stores: from the earlier main call" in json.dumps(res["log"])  # call 2 made none
        spec = work / "spec_data" / "eyas_conversion.json"
        if who == "speculators":
            assert json.loads(spec.read_text())["store_consumed"] is True
            assert not (work / "store_regenerated").exists()
        else:
            assert not spec.exists() and not (work / "spec_data").exists()
            assert json.loads((work / "store_regenerated" / "manifest.json").read_text())["complete"]
    # a session's trainers must have their data
    r = subprocess.run([*cmd[:5], "eyas", "--data-for", "speculators", *cmd[8:]], capture_output=True, text=True)
    assert r.returncode == 2 and "--data-for 'speculators' does not make" in r.stderr
