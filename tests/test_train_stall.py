"""A step that does not end prints every thread's stack (eyas.train.stall)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)


def test_a_step_past_its_time_prints_where_it_hangs():
    res = _run(
        """
        import time
        from eyas.train.stall import StallWatch

        def stuck_in_the_step():
            time.sleep(0.6)

        with StallWatch(step_s=0.2) as watch:
            watch.arm()
            stuck_in_the_step()
            watch.disarm()
        """
    )
    assert res.returncode == 0, res.stderr
    assert "stuck_in_the_step" in res.stderr  # the stack, where it hung
    assert res.stderr.count("Timeout (") >= 2  # again while it still hangs


def test_steps_that_end_in_time_print_nothing():
    res = _run(
        """
        import time
        from eyas.train.stall import StallWatch

        with StallWatch(step_s=0.3, compile_s=1.0) as watch:
            watch.arm(compiling=True)
            time.sleep(0.5)  # a compiling step has the longer limit
            watch.disarm()
            for _ in range(5):
                watch.arm()
                time.sleep(0.1)
                watch.disarm()
            time.sleep(0.5)  # disarmed between steps
        """
    )
    assert res.returncode == 0 and res.stderr == "", res.stderr
