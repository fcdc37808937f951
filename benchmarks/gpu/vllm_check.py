"""Does the carried vLLM work on this GPU? `import vllm`, then `LLM(...)` on a random tiny Llama
built here, then one greedy generation; each phase timed, and where it stops said.

Run by benchmarks/gpu/vllm_setup.sh (python3 with PYTHONPATH=/tmp/vllm-site). Prints one line per
phase (``CHECK phase=... status=... seconds=...``) and a JSON summary last (also written to
$CHECK_JSON when set). A phase that does not end within the time left of $CHECK_TIMEOUT_S
(default 420) makes the watchdog dump every thread's stack, ask every child process to dump its
own (SIGUSR1, see vllm_setup.sh's sitecustomize), print the summary and exit 3.

Env knobs (the leads of DESIGN.md section 7): VLLM_LOGGING_LEVEL (INFO by default here),
VLLM_HOST_IP, VLLM_ENABLE_V1_MULTIPROCESSING (0: the engine core runs in this process, so a hang
or an import error is in this stack), CHECK_IMPORTS=0 skips importing the engine core's modules in
this process first (an import that fails only in the engine-core child shows here), CHECK_EAGER=0
lets vLLM compile (torch.compile + CUDA graphs), CHECK_GPU_MEM (0.2).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import tempfile
import threading
import time
import traceback

T0 = time.perf_counter()
PHASES: list[dict] = []
TIMEOUT = float(os.environ.get("CHECK_TIMEOUT_S", "420"))
# Modules the engine-core process and the GPU worker import that `import vllm` does not.
ENGINE_MODULES = (
    "vllm.v1.engine.core",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.executor.abstract",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.llama_eagle3",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.spec_decode.eagle",
    "vllm.v1.sample.sampler",
)


def summary(stopped_at: str | None) -> dict:
    out = {
        "ok": stopped_at is None,
        "stopped_at": stopped_at,
        "total_seconds": round(time.perf_counter() - T0, 2),
        "phases": PHASES,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "CHECK_", "NCCL_", "GLOO_", "CUDA_"))},
    }
    text = json.dumps(out, indent=1)
    print("CHECK-SUMMARY " + text, flush=True)
    if os.environ.get("CHECK_JSON"):
        with open(os.environ["CHECK_JSON"], "w") as fh:
            fh.write(text + "\n")
    return out


class Phase:
    current: "Phase | None" = None

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        Phase.current = self
        self.t = time.perf_counter()
        print(f"CHECK phase={self.name} status=start at={self.t - T0:.1f}s", flush=True)
        return self

    def __exit__(self, typ, exc, tb):
        secs = time.perf_counter() - self.t
        rec = {"phase": self.name, "seconds": round(secs, 2), "status": "ok" if exc is None else "failed"}
        if exc is not None:
            rec["error"] = "".join(traceback.format_exception_only(typ, exc)).strip()[-2000:]
            traceback.print_exception(typ, exc, tb)
        PHASES.append(rec)
        print(f"CHECK phase={self.name} status={rec['status']} seconds={secs:.2f}", flush=True)
        Phase.current = None
        if exc is not None:
            summary(self.name)
            os._exit(2)
        return False


def watchdog() -> None:
    time.sleep(TIMEOUT)
    name = Phase.current.name if Phase.current else "between phases"
    print(f"CHECK timeout: {TIMEOUT:.0f} s reached during phase={name}; stacks follow", flush=True)
    faulthandler.dump_traceback(all_threads=True)
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            print(
                f"CHECK child pid={child.pid} cmd={' '.join(child.cmdline())[:200]} status={child.status()}", flush=True
            )
            child.send_signal(signal.SIGUSR1)
        time.sleep(5)
    except Exception as e:  # psutil missing or a child gone: the parent's stacks are above
        print(f"CHECK could not signal children: {e}", flush=True)
    PHASES.append({"phase": name, "seconds": None, "status": "timeout"})
    summary(name)
    os._exit(3)


def tiny_llama(path: str) -> None:
    """A random 2-layer Llama: head_dim 64 (FlashAttention has kernels for it), vocab 4096."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        torch_dtype="bfloat16",
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def main() -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    threading.Thread(target=watchdog, daemon=True).start()
    with Phase("import_torch"):
        import torch

        print(
            f"CHECK torch {torch.__version__} cuda={torch.cuda.is_available()} "
            f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''}",
            flush=True,
        )
    with Phase("import_vllm"):
        import vllm

        print(f"CHECK vllm {vllm.__version__} from {vllm.__file__}", flush=True)
    if os.environ.get("CHECK_IMPORTS", "1") != "0":
        for mod in ENGINE_MODULES:
            with Phase(f"import:{mod}"):
                __import__(mod)
    work = tempfile.mkdtemp(prefix="vllm-check-")
    with Phase("build_tiny_llama"):
        tiny_llama(work)
    with Phase("LLM_init"):
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=work,
            skip_tokenizer_init=True,
            enforce_eager=os.environ.get("CHECK_EAGER", "1") != "0",
            gpu_memory_utilization=float(os.environ.get("CHECK_GPU_MEM", "0.2")),
            max_model_len=512,
            dtype="bfloat16",
            seed=0,
        )
    with Phase("generate"):
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": [1, 5, 6, 7, 8]}], params, use_tqdm=False)
        ids = list(outs[0].outputs[0].token_ids)
        print(f"CHECK generated {len(ids)} tokens: {ids}", flush=True)
        assert len(ids) == 16, ids
    summary(None)
    os._exit(0)  # no teardown hang after the report


if __name__ == "__main__":
    main()
