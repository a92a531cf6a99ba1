"""What the HTTP server costs on top of the engine: the real `adaspec serve` stack (uvicorn,
FastAPI, the engine thread, SSE streaming, metrics) around a fake engine whose step takes a fixed
time and emits one token (or --tokens-per-step) per running request, driven by the real
`adaspec bench serve` client (streaming completions, closed loop of C requests).

The fake step sleeps, which releases the GIL as a GPU step's wait for its results does, so the
gap between the measured output throughput and the ideal one, C x tokens-per-step per step time,
is the server's own work per step and per chunk (and the client's, on a small machine). This is
how the H200 frontier's "none" arm could make 4,033 tok/s through the server at C = 256 against
22,960 offline (BENCHMARKS.md, run 4): a server ceiling shows up here without a GPU.

    python3 benchmarks/serve_overhead_bench.py [--step-ms 10] [--concurrency 1,64,256] [--output-len 64]
        [--tokens-per-step 1] [--host-ms 0] [--engine-process] [--out FILE]

Prints per concurrency the output throughput, its ideal, their ratio and the ITL p50/p99, and
writes them as JSON (--out). One server per run; the client's numbers come from its result file.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from adaspec.bench.server import free_port

ROOT = Path(__file__).resolve().parents[1]

_SERVER = """
import functools
import sys
sys.path.insert(0, {tests!r})
from fake_engine import FakeEngine
from adaspec.serve.server import run
from adaspec.serve.state import ServerSettings
if __name__ == "__main__":  # the engine process (spawned) imports this script again
    factory = functools.partial(FakeEngine, step_delay={step_s!r}, max_model_len=4096, max_num_seqs={max_seqs},
                                num_kv_blocks=1 << 20, tokens_per_step={k}, host_work={host_s!r})
    sys.exit(run(factory, ServerSettings(served_model_names=["fake"], disable_log_requests=True,
                                         engine_process={process!r}, api_server_count={api_servers}),
                 "127.0.0.1", {port}, "warning", access_log=False))
"""


def _wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the server did not become healthy")


def _cpu_seconds(server: subprocess.Popen) -> dict[str, float]:
    """CPU seconds (user + system) so far of the server's process and of each process under it
    (the engine process, with --engine-process; the extra API servers, with --api-servers), by
    role: the HTTP side ("server", every process listening on a TCP port) or the engine's."""
    root = psutil.Process(server.pid)
    out = {"server": 0.0, "engine_process": 0.0}
    for p in [root] + root.children(recursive=True):
        try:
            t = p.cpu_times()
            # the engine process and the extra API servers run multiprocessing's spawn_main (its
            # resource tracker does not); only the API servers listen
            spawned = "spawn_main" in " ".join(p.cmdline())
            listens = spawned and any(c.status == psutil.CONN_LISTEN for c in p.net_connections(kind="tcp"))
            role = "server" if p.pid == root.pid or listens else ("engine_process" if spawned else "other")
        except psutil.Error:  # gone between the listing and the read
            continue
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


