"""Shared fixtures. Tiny models live in tests/tiny.py (import it as `tiny`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Tests never touch the user's ~/.cache/eyas unless they opt in."""
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path_factory.getbasetemp() / "eyas-cache"))


@pytest.fixture
def one_thread():
    """torch on one thread for the test: on 2 shared cores more threads only contend."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A random 8-layer Llama (H=64) with a ChatML byte-level BPE tokenizer."""
    return tiny.make_target(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_target(tiny_llama_dir):
    from eyas.target import resolve_target

    return resolve_target(tiny_llama_dir)
