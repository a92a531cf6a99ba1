"""`python fake_serve_proc.py PORT DRAIN_TIMEOUT STEP_DELAY`: adaspec.serve.server.run on the fake engine,
in its own process (main thread, real signal handling), for the SIGTERM drain tests."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fake_engine import FakeEngine  # noqa: E402

from adaspec.serve.server import run  # noqa: E402
from adaspec.serve.state import ServerSettings  # noqa: E402

port, drain, delay = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
settings = ServerSettings(served_model_names=["fake"], drain_timeout=drain)
sys.exit(run(lambda: FakeEngine(step_delay=delay, max_model_len=4096), settings, "127.0.0.1", port, "warning"))
