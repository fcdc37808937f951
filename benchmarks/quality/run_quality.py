"""The quality comparison: eyas's EAGLE-3 draft vs speculators==0.9.0's trainer, plus ablations.

One process drives every stage as a subprocess (eyas's CLI, speculators' trainer through
spec_train.py, evaluation through evaluate_any.py) and writes OUT/results.json and plots.

    data      the first --n-convs ShareGPT conversations: `eyas prepare --regenerate` (answers
              by the target), the same conversations as they are (ablation), and the
              regenerated set again with the small draft vocab (ablation; reuses the answers)
    extract   `eyas extract` of the three prepared sets (same aux layers, HF backend)
    convert   regenerated store -> speculators' offline data (to_speculators.py)
    main      eyas (`eyas train`, offline from the store) and speculators (its own trainer),
              one after the other, each alone on the device for --main-budget-s of training;
              each is first probed for its step time so its own LR schedule ends in budget
    ablations eyas at equal steps: TTT 1/3/7 (regenerated, large vocab), original data, small
              draft vocab; run side by side (results do not depend on speed: fixed steps)
    evaluate  greedy, MT-bench, k=3 and k=5 for the two main drafts, k=5 for the ablations,
              with eyas's built-in speculative loop (evaluate_any.py), in parallel processes

Budgets are parameters; --deadline-s makes late stages shrink (fewer prompts) or be skipped
(recorded in results.json) instead of overrunning the device call.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
T0 = time.time()
LOG: list[str] = []


def log(msg: str) -> None:
    line = f"[{time.time() - T0:7.1f}s] {msg}"
    LOG.append(line)
    print(line, flush=True)


class Runner:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.work = Path(a.work)
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ)
        self.env.setdefault("PYTHONUNBUFFERED", "1")

    def left(self) -> float:
        return self.a.deadline_s - (time.time() - T0)

    def start(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        log(f"start {name}: {' '.join(map(str, cmd))}")
        fh = open(self.logs / f"{name}.log", "w")
        p = subprocess.Popen([str(c) for c in cmd], stdout=fh, stderr=subprocess.STDOUT,
                             env=env or self.env, start_new_session=True)
        p._eyas_name, p._eyas_t0, p._eyas_fh = name, time.time(), fh  # type: ignore[attr-defined]
        return p

    def wait(self, p: subprocess.Popen, timeout: float | None = None, check: bool = True) -> float:
        name = p._eyas_name  # type: ignore[attr-defined]
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log(f"{name}: over its time, sending SIGTERM")
            os.killpg(p.pid, 15)
            try:
                rc = p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                rc = p.wait()
        p._eyas_fh.close()  # type: ignore[attr-defined]
        dt = time.time() - p._eyas_t0  # type: ignore[attr-defined]
        log(f"done {name}: rc={rc} in {dt:.1f}s")
        if check and rc != 0:
            tail = (self.logs / f"{name}.log").read_text()[-3000:]
            raise RuntimeError(f"{name} failed (rc={rc}):\n{tail}")
        return dt

    def run(self, name: str, cmd: list[str], timeout: float | None = None, env: dict | None = None) -> float:
        return self.wait(self.start(name, cmd, env), timeout)

    # ------------------------------------------------------------------ commands
    def eyas(self, *args: Any) -> list[str]:
        return [self.a.python, "-m", "eyas.cli", *map(str, args)]

    def spec_env(self) -> dict:
        env = dict(self.env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parents[1] / "src"), env.get("PYTHONPATH")]))
        return env


def read_metrics(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    if not p.is_file():
        return []
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]


def eyas_step_time(run_dir: Path) -> float | None:
    """Seconds per optimizer step from the train records (tokens and tokens/s per log interval)."""
    recs = [r for r in read_metrics(run_dir) if r.get("split") == "train"]
    times = []
    for a, b in zip(recs, recs[1:]):
        steps, toks = b["step"] - a["step"], b["tokens"] - a["tokens"]
        if steps > 0 and b.get("tokens_per_s"):
            times.append(toks / b["tokens_per_s"] / steps)
    if not times and recs and recs[-1].get("tokens_per_s"):
        r = recs[-1]
        times.append(r["tokens"] / r["tokens_per_s"] / r["step"])
    if not times:
        return None
    steady = sorted(times[len(times) // 3:])  # drop the first third (allocator, cudnn warm-up)
    return steady[len(steady) // 2]


def latest_eyas_draft(run_dir: Path) -> Path | None:
    """RUN/draft when training finished, else the newest checkpoint (config + weights)."""
    if (run_dir / "draft" / "model.safetensors").is_file():
        return run_dir / "draft"
    from eyas.train.checkpoint import checkpoint_dirs  # complete ones only, oldest first

    ck = checkpoint_dirs(run_dir)
    return ck[-1] if ck else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="Target HF directory (SmolLM2-135M-Instruct).")
    ap.add_argument("--sharegpt", required=True, help="ShareGPT conversations (.json/.jsonl).")
    ap.add_argument("--prompts", required=True, help="MT-bench question.jsonl.")
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--python", default=sys.executable, help="Python with eyas importable.")
    ap.add_argument("--spec-python", default=sys.executable, help="Python with speculators importable.")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--deadline-s", type=float, default=560.0)
    ap.add_argument("--n-convs", type=int, default=1500)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--regen-batch", type=int, default=512)
    ap.add_argument("--regen-max-new", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--vocab-small", type=int, default=8192)
    ap.add_argument("--layers", default=None, help="Aux layer ids (default: eyas's 2,N/2,N-3).")
    ap.add_argument("--main-budget-s", type=float, default=60.0)
    ap.add_argument("--eyas-probe-steps", type=int, default=30)
    ap.add_argument("--spec-probe-steps", type=int, default=20)
    ap.add_argument("--eyas-args", default="--ttt-steps 7 --lr 5e-4 --tokens-per-batch 8192 --warmup 30",
                    help="eyas train settings of the main run (ablations vary one thing each).")
    ap.add_argument("--spec-args", default="", help="Extra speculators flags (default: none).")
    ap.add_argument("--spec-workers", type=int, default=8)
    ap.add_argument("--abl-steps", type=int, default=0, help="0: from the eyas probe and --abl-budget-s.")
    ap.add_argument("--abl-budget-s", type=float, default=45.0)
    ap.add_argument("--abl-slowdown", type=float, default=2.5, help="Assumed slowdown of side-by-side runs.")
    ap.add_argument("--eval-prompts", type=int, default=80)
    ap.add_argument("--abl-eval-prompts", type=int, default=40)
    ap.add_argument("--eval-max-new", type=int, default=128)
    ap.add_argument("--eval-dtype", default="float32")
    ap.add_argument("--skip-ablations", action="store_true")
    a = ap.parse_args(argv)
    r = Runner(a)
    work, out = Path(a.work), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"kind": "eyas-quality-comparison", "args": vars(a), "stages": {},
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(T0))}

    def save() -> None:
        res["log"] = LOG
        res["elapsed_s"] = time.time() - T0
        tmp = out / "results.json.tmp"
        tmp.write_text(json.dumps(res, indent=2, default=str))
        os.replace(tmp, out / "results.json")

    try:
        _pipeline(r, a, work, out, res, save)
    except Exception as e:  # noqa: BLE001 - record what happened, then fail the call
        log(f"FAILED: {e}")
        res["error"] = str(e)
        save()
        raise
    save()
    return 0


def _pipeline(r: Runner, a, work: Path, out: Path, res: dict, save) -> None:
    T = a.target
    layers = ["--layers", a.layers] if a.layers else []
    # ------------------------------------------------------------------ data
    t = time.time()
    regen, orig, small = work / "prep_regen", work / "prep_orig", work / "prep_regen_small"
    common = ["--target", T, "--data", a.sharegpt, "--max-samples", a.n_convs, "--max-length", a.max_length,
              "--quiet"]
    p_orig = r.start("prepare_orig", r.eyas("prepare", "--out", orig, "--draft-vocab-size", a.vocab, *common))
    r.run("prepare_regen", r.eyas("prepare", "--out", regen, "--draft-vocab-size", a.vocab, *common,
                                  "--regenerate", "--gen-batch-size", a.regen_batch,
                                  "--max-new-tokens", a.regen_max_new, "--device", a.device))
    small.mkdir(parents=True, exist_ok=True)
    for f in ("regenerated.jsonl", "regenerate.json"):  # the answers, reused (settings checked)
        if (regen / f).is_file():
            shutil.copy2(regen / f, small / f)
    p_small = r.start("prepare_regen_small", r.eyas(
        "prepare", "--out", small, "--draft-vocab-size", a.vocab_small, *common, "--regenerate",
        "--gen-batch-size", a.regen_batch, "--max-new-tokens", a.regen_max_new, "--device", a.device))
    for p in (p_orig, p_small):  # ablation data: a failure costs the ablations, not the run
        r.wait(p, check=False)
        if p.returncode != 0:
            log(f"{p._eyas_name} failed: no ablations")  # type: ignore[attr-defined]
            a.skip_ablations = True
    res["data"] = {name: json.loads((d / "manifest.json").read_text()) for name, d in
                   (("regenerated", regen), ("original", orig), ("regenerated_small_vocab", small))
                   if (d / "manifest.json").is_file()}
    for m in res["data"].values():
        m.pop("shards", None)
    res["stages"]["data_s"] = time.time() - t
    log(f"data: {json.dumps({k: v.get('counts') for k, v in res['data'].items()})}")
    save()
    # ------------------------------------------------------------------ extract + convert
    t = time.time()
    stores = {"regenerated": work / "store_regen", "original": work / "store_orig",
              "regenerated_small_vocab": work / "store_regen_small"}
    preps = {"regenerated": regen, "original": orig, "regenerated_small_vocab": small}
    r.run("extract_regen", r.eyas("extract", "--target", T, "--data", regen, "--out", stores["regenerated"],
                                  "--device", a.device, *layers))
    spec_data = work / "spec_data"
    p_conv = r.start("to_speculators", [a.spec_python, HERE / "to_speculators.py", "--store",
                                        stores["regenerated"], "--out", spec_data, "--threads", "8"],
                     env=r.spec_env())
    if not a.skip_ablations:
        for name in ("original", "regenerated_small_vocab"):
            pe = r.start(f"extract_{name}", r.eyas("extract", "--target", T, "--data", preps[name], "--out",
                                                   stores[name], "--device", a.device, *layers))
            r.wait(pe, check=False)
            if pe.returncode != 0:
                log(f"extract_{name} failed: no ablations")
                a.skip_ablations = True
    r.wait(p_conv)
    res["speculators_data"] = json.loads((spec_data / "eyas_conversion.json").read_text())
    res["stages"]["extract_convert_s"] = time.time() - t
    save()
    # ------------------------------------------------------------------ budget check
    # what is left must hold: 2 probes (~110 s), setup + compile of the 2 main runs (~50 s),
    # the 2 main budgets, the ablations and the evaluation (~120 s)
    spare = r.left() - 110 - 50 - 120 - (0 if a.skip_ablations else a.abl_budget_s)
    if spare < 2 * a.main_budget_s and not a.skip_ablations:
        log(f"only {r.left():.0f}s left: skipping the ablations")
        a.skip_ablations = True
        spare += a.abl_budget_s
    if spare < 2 * a.main_budget_s:
        new_budget = max(15.0, spare / 2)
        log(f"only {r.left():.0f}s left: main budget {a.main_budget_s:.0f}s -> {new_budget:.0f}s")
        a.main_budget_s = new_budget
    res["main_budget_s"] = a.main_budget_s
    # ------------------------------------------------------------------ main: eyas
    eyas_args = a.eyas_args.split()

    def eyas_train(name: str, data: Path, store: Path, extra: list[str], steps: int, save_every: int) -> list[str]:
        return r.eyas("train", "--target", T, "--data", data, "--store", store, "--out", work / name,
                      "--device", a.device, "--max-steps", steps, "--eval-every", 0,
                      "--save-every", save_every, *extra)

    t = time.time()
    r.run("eyas_probe", eyas_train("eyas_probe", regen, stores["regenerated"], eyas_args,
                                   a.eyas_probe_steps, 0))
    probe_wall = time.time() - t
    step_s = eyas_step_time(work / "eyas_probe")
    if not step_s:
        raise RuntimeError("eyas probe wrote no step timings (metrics.jsonl)")
    setup_s = max(0.0, probe_wall - a.eyas_probe_steps * step_s)
    steps = max(10, int(a.main_budget_s * 0.97 / step_s))
    res["eyas_main"] = {"probe": {"steps": a.eyas_probe_steps, "wall_s": probe_wall, "step_s": step_s,
                                  "setup_s": setup_s}, "max_steps": steps, "args": eyas_args}
    log(f"eyas plan: {steps} steps at {step_s:.3f}s/step (setup {setup_s:.1f}s)")
    t = time.time()
    # checkpoints every quarter: if the run overruns the budget, the latest one is evaluated
    p = r.start("eyas_main", eyas_train("eyas_main", regen, stores["regenerated"], eyas_args, steps,
                                        max(1, steps // 4)))
    dt = r.wait(p, timeout=1.5 * setup_s + 1.1 * a.main_budget_s + 20, check=False)
    em = res["eyas_main"]
    em.update(wall_s=dt, loop_s_est=dt - setup_s, rc=p.returncode,
              metrics_tail=[x for x in read_metrics(work / "eyas_main")][-3:])
    em["draft"] = str(latest_eyas_draft(work / "eyas_main"))
    summ = work / "eyas_main" / "summary.json"
    em["summary"] = json.loads(summ.read_text()) if summ.is_file() else None
    save()
    # ------------------------------------------------------------------ main: speculators
    spec_cmd = [a.spec_python, HERE / "spec_train.py", "--verifier", T, "--data", spec_data,
                "--out", work / "spec_main", "--budget-s", a.main_budget_s,
                "--probe-steps", a.spec_probe_steps, "--num-workers", a.spec_workers]
    if a.device == "cpu":
        spec_cmd.append("--cpu")
    if a.spec_args.strip():
        spec_cmd += ["--", *a.spec_args.split()]
    ps = r.start("spec_main", spec_cmd, env=r.spec_env())
    r.wait(ps, timeout=max(60.0, r.left() - 150), check=False)  # a failure still leaves eyas's evals
    sj = work / "spec_main" / "spec_train.json"
    sm = json.loads(sj.read_text()) if sj.is_file() else {"error": f"rc={ps.returncode}, see logs/spec_main.log"}
    res["spec_main"] = sm
    if sm.get("checkpoint"):
        r.run("spec_convert", [a.python, HERE / "from_speculators.py", "--ckpt", sm["checkpoint"],
                               "--target", T, "--out", work / "spec_draft"], env=r.spec_env())
    res["stages"]["main_training_s"] = time.time() - t
    save()
    # ------------------------------------------------------------------ evals (+ ablation training)
    ev_py = [a.python, HERE / "evaluate_any.py", "--target", T, "--prompts", a.prompts,
             "--device", a.device, "--max-new-tokens", a.eval_max_new, "--dtype", a.eval_dtype, "--quiet"]
    evals: dict[str, subprocess.Popen] = {}
    n_main = a.eval_prompts
    for who, d in (("eyas", em["draft"]), ("speculators", work / "spec_draft")):
        if d in (None, "None") or not Path(d).exists():
            log(f"no {who} draft to evaluate")
            continue
        for k in (3, 5):
            evals[f"{who}_k{k}"] = r.start(f"eval_{who}_k{k}", ev_py + [
                "--draft", d, "--out", work / f"eval_{who}_k{k}", "-k", k, "--max-prompts", n_main],
                env=r.spec_env())
    abl_runs: dict[str, dict] = {}
    if not a.skip_ablations:
        abl_steps = a.abl_steps or max(10, int(a.abl_budget_s / (step_s * a.abl_slowdown)))
        base = [x for x in eyas_args]

        def with_ttt(args: list[str], n: int) -> list[str]:
            args = list(args)
            if "--ttt-steps" in args:
                args[args.index("--ttt-steps") + 1] = str(n)
            else:
                args += ["--ttt-steps", str(n)]
            return args

        base_ttt = int(base[base.index("--ttt-steps") + 1]) if "--ttt-steps" in base else 7
        specs = {f"ttt{n}": ("regenerated", with_ttt(base, n)) for n in (1, 3, 7)}
        specs["original_data"] = ("original", with_ttt(base, base_ttt))
        specs["small_vocab"] = ("regenerated_small_vocab", with_ttt(base, base_ttt))
        res["ablations"] = {"steps": abl_steps, "runs": {}}
        procs = {}
        for name, (data, args) in specs.items():
            procs[name] = r.start(f"abl_{name}", eyas_train(f"abl_{name}", preps[data], stores[data], args,
                                                          abl_steps, max(1, abl_steps // 2)))
            abl_runs[name] = {"data": data, "args": args}
        for name, p in procs.items():
            dt = r.wait(p, timeout=max(30.0, r.left() - 150), check=False)
            abl_runs[name].update(wall_s=dt, rc=p.returncode, draft=str(latest_eyas_draft(work / f"abl_{name}")))
        n_abl = a.abl_eval_prompts
        for name, info in abl_runs.items():
            if info["draft"] != "None":
                evals[f"abl_{name}_k5"] = r.start(f"eval_abl_{name}_k5", ev_py + [
                    "--draft", info["draft"], "--out", work / f"eval_abl_{name}_k5", "-k", 5,
                    "--max-prompts", n_abl], env=r.spec_env())
        res["ablations"]["runs"] = abl_runs
    reports: dict[str, Any] = {}
    for name, p in evals.items():
        r.wait(p, timeout=max(20.0, r.left() - 10), check=False)
        rp = work / f"eval_{name}" / "builtin" / "report.json"
        if rp.is_file():
            rep = json.loads(rp.read_text())
            reports[name] = {"tau": rep["overall"]["tau"], "acceptance_rate_per_pos":
                             rep["overall"]["acceptance_rate_per_pos"], "prompts": rep["overall"]["prompts"],
                             "rounds": rep["overall"]["rounds"], "new_tokens": rep["overall"]["new_tokens"],
                             "per_category_tau": {c: v["tau"] for c, v in rep["per_category"].items()},
                             "draft_class": rep.get("draft_class")}
        else:
            reports[name] = {"error": f"no report (rc={p.returncode}); see logs/eval_{name}.log"}
    res["evaluations"] = reports
    verdict = {}
    for k in (3, 5):
        e, s = reports.get(f"eyas_k{k}", {}).get("tau"), reports.get(f"speculators_k{k}", {}).get("tau")
        if e is not None and s is not None:
            verdict[f"k{k}"] = {"eyas_tau": e, "speculators_tau": s, "difference": e - s,
                                "relative": (e - s) / s, "eyas_at_least_speculators": e >= s}
    res["verdict"] = verdict
    log(f"verdict: {json.dumps(verdict)}")
    save()
    plot(res, out)


def plot(res: dict, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plots")
        return
    ev = res.get("evaluations", {})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [n for n in ev if ev[n].get("tau") is not None]
    axes[0].barh(names, [ev[n]["tau"] for n in names],
                 color=["C0" if n.startswith("eyas") else "C1" if n.startswith("spec") else "C2" for n in names])
    for i, n in enumerate(names):
        axes[0].text(ev[n]["tau"], i, f" {ev[n]['tau']:.3f}", va="center")
    axes[0].set_xlabel("tau (tokens per target forward), MT-bench, greedy")
    axes[0].invert_yaxis()
    for n in names:
        rates = ev[n]["acceptance_rate_per_pos"]
        axes[1].plot(range(1, len(rates) + 1), rates, marker="o", label=n,
                     linestyle="-" if not n.startswith("abl") else ":")
    axes[1].set_xlabel("draft position")
    axes[1].set_ylabel("acceptance rate")
    axes[1].legend(fontsize=7)
    fig.suptitle("eyas vs speculators 0.9.0 (same features, same budget) + eyas ablations")
    fig.tight_layout()
    fig.savefig(out / "quality.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
