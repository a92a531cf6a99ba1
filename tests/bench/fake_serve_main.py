"""Stands in for `python -m adaspec.cli serve MODEL --host H --port P [--speculative-config J]`
in sweep tests: serves the fake OpenAI server there until SIGTERM. It writes the arguments it got
to $FAKE_SERVE_LOG (one JSON per line) so tests can check what the sweep asked for.
"""
import argparse
import json
import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fakeserver import FakeServer, Script  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("cmd")
p.add_argument("model")
p.add_argument("--host")
p.add_argument("--port", type=int)
p.add_argument("--speculative-config")
args, rest = p.parse_known_args()
if args.model == "die":
    print("fake serve: cannot load model 'die'", file=sys.stderr)
    sys.exit(3)
with open(os.environ["FAKE_SERVE_LOG"], "a") as f:
    f.write(json.dumps({"model": args.model, "spec": args.speculative_config, "rest": rest, "pid": os.getpid()}) + "\n")
# Speculative arms stream 2-token chunks, the plain arm 1-token chunks.
ntok = 2 if args.speculative_config else 1
sc = Script(chunks=[(0.01, "t" * ntok, ntok)] * 4, counts_spec=bool(args.speculative_config))
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: stop.set())
with FakeServer({}, default=sc, port=args.port):
    stop.wait()
