"""A step that does not end writes every thread's stack (eyas.train.stall)."""

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


def test_with_a_file_the_stacks_go_there_and_the_console_says_where(tmp_path):
    stalls = tmp_path / "stalls.txt"
    res = _run(
        f"""
        import time
        from pathlib import Path
        from eyas.train.stall import StallWatch

        def stuck_in_the_step():
            time.sleep(0.6)

        with StallWatch(Path({str(stalls)!r}), step_s=0.2) as watch:
            for _ in range(3):
                watch.arm()
                time.sleep(0.01)
                watch.disarm()
            watch.arm()
            stuck_in_the_step()
            watch.disarm()
        """
    )
    assert res.returncode == 0, res.stderr
    assert "stuck_in_the_step" in stalls.read_text() and "stuck_in_the_step" not in res.stderr
    assert res.stderr.count(str(stalls)) == 1 and "past its 0.2 s" in res.stderr  # the slow step only


def test_steps_that_end_in_time_print_nothing_and_leave_no_file(tmp_path):
    stalls = tmp_path / "stalls.txt"
    for where in ("", f"Path({str(stalls)!r}), "):
        res = _run(
            f"""
            import time
            from pathlib import Path
            from eyas.train.stall import StallWatch

            with StallWatch({where}step_s=0.3, compile_s=1.0) as watch:
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
    assert not stalls.exists()
