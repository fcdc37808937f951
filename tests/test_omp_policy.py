"""eyas makes torch's idle CPU threads spin only briefly (GOMP_SPINCOUNT=1000) unless the user chose
a wait setting, and gives vLLM's children the user's environment back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")

PROBE = """
import json, os
import eyas
from eyas.vllm.process import engine_env
child = engine_env(__import__("pathlib").Path("pkg"))
print(json.dumps({"eyas": [os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")],
                  "vllm": [child.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")]}))
"""


def _probe(**chosen: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(chosen)
    env["PYTHONPATH"] = SRC
    res = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.splitlines()[-1])


def test_eyas_threads_spin_briefly_by_default_and_vllm_gets_the_users_environment():
    assert _probe() == {"eyas": [None, "1000"], "vllm": [None, None]}


def test_a_setting_the_user_chose_is_kept_for_eyas_and_vllm():
    assert _probe(OMP_WAIT_POLICY="ACTIVE") == {"eyas": ["ACTIVE", None], "vllm": ["ACTIVE", None]}
    assert _probe(GOMP_SPINCOUNT="50") == {"eyas": [None, "50"], "vllm": [None, "50"]}
