"""A stop request by signal (eyas.train.stop): one stop for the pair `timeout` sends, at once on a
later second signal."""

from __future__ import annotations

import os
import signal
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
