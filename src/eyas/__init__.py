"""eyas: train EAGLE-3 draft models for a target LLM and hand them to vLLM / SGLang."""

import os

__version__ = "0.1.0"

# torch's CPU threads spin while they wait for each other. Where another process also wants the
# cores (a vLLM engine beside eyas, a shared CI box), a spinning thread holds the core that its
# partner needs, and CPU decoding ran 4-6x slower (benchmarks/omp_wait_policy.md). So eyas's own
# threads sleep when idle, unless the user chose a policy. This only takes effect before torch is
# imported. vLLM's children get the user's environment back (eyas.vllm.process.engine_env).
OMP_POLICY_SET_BY_EYAS = "OMP_WAIT_POLICY" not in os.environ
if OMP_POLICY_SET_BY_EYAS:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
