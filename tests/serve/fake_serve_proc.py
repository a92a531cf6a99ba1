"""`python fake_serve_proc.py PORT DRAIN_TIMEOUT STEP_DELAY [LOAD_DELAY]`: adaspec.serve.server.run on the fake engine,
in its own process (main thread, real signal handling), for the SIGTERM drain tests.
$FAKE_FAIL_ON_STEP makes the engine's step raise from that step on."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fake_engine import FakeEngine  # noqa: E402

from adaspec.serve.server import run  # noqa: E402
from adaspec.serve.state import ServerSettings  # noqa: E402

port, drain, delay = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
load_delay = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0


def factory():
    time.sleep(load_delay)  # stands in for a slow model load
    fail = os.environ.get("FAKE_FAIL_ON_STEP")
    return FakeEngine(step_delay=delay, max_model_len=4096, fail_on_step=int(fail) if fail else None)


settings = ServerSettings(served_model_names=["fake"], drain_timeout=drain)
print("loading", flush=True)
sys.exit(run(factory, settings, "127.0.0.1", port, "warning"))
