"""`python fake_api_servers_proc.py PORT API_SERVERS STEP_DELAY [DRAIN_TIMEOUT]`: adaspec.serve.server.run
on the fake engine in an engine process, with API_SERVERS HTTP server processes, in a process of
its own (main thread, real signal handling). The engine process and the extra API servers are
spawned: they import this script again, hence the __main__ guard."""
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from fake_engine import FakeEngine  # noqa: E402

from adaspec.serve.server import run  # noqa: E402
from adaspec.serve.state import ServerSettings  # noqa: E402

if __name__ == "__main__":
    port, servers, delay = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    drain = float(sys.argv[4]) if len(sys.argv) > 4 else 30.0
    factory = functools.partial(FakeEngine, step_delay=delay, max_model_len=4096, max_num_seqs=256,
                                num_kv_blocks=1 << 20)  # room for every request at once
    settings = ServerSettings(served_model_names=["fake"], drain_timeout=drain, engine_process=True,
                              api_server_count=servers, disable_log_requests=True)
    sys.exit(run(factory, settings, "127.0.0.1", port, "info", access_log=False))
