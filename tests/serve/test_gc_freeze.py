"""`adaspec serve` moves what startup built out of the garbage collector's generations (one engine
lives as long as the process), so collections during steps stop traversing the model."""
from __future__ import annotations

import gc

from fake_engine import FakeEngine

from adaspec.serve import server as server_module
from adaspec.serve.state import ServerSettings


def test_freeze_startup_objects_takes_live_objects_out_of_the_generations():
    sentinel = [["made before the freeze"]]  # lists are always tracked by the collector
    try:
        n = server_module.freeze_startup_objects()
        # frozen objects that die later leave the count (another thread of the worker may free a few
        # between the two reads: CI saw 693,017 then 693,015), so the count read now is at most n
        assert n > 0 and 0.9 * n <= gc.get_freeze_count() <= n
        assert not any(o is sentinel for o in gc.get_objects())  # frozen: no generation holds it
        later = [["made after"]]
        assert any(o is later for o in gc.get_objects())  # new objects are collected as usual
    finally:
        gc.unfreeze()


def test_run_freezes_after_the_engine_loaded_and_before_serving(monkeypatch):
    seen = {}

    class FakeServer:
        exit_code = 0

        def run(self, sockets):
            seen["frozen"] = gc.get_freeze_count()
            seen["engine"] = engine_thread[0].engine

    engine_thread = []

    def make_server(et, *a, **kw):
        engine_thread.append(et)
        return FakeServer()

    monkeypatch.setattr(server_module, "make_server", make_server)
    assert gc.get_freeze_count() == 0  # nothing froze before: what the server sees is its own freeze
    try:
        assert server_module.run(lambda: FakeEngine(), ServerSettings(served_model_names=["fake"]),
                                 "127.0.0.1", 0, "warning") == 0
    finally:
        gc.unfreeze()
    assert seen["frozen"] > 0 and isinstance(seen["engine"], FakeEngine)