def _client_cpu_seconds() -> float:
    """CPU seconds of this process's reaped children: the bench clients run so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--step-ms", type=float, default=10.0, help="the fake engine's sleep per step (a GPU step's wait)")
    ap.add_argument("--concurrency", default="1,64,256")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--tokens-per-step", type=int, default=1, help=">1 mimics speculation: tokens per chunk")
    ap.add_argument("--prompts-per-request", type=int, default=2, help="requests per point = this x C (at least 8)")
    ap.add_argument("--host-ms", type=float, default=0.0,
                    help="pure-Python work per fake step that holds the GIL (a real step's host side), before its sleep")
    ap.add_argument("--engine-process", action="store_true", help="the engine in a process of its own")
    ap.add_argument("--api-servers", type=int, default=1,
                    help="HTTP server processes (adaspec serve --api-server-count; > 1 implies --engine-process)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    concs = [int(c) for c in args.concurrency.split(",")]
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    code = _SERVER.format(tests=str(ROOT / "tests" / "serve"), step_s=args.step_ms / 1000, max_seqs=max(concs),
                          k=args.tokens_per_step, port=port, host_s=args.host_ms / 1000,
                          process=args.engine_process or args.api_servers > 1, api_servers=args.api_servers)
    script = Path(tempfile.mkdtemp()) / "serve_fake.py"  # a file, not -c: a spawned engine process re-imports it
    script.write_text(code)
    server = subprocess.Popen([sys.executable, str(script)], env=env)
    rows = []
    try:
        _wait_healthy(port, server)
        with tempfile.TemporaryDirectory() as tmp:
            for c in concs:
                name = f"c{c}.json"
                n = max(8, args.prompts_per_request * c)
                cpu0, client0, t0 = _cpu_seconds(server), _client_cpu_seconds(), time.monotonic()
                subprocess.run([sys.executable, "-m", "adaspec.cli", "bench", "serve", "--port", str(port),
                                "--model", "fake", "--max-concurrency", str(c), "--num-prompts", str(n),
                                "--output-len", str(args.output_len), "--ignore-eos", "--temperature", "0",
                                "--disable-tqdm", "--num-warmups", str(min(c, 8)), "--save-result",
                                "--result-dir", tmp, "--result-filename", name],
                               env=env, check=True, stdout=subprocess.DEVNULL)
                wall = time.monotonic() - t0
                cpu1, client1 = _cpu_seconds(server), _client_cpu_seconds()
                r = json.loads((Path(tmp) / name).read_text())
                # cores each process kept busy over the client's whole run (its start-up and warm-ups
                # included), and its CPU time per output token: which process would bind first with
                # a core to itself
                cpu = {role: cpu1[role] - cpu0.get(role, 0.0) for role in cpu1}
                cpu["client"] = client1 - client0
                tokens = r["total_output_tokens"]
                busy = {role: round(v / wall, 3) for role, v in cpu.items()}
                us_per_token = {role: round(v * 1e6 / tokens, 1) for role, v in cpu.items() if v > 0}
                ideal = c * args.tokens_per_step * 1000.0 / (args.step_ms + args.host_ms)
                rows.append(dict(concurrency=c, num_prompts=n, output_throughput=r["output_throughput"],
                                 ideal_output_throughput=ideal, efficiency=r["output_throughput"] / ideal,
                                 median_itl_ms=r.get("median_itl_ms"), p99_itl_ms=r.get("p99_itl_ms"),
                                 median_ttft_ms=r.get("median_ttft_ms"), median_e2el_ms=r.get("median_e2el_ms"),
                                 mean_tokens_per_chunk=r.get("mean_tokens_per_chunk"),
                                 cores_busy=busy, cpu_us_per_output_token=us_per_token))
    finally:
        server.terminate()
        server.wait(30)
    print(f"fake engine step {args.step_ms} ms (of which {args.host_ms} ms host work holding the GIL), "
          f"{args.tokens_per_step} token(s) per step, {args.output_len} output tokens, {os.cpu_count()} CPUs, "
          f"engine in {'its own process' if args.engine_process or args.api_servers > 1 else 'a thread'}, "
          f"{args.api_servers} API server process(es)")
    print(f"{'C':>5} {'out tok/s':>10} {'ideal':>9} {'ratio':>6} {'ITL p50':>8} {'ITL p99':>8} {'TTFT p50':>8} "
          f"{'E2E p50':>8} {'tok/chunk':>9}  "
          f"CPU us per output token (cores busy)")
    for r in rows:
        per_process = ", ".join(f"{role} {us:.0f} ({r['cores_busy'][role]:.2f})"
                                for role, us in r["cpu_us_per_output_token"].items())
        print(f"{r['concurrency']:>5} {r['output_throughput']:>10.0f} {r['ideal_output_throughput']:>9.0f} "
              f"{r['efficiency']:>6.2f} {r['median_itl_ms'] or 0:>8.2f} {r['p99_itl_ms'] or 0:>8.2f} "
              f"{r['median_ttft_ms'] or 0:>8.1f} {r['median_e2el_ms'] or 0:>8.1f} {r['mean_tokens_per_chunk'] or 0:>9.2f}"
              f"  {per_process}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(args=vars(args), cpus=os.cpu_count(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
