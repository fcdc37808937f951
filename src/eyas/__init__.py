"""eyas: train EAGLE-3 draft models for a target LLM and hand them to vLLM / SGLang."""

import os

__version__ = "0.1.0"

# torch's CPU threads (libgomp) spin for a long while when they wait for each other. Where another
# process also wants the cores (a vLLM engine beside eyas, a shared CI box), a spinning thread holds
# the core its partner needs, and CPU decoding slows severalfold. A short spin keeps most of the speed on
# free cores and yields under contention (benchmarks/omp_wait_policy.md). Unless the user chose a
# setting; it only takes effect before torch is imported. vLLM's children get the user's environment
# back (eyas.vllm.process.engine_env).
OMP_SPIN_SET_BY_EYAS = not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ)
if OMP_SPIN_SET_BY_EYAS:
    os.environ["GOMP_SPINCOUNT"] = "1000"
