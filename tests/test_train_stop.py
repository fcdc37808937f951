"""A stop request by signal (eyas.train.stop): one stop for the pair `timeout` sends, at once on a
later second signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from eyas.train.stop import StopRequest


def _signal_self(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # the handler runs in the main thread at its next bytecode


def test_the_pair_of_signals_timeout_sends_is_one_stop_request():
    with StopRequest() as stop:
        _signal_self(signal.SIGINT)  # to the command
        _signal_self(signal.SIGINT)  # and again to its process group
        assert stop.requested


def test_a_later_second_signal_stops_at_once(monkeypatch):
    monkeypatch.setattr(StopRequest, "SAME_S", 0.05)
    with StopRequest() as stop:
        _signal_self(signal.SIGTERM)
        assert stop.requested
        time.sleep(0.1)
        with pytest.raises(KeyboardInterrupt):
            _signal_self(signal.SIGTERM)


def test_the_handlers_before_it_come_back():
    before = signal.getsignal(signal.SIGINT)
    with StopRequest():
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before


def test_a_signal_during_a_write_to_stderr_still_requests_the_stop():
    # the main thread blocked in a progress bar's write (a console that reads slowly) when the
    # signal lands: a handler printing through sys.stderr re-entered its buffer and raised there
    code = textwrap.dedent(
        """
        import sys
        from eyas.train.stop import StopRequest

        with StopRequest() as stop:
            print("ready", flush=True)
            for _ in range(40):
                sys.stderr.write("x" * (1 << 20) + "\\n")
                sys.stderr.flush()
        print("requested" if stop.requested else "not requested", flush=True)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stderr buffered, as by default
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
    )
    assert proc.stdout.readline() == "ready\n"
    time.sleep(0.5)  # nobody reads stderr yet: its pipe is full and the write blocks
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out == "requested\n", err.replace("x", "")[-2000:]
    assert "SIGINT: stopping after this step" in err
