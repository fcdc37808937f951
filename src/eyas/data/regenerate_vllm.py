"""The vLLM engine behind `eyas prepare --regenerate --gen-backend vllm`.

One engine process for the whole regeneration, in the vLLM interpreter (found like extraction's:
``--vllm-python``, ``$EYAS_VLLM_PYTHON``, this Python, or the newest ``.venvs/vllm-*``). eyas
sends token ids and gets token ids back, so the prompts are exactly what the HF backend would
feed, and decoding (stop tokens, empty answers) is shared with it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from eyas.errors import EyasError
from eyas.vllm import VLLM_DTYPES
from eyas.vllm.find import find_vllm_python, probe_vllm
from eyas.vllm.process import WorkerProcess


class VllmGenerator:
    """``generate(prompts, ...)`` -> [(token_ids, hit_length_limit)], served by one vLLM engine."""

    def __init__(self, target_path: str | Path, work: Path, max_model_len: int, seed: int,
                 vllm_python: str | None = None, dtype: str = "auto", tensor_parallel_size: int = 1):
        python, why = find_vllm_python(vllm_python)
        inst = probe_vllm(python)
        if not inst.version:
            raise EyasError(f"{python} (chosen by {why}) has no vLLM; pass --vllm-python or use "
                            "--gen-backend hf")
        self.describe = f"vLLM {inst.version} ({python}, chosen by {why})"
        self.work = Path(work).resolve()  # the engine runs in it: a relative path would not reach it
        shutil.rmtree(self.work, ignore_errors=True)
        job = {"model": str(target_path), "work_dir": str(self.work), "max_model_len": int(max_model_len),
               "seed": int(seed), "dtype": VLLM_DTYPES.get(dtype, dtype),
               "tensor_parallel_size": int(tensor_parallel_size)}
        self.log_path = self.work.parent / "regenerate-vllm.log"  # outlives the work dir
        self.proc = WorkerProcess(python, "generate", job, self.work, self.log_path, multiprocessing=True,
                                  cwd=self.work, describe=f"{self.describe}: the generation engine")
        ready = self.proc.read()  # once the model is loaded
        # vLLM's CPU runner cannot seed single requests; there the engine seed drives sampling
        self.per_request_seed = bool(ready.get("per_request_seed"))

    def generate(self, prompts: list[list[int]], max_tokens: int, temperature: float, top_p: float,
                 seeds: list[int], stop_token_ids: list[int]) -> list[tuple[list[int], bool]]:
        outs = self.proc.request({"prompts": prompts, "max_tokens": max_tokens, "temperature": temperature,
                                  "top_p": top_p, "seeds": seeds, "stop_token_ids": stop_token_ids})["outputs"]
        return [(o["token_ids"], o["finish_reason"] == "length") for o in outs]

    def close(self) -> None:
        self.proc.close()
        shutil.rmtree(self.work, ignore_errors=True)
