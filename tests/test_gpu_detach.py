"""Long device jobs apart from their calls (benchmarks/gpu/detach.sh, watch.sh): the job runs on
after the starting call returns, in its own copy of the tree, and each watch brings back its
console since the last watch, its OUT so far and, once it has ended, its exit status."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

GPU = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"


def run(script: str, *args: str, bg: Path, out: Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "BG_ROOT": str(bg), "OUT": str(out)}
    return subprocess.run(
        ["bash", str(GPU / script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


JOB = (
    "echo first; printf 'bar 50%%|#####\\r'; touch $OUT/../go-1; "
    "while [ ! -f $OUT/../go-2 ]; do sleep 0.2; done; echo second; "
    "echo $PWD > $OUT/where; exit 3"
)


def test_a_detached_job_is_watched_to_its_end(tmp_path: Path) -> None:
    bg, out, tree = tmp_path / "bg", tmp_path / "out", tmp_path / "tree"
    (tree / "src").mkdir(parents=True)
    (tree / "src" / "code.py").write_text("")
    (tree / ".carry" / "c1").mkdir(parents=True)  # the call's tree, as the device lays it out
    started = run("detach.sh", "j", "bash", "-c", JOB, bg=bg, out=out, cwd=tree)
    assert started.returncode == 0, started.stdout + started.stderr
    job = bg / "j"
    deadline = time.time() + 30
    while not (job / "go-1").exists() and time.time() < deadline:
        time.sleep(0.2)

    # a second job of the same name is refused while the first runs
    again = run("detach.sh", "j", "true", bg=bg, out=out)
    assert again.returncode == 1 and "still running" in again.stdout

    first = run("watch.sh", "j", "1", bg=bg, out=out)
    assert first.returncode == 0 and "watch: j running" in first.stdout
    assert "first" in first.stdout and "bar 50%" not in first.stdout  # no progress bars
    assert "MiB available" in first.stdout

    (job / "go-2").touch()
    last = run("watch.sh", "j", "30", bg=bg, out=out)
    assert last.returncode == 3, last.stdout + last.stderr
    assert "second" in last.stdout and "first" not in last.stdout  # only what is new
    assert "ended with status 3" in last.stdout

    with tarfile.open(out / "j.tgz") as t:
        where = t.extractfile("out/where").read().decode().strip()  # type: ignore[union-attr]
    # the job ran in its own copy of the tree, which holds the scripts but not the carried parts
    assert where == str(job / "tree")
    assert (job / "tree" / "src" / "code.py").exists()
    assert not (job / "tree" / ".carry").exists()


def test_watching_no_job_says_so(tmp_path: Path) -> None:
    got = run("watch.sh", "none", "1", bg=tmp_path / "bg", out=tmp_path / "out")
    assert got.returncode == 2 and "detach.sh" in got.stdout


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for whoever adopted it to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_end_group_ends_what_a_command_left_behind(tmp_path: Path) -> None:
    """vllm_setup.sh's check ends by os._exit and vLLM's engine core, its child, outlived it holding GPU
    memory: end_group.sh ends the rest of the check's process group (and only it)."""
    orphan = tmp_path / "orphan.py"
    orphan.write_text(
        "import os, subprocess, sys\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        "open(sys.argv[1], 'w').write(str(p.pid))\n"
        "os._exit(0)\n"
    )
    child_pid = tmp_path / "child.pid"
    lead = subprocess.Popen(["setsid", sys.executable, str(orphan), str(child_pid)])
    assert lead.wait(timeout=60) == 0
    child = int(child_pid.read_text())
    assert _running(child)  # the child outlived its parent
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        done = subprocess.run(
            ["bash", str(GPU / "end_group.sh"), str(lead.pid), "check"], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0 and "check left 1 process(es); ended" in done.stdout, done.stdout + done.stderr
        assert not _running(child), "the check's leftover child is still running"
        assert bystander.poll() is None  # another group is left alone
        # nothing left: a second call says nothing and succeeds
        again = subprocess.run(["bash", str(GPU / "end_group.sh"), str(lead.pid)], capture_output=True, text=True)
        assert again.returncode == 0 and again.stdout == ""
    finally:
        bystander.kill()
