"""The vLLM engine behind `eyas prepare --regenerate --gen-backend vllm`.

One engine process for the whole regeneration, in the vLLM interpreter (found like extraction's:
``--vllm-python``, ``$EYAS_VLLM_PYTHON``, this Python, or the newest ``.venvs/vllm-*``). eyas
sends token ids and gets token ids back, so the prompts are exactly what the HF backend would
feed, and decoding (stop tokens, empty answers) is shared with it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from eyas.errors import EyasError


class VllmGenerator:
    """``generate(prompts, ...)`` -> [(token_ids, hit_length_limit)], served by one vLLM engine."""

    def __init__(self, target_path: str | Path, work: Path, max_model_len: int, seed: int,
                 vllm_python: str | None = None, dtype: str = "auto", tensor_parallel_size: int = 1):
        from eyas.extract.vllm_backend import (
            PKG,
            VLLM_DTYPES,
            WORKER_SRC,
            _die_with_parent,
            _engine_env,
            find_vllm_python,
            probe_vllm,
        )

        python, why = find_vllm_python(vllm_python)
        inst = probe_vllm(python)
        if not inst.version:
            raise EyasError(f"{python} (chosen by {why}) has no vLLM; pass --vllm-python or use "
                            "--gen-backend hf")
        self.describe = f"vLLM {inst.version} ({python}, chosen by {why})"
        self.work = Path(work).resolve()  # the engine runs in it: a relative path would not reach it
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.copytree(WORKER_SRC, self.work / "pkg" / PKG, ignore=shutil.ignore_patterns("__pycache__"))
        job = {"model": str(target_path), "work_dir": str(self.work), "max_model_len": int(max_model_len),
               "seed": int(seed), "dtype": VLLM_DTYPES.get(dtype, dtype),
               "tensor_parallel_size": int(tensor_parallel_size)}
        (self.work / "job.json").write_text(json.dumps(job, indent=1))
        env = _engine_env(self.work / "pkg", {}, backend="vllm")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
        self.log_path = self.work.parent / "regenerate-vllm.log"  # outlives the work dir
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([python, "-m", f"{PKG}.generate", str(self.work / "job.json")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, cwd=self.work, env=env, preexec_fn=_die_with_parent)
        ready = self._read()  # once the model is loaded
        # vLLM's CPU runner cannot seed single requests; there the engine seed drives sampling
        self.per_request_seed = bool(ready.get("per_request_seed"))

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = self.log_path.read_text(errors="replace").splitlines()
            errs = [ln for ln in tail if "Error" in ln or "error:" in ln][-6:] or tail[-15:]
            raise EyasError(f"{self.describe}: the generation engine exited with code "
                            f"{self.proc.returncode}; its log is {self.log_path}:\n" + "\n".join(errs))
        return json.loads(line)

    def generate(self, prompts: list[list[int]], max_tokens: int, temperature: float, top_p: float,
                 seeds: list[int], stop_token_ids: list[int]) -> list[tuple[list[int], bool]]:
        assert self.proc.stdin is not None
        req = {"prompts": prompts, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
               "seeds": seeds, "stop_token_ids": stop_token_ids}
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the engine died: _read reports it with its log
        outs = self._read()["outputs"]
        return [(o["token_ids"], o["finish_reason"] == "length") for o in outs]

    def close(self) -> None:
        if self.proc.poll() is None:
            if self.proc.stdin:
                self.proc.stdin.close()  # the engine's loop ends at EOF
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.work, ignore_errors=True)
