"""Why is speculation slower through the server on the GPU? Same request three ways:
offline on the main thread, offline on a worker thread, and through `adaspec serve`."""
import json, subprocess, sys, threading, time

import httpx

from adaspec import LLM, SamplingParams

SPEC = {"method": "dspark", "num_speculative_tokens": 7}
PROMPT = "def fib(n):\n    if n < 2:\n"
P = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True)


def offline(llm, label):
    llm.generate([PROMPT], SamplingParams(max_tokens=4))
    st = llm.llm_engine.stats
    d0, v0, s0, b0, n0 = st.time_draft, st.time_verify, st.time_sample, st.time_bookkeeping, st.num_steps
    t = time.perf_counter()
    llm.generate([PROMPT] * 4, P)
    dt = time.perf_counter() - t
    print(f"{label:<22} {4*64/dt:7.1f} tok/s  steps {st.num_steps-n0}  draft {st.time_draft-d0:.3f}s verify "
          f"{st.time_verify-v0:.3f}s sample {st.time_sample-s0:.3f}s book {st.time_bookkeeping-b0:.3f}s", flush=True)


llm = LLM("tiny", speculative_config=SPEC, max_num_seqs=16)
for i in range(4):  # the first calls pay one-time costs (kernel loading, allocator growth)
    offline(llm, f"main thread, call {i}")
th = threading.Thread(target=offline, args=(llm, "worker thread"))
th.start(); th.join()
srv = subprocess.Popen([sys.executable, "-m", "adaspec.cli", "serve", "tiny", "--port", "8311", "--max-num-seqs", "16",
                        "--speculative-config", json.dumps(SPEC), "--disable-uvicorn-access-log"])
for _ in range(120):
    try:
        if httpx.get("http://127.0.0.1:8311/health").status_code == 200:
            break
    except httpx.HTTPError:
        pass
    time.sleep(1)
body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 64, "temperature": 1.0, "ignore_eos": True}
httpx.post("http://127.0.0.1:8311/v1/completions", json=body, timeout=60)
for stream in (False, True):
    t = time.perf_counter()
    with httpx.Client(timeout=120) as c:
        import concurrent.futures as cf
        with cf.ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda _: c.post("http://127.0.0.1:8311/v1/completions", json={**body, "stream": stream}).text, range(4)))
    dt = time.perf_counter() - t
    print(f"server stream={stream!s:<6}  {4*64/dt:7.1f} tok/s", flush=True)
m = httpx.get("http://127.0.0.1:8311/metrics").text
print([l for l in m.splitlines() if l.startswith("adaspec:spec_decode_num_drafts_total") or l.startswith("adaspec:spec_decode_num_accepted_tokens_total")])
srv.terminate(); srv.wait(30)
