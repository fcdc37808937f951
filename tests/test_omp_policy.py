"""eyas makes torch's idle CPU threads sleep (OMP_WAIT_POLICY=PASSIVE) unless the user chose a
policy, and gives vLLM's children the user's environment back."""

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
print(json.dumps({"eyas": os.environ.get("OMP_WAIT_POLICY"),
                  "vllm": engine_env(__import__("pathlib").Path("pkg")).get("OMP_WAIT_POLICY")}))
"""


def _probe(policy: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    env["PYTHONPATH"] = SRC
    res = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.splitlines()[-1])


def test_eyas_threads_sleep_by_default_and_vllm_gets_the_users_environment():
    assert _probe(None) == {"eyas": "PASSIVE", "vllm": None}


def test_a_policy_the_user_chose_is_kept_for_eyas_and_vllm():
    assert _probe("ACTIVE") == {"eyas": "ACTIVE", "vllm": "ACTIVE"}
