"""Fixtures for the serve tests; the live-server helpers are in live_server.py."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # repo root

from fake_engine import FakeEngine  # noqa: E402
from live_server import LiveServer  # noqa: E402


@pytest.fixture(scope="module")
def fake_server():
    s = LiveServer(lambda: FakeEngine(max_num_seqs=8, step_delay=0.001), names=("fake",), max_queue=64)
    yield s
    s.close()
