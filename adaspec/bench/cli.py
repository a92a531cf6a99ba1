"""`adaspec bench serve | sweep | report | merge` argument parsing; handlers import the heavy parts."""
from __future__ import annotations

import argparse
import sys

from adaspec.commands.options import ENGINE_OPTIONS, at_least
from adaspec.errors import AdaspecError


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return vals


def _phases(text: str):
    from adaspec.bench.phases import PhaseError, parse_phases

    try:
        return parse_phases(text)
    except PhaseError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


LOAD_PHASES_HELP = ("a load that moves: CONCURRENCYxREQUESTS phases run in order in one run, e.g. 1x20,64x200,1x20 "
                    "(requests are sent in order, each while fewer than its phase's concurrency are in flight); "
                    "metrics are reported for the whole run and per phase")


class _Given(argparse.Action):
    """Stores the value and notes that the flag was given (a default cannot tell), for flags that
    --load-phases replaces."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        given = set(getattr(namespace, "given_flags", None) or ())
        setattr(namespace, "given_flags", given | {option_string})


def _given(args, *flags: str) -> list[str]:
    seen = getattr(args, "given_flags", None) or set()
    return [f for f in flags if f in seen]


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", "--dataset-name", dest="dataset", choices=["eval-code", "jsonl", "custom", "random"],
                   default="eval-code",
                   help="prompt set (default: the packaged eval-code prompts; custom = jsonl, vLLM's name)")
    p.add_argument("--dataset-path", help="jsonl file, one {\"prompt\": ...} per line (with --dataset jsonl/custom)")
    p.add_argument("--random-input-len", type=int, default=64,
                   help="tokens per prompt for --dataset random (counted with --tokenizer)")
    p.add_argument("--tokenizer", help=ENGINE_OPTIONS["tokenizer"].help + " (default: --model; --dataset random "
                                       "counts its prompt lengths with it)")
    p.add_argument("--seed", type=int, default=0)


def _add_request_args(p: argparse.ArgumentParser, output_len: int) -> None:
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=at_least(1), default=output_len,
                   help="max_tokens of every request (--random-output-len: vLLM's name)")
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="spread each request's max_tokens uniformly over [L(1 - r), L(1 + r)] for L = --output-len, "
                        "0 <= r < 1, seeded by --seed (vLLM's flag, which also spreads its random dataset's input "
                        "lengths; here every dataset's output lengths; default 0: all L)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len tokens (server extension)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--backend", choices=sorted(BACKENDS), default=None,
                   help="openai or vllm: /v1/completions; openai-chat: /v1/chat/completions (as vLLM's bench serve)")
    p.add_argument("--endpoint", default=None,
                   help="completions, chat, or the path to post to (e.g. /v1/completions, /v1/chat/completions)")
    p.add_argument("--api-key", help="bearer token for servers started with --api-key")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}


def resolve_endpoint(backend: str | None, endpoint: str | None) -> tuple[str, str | None]:
    """(kind, path) from --backend and --endpoint: kind is completions or chat, path the URL path
    to post to (None: the kind's /v1 default)."""
    path = None
    kind = BACKENDS[backend] if backend else None
    if endpoint in ("completions", "chat"):
        ekind = endpoint
    elif endpoint:
        if not endpoint.startswith("/"):
            raise AdaspecError(f"--endpoint takes completions, chat or a path starting with /, got {endpoint!r}")
        path = endpoint.rstrip("/")
        ekind = "chat" if path.endswith("/chat/completions") else "completions" if path.endswith("/completions") else None
        if ekind is None and kind is None:
            raise AdaspecError(f"--endpoint {endpoint}: not a .../completions or .../chat/completions path; "
                               "give --backend openai or openai-chat to say which API it speaks")
        ekind = ekind or kind
    else:
        ekind = None
    if kind and ekind and kind != ekind:
        raise AdaspecError(f"--backend {backend} speaks the {kind} API but --endpoint {endpoint} is {ekind}")
    return ekind or kind or "completions", path


def _percentiles(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not vals or any(not 0 < v <= 100 for v in vals):
        raise argparse.ArgumentTypeError(f"percentiles must be in (0, 100], got {text!r}")
    return vals


def _metric_names(text: str) -> list[str]:
    from adaspec.bench.metrics import PERCENTILE_METRICS

    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in PERCENTILE_METRICS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"expected names from {','.join(PERCENTILE_METRICS)}, got {text!r}")
    return names


def _slo(text: str) -> tuple[str, float]:
    """One --goodput item, METRIC:MS (vLLM's spelling)."""
    from adaspec.bench.metrics import GOODPUT_METRICS

    name, _, value = text.partition(":")
    try:
        ms = float(value)
    except ValueError:
        ms = -1.0
    if name not in GOODPUT_METRICS or not ms >= 0:
        raise argparse.ArgumentTypeError(f"expected METRIC:MS with METRIC in {','.join(GOODPUT_METRICS)} and "
                                         f"MS >= 0, got {text!r}")
    return name, ms


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server (serve, sweep, report, merge)",
                                  description="Benchmark any OpenAI-compatible server: one run, a sweep, a report.")
    sub = bench.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])

    s = sub.add_parser("serve", help="one run against a running server (like `vllm bench serve`)")
    s.add_argument("--base-url", help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    _add_dataset_args(s)
    s.add_argument("--num-prompts", type=int, default=100, action=_Given)
    s.add_argument("--max-concurrency", type=int, default=None, action=_Given,
                   help="closed loop: at most C requests in flight")
    s.add_argument("--load-phases", type=_phases, default=None, metavar="CxN,...",
                   help=LOAD_PHASES_HELP + " (replaces --max-concurrency and --num-prompts)")
    s.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default inf: all at once)")
    s.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1 = Poisson)")
    _add_request_args(s, 128)
    s.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests sent first")
    s.add_argument("--continuous-usage-stats", action="store_true",
                   help="ask for usage in every chunk (vLLM extension): exact tokens per chunk")
    s.add_argument("--request-seeds", action="store_true",
                   help="send seed = --seed + i with every sampled request (repeatable sampling)")
    s.add_argument("--percentile-metrics", type=_metric_names, default=["ttft", "tpot", "itl"],
                   help="metrics to report percentiles of: ttft,tpot,itl,e2el (default ttft,tpot,itl, as vLLM)")
    s.add_argument("--metric-percentiles", type=_percentiles, default=[99.0],
                   help="percentiles to report, e.g. 25,50,99 (default 99)")
    s.add_argument("--goodput", type=_slo, nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs, e.g. ttft:500 tpot:50 (ms; ttft, tpot, e2el): request_goodput counts the requests "
                        "per second that meet all of them (vLLM's flag and key; null without it)")
    s.add_argument("--save-result", action="store_true", help="write the result JSON (to --result-dir/--result-filename)")
    s.add_argument("--result-dir", default=None, help="folder for --save-result (default: the current folder)")
    s.add_argument("--result-filename", default=None,
                   help="file name for --save-result (default: LABEL-RATEqps[-concurrencyC]-MODEL-DATE.json, as vLLM)")
    s.add_argument("--save-detailed", action="store_true",
                   help="with --save-result: also write the per-request lists (input_lens, output_lens, ttfts, itls, "
                        "latencies, errors, generated_texts, ...), as vLLM's flag; without it the file holds the "
                        "run's figures only")
    s.add_argument("--label", help="a name for this run, stored in the result")
    s.add_argument("--served-model-name", default=None,
                   help="the model name sent in the requests, when the server serves --model under another name "
                        "(vLLM's flag; default: --model)")
    s.add_argument("--top-p", type=float, default=None, help="top_p sent with every request (default: not sent)")
    s.add_argument("--top-k", type=int, default=None, help="top_k sent with every request (default: not sent)")
    s.add_argument("--min-p", type=float, default=None, help="min_p sent with every request (default: not sent)")
    s.add_argument("--request-id-prefix", default=None,
                   help="send request i with the header x-request-id: PREFIX + i (warm-ups: PREFIX warmup- i), "
                        "as vLLM's flag (default: no such header)")
    s.add_argument("--ready-check-timeout-sec", type=float, default=600.0,
                   help="wait up to this many seconds for the server to answer GET /v1/models before the run "
                        "(vLLM's flag; 0 skips the wait)")
    s.set_defaults(func=cmd_serve)

    w = sub.add_parser("sweep", help="arms x concurrency x repeats, servers started per arm; resumable")
    w.add_argument("--model", help="model to serve and name in requests (required unless every arm has --base-url)")
    w.add_argument("--drafter", help="drafter directory for the speculative arms (server default if omitted)")
    w.add_argument("--arms", default=None,
                   help="comma-separated: none, fixed:K, adaptive:K, adaptive-measured:K, adaptive-narrow:K, "
                        "adaptive-overhead:K, adaptive-tables:K, adaptive-tracked:K, adaptive-population:K, "
                        "adaptive-fused:K, adaptive-fused-overhead:K, adaptive-fused-measured:K (bench/arms.py says what each sets; default none,fixed:1,fixed:3,fixed:7,adaptive:7)")
    w.add_argument("--base-url", action="append", metavar="ARM=URL",
                   help="use a running server for ARM instead of starting one (repeatable; replaces --arms)")
    w.add_argument("--concurrency", type=_int_list, default=[1, 16, 32, 64, 128, 256], action=_Given)
    w.add_argument("--load-phases", type=_phases, default=None, metavar="CxN,...",
                   help=LOAD_PHASES_HELP + "; each arm runs this schedule once per repeat (replaces --concurrency "
                        "and --num-prompts)")
    w.add_argument("--repeats", type=int, default=3)
    w.add_argument("--num-prompts", type=int, default=200, action=_Given, help="prompts per point (at least C are sent)")
    w.add_argument("--prompts-per-concurrency", type=int, default=1, action=_Given, metavar="W",
                   help="at least W waves of C prompts per point: each point sends max(--num-prompts, W x C) "
                        "(default 1; a single wave at a high C is mostly ramp)")
    w.add_argument("--num-warmups", type=int, default=2,
                   help="unmeasured requests before each point, at most its concurrency of them at once (so a point's "
                        "concurrency is reached in the warm-up only when N >= C)")
    w.add_argument("--out", required=True,
                   help="results directory (rerun with the same --out and settings to resume)")
    w.add_argument("--force-new", action="store_true",
                   help="discard the points, logs and report an earlier sweep left in --out and start over")
    _add_dataset_args(w)
    _add_request_args(w, 128)
    w.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every `adaspec serve` (repeatable, e.g. --server-arg=--max-num-seqs=256)")
    w.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                   help="every server shards its model across N GPUs (adds --tensor-parallel-size to --server-arg)")
    w.add_argument("--speculative-config-extra", metavar="JSON", default=None,
                   help="JSON object merged into every speculative arm's --speculative-config")
    w.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    w.add_argument("--no-report", action="store_true", help="do not write the report at the end")
    w.set_defaults(func=cmd_sweep)

    r = sub.add_parser("report", help="tables, frontier plot and verdict from a sweep directory")
    r.add_argument("dir", help="the sweep's --out directory")
    r.add_argument("--html", action="store_true", help="also write report.html")
    r.set_defaults(func=cmd_report)

    g = sub.add_parser("merge", help="one report from the repeats of several sweeps of the same conditions",
                       description="Pool the repeats of several sweep directories measured under the same "
                                   "settings, engine commit, hardware, checkpoints and arm settings (refused "
                                   "otherwise, naming what differs) into a new directory with its own manifest "
                                   "and report.")
    g.add_argument("sources", nargs="+", help="two or more sweep --out directories")
    g.add_argument("--out", required=True, help="the new directory (must not exist or be empty)")
    g.add_argument("--assume-same-checkpoints", metavar="REASON", default=None,
                   help="for weights the checkpoint ids cannot vouch for (no model or drafter sha256 recorded, "
                        "servers at a --base-url): why you know the sources measured the same weights (written "
                        "into the manifest and the report)")
    g.add_argument("--assume-same-code", metavar="REASON", default=None,
                   help="for points whose engine commit had uncommitted changes (\"-dirty (unverified)\"): why you "
                        "know the sources ran the same code (written into the manifest and the report)")
    g.add_argument("--arms", default=None, help="merge only these arms (comma-separated names, e.g. adaptive:7,fixed:3)")
    g.add_argument("--concurrency", default=None, help="merge only these concurrencies (comma-separated)")
    g.set_defaults(func=cmd_merge)


def cmd_serve(args) -> int:
    import os

    from adaspec.bench.dataset import load_prompts
    from adaspec.bench.runner import BenchConfig, format_summary, result_filename, run_benchmark, write_json_atomic

    if args.output_len is not None and args.output_len < 1:
        raise AdaspecError("--output-len must be at least 1")
    range_ratio = _check_range_ratio(args)
    if (args.result_dir or args.result_filename) and not args.save_result:
        raise AdaspecError("--result-dir/--result-filename name where --save-result writes; add --save-result")
    num_prompts = args.num_prompts
    if args.load_phases:
        given = _given(args, "--max-concurrency", "--num-prompts") + (
            ["--request-rate"] if args.request_rate != float("inf") else [])
        if given:
            raise AdaspecError(f"--load-phases sets the concurrency and number of requests phase by phase; "
                               f"drop {', '.join(given)}")
        num_prompts = sum(p.num_requests for p in args.load_phases)
    if args.num_warmups < 0:
        raise AdaspecError(f"--num-warmups must be at least 0, got {args.num_warmups}")
    if not args.ready_check_timeout_sec >= 0:
        raise AdaspecError(f"--ready-check-timeout-sec must be at least 0, got {args.ready_check_timeout_sec}")
    if args.save_detailed and not args.save_result:
        raise AdaspecError("--save-detailed says what --save-result writes; add --save-result")
    kind, path = resolve_endpoint(args.backend, args.endpoint)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    model = args.model
    if args.dataset == "random" and not args.tokenizer and not model:
        # the prompts are counted in the model's tokens: ask the server which model it serves, as
        # the run would (vLLM does the same without --model)
        from adaspec.bench.runner import server_model

        model = server_model(base_url, args.api_key, args.ready_check_timeout_sec)
    # unlike `vllm bench serve`, --dataset random does not imply --ignore-eos: servers that refuse
    # the field (transformers serve) must stay measurable; the README says to add it
    ignore_eos = args.ignore_eos
    prompts = load_prompts(args.dataset, num_prompts, args.dataset_path, args.random_input_len, args.seed,
                           args.tokenizer or model)
    cfg = BenchConfig(
        base_url=base_url, model=model, prompts=prompts,
        max_concurrency=args.max_concurrency, request_rate=args.request_rate, burstiness=args.burstiness,
        output_len=args.output_len, random_range_ratio=range_ratio, ignore_eos=ignore_eos,
        temperature=args.temperature, num_warmups=args.num_warmups, endpoint=kind, endpoint_path=path,
        api_key=args.api_key, seed=args.seed,
        label=args.label, continuous_usage=args.continuous_usage_stats, request_seeds=args.request_seeds,
        progress=not args.disable_tqdm, percentile_metrics=args.percentile_metrics,
        metric_percentiles=args.metric_percentiles, load_phases=args.load_phases,
        goodput=dict(args.goodput) if args.goodput else None,
        backend=args.backend, served_model_name=args.served_model_name,
        sampling={"top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p},
        request_id_prefix=args.request_id_prefix, ready_check_timeout=args.ready_check_timeout_sec,
        keep_texts=args.save_detailed,
        extra={"dataset": args.dataset, "dataset_path": args.dataset_path},
    )
    res = run_benchmark(cfg)
    print(format_summary(res))
    if not res["completed"]:
        first = next((e for e in res["errors"] if e), "")
        print(f"adaspec: no request completed; first error: {first}", file=sys.stderr)
    if args.save_result:
        from adaspec.bench.metrics import PER_REQUEST_KEYS

        out = os.path.join(args.result_dir or ".", args.result_filename or result_filename(res))
        # as vLLM: the per-request lists only with --save-detailed (a sweep's points keep them all)
        write_json_atomic(out, res if args.save_detailed else {k: v for k, v in res.items() if k not in PER_REQUEST_KEYS})
        print(f"result written to {out}")
    return 0 if res["completed"] else 1


def sweep_config_from_args(args, log=print):
    from pathlib import Path

    from adaspec.bench import dataset
    from adaspec.bench.sweep import SweepConfig, arms_for, parse_base_urls

    if args.repeats < 1:
        raise AdaspecError("--repeats must be at least 1")
    if args.num_warmups < 0:
        raise AdaspecError(f"--num-warmups must be at least 0, got {args.num_warmups}")
    phases = getattr(args, "load_phases", None)
    waves = getattr(args, "prompts_per_concurrency", 1)
    if waves < 1:
        raise AdaspecError(f"--prompts-per-concurrency must be at least 1, got {waves}")
    if phases:
        given = _given(args, "--concurrency", "--num-prompts", "--prompts-per-concurrency")
        if given:
            raise AdaspecError(f"--load-phases sets the concurrency and number of requests phase by phase; "
                               f"drop {', '.join(given)}")
        concurrency = sorted({p.max_concurrency for p in phases})
        num_prompts = sum(p.num_requests for p in phases)
    else:
        concurrency = args.concurrency
        num_prompts = args.num_prompts
    base_urls = parse_base_urls(args.base_url)
    if base_urls and args.arms:
        raise AdaspecError("give either --arms (servers the sweep starts) or --base-url ARM=URL (servers you run)")
    if not args.model and not base_urls:
        raise AdaspecError("bench sweep needs --model (the model each arm's server loads)")
    arms = arms_for(args.arms, base_urls)
    spec_extra = {}
    if getattr(args, "speculative_config_extra", None):
        import json

        try:
            spec_extra = json.loads(args.speculative_config_extra)
        except json.JSONDecodeError as e:
            raise AdaspecError(f"--speculative-config-extra is not valid JSON: {e}") from None
        if not isinstance(spec_extra, dict):
            raise AdaspecError("--speculative-config-extra must be a JSON object")
    # The pool covers every point of this run, and those an earlier run left in --out (a resume checks
    # that the prompts they sent are the ones this pool gives them)
    pool = max(num_prompts, (1 if phases else waves) * max(concurrency + _earlier_concurrency(args)))
    kind, path = resolve_endpoint(args.backend, args.endpoint)
    if path is not None:
        raise AdaspecError("bench sweep posts to the /v1 paths; give --endpoint completions or chat (or --backend)")
    tokenizer = args.tokenizer or args.model
    prompts = dataset.load_prompts(args.dataset, pool, args.dataset_path, args.random_input_len, args.seed, tokenizer)
    return SweepConfig(
        out=Path(args.out), model=args.model, arms=arms, concurrency=concurrency, prompts=prompts,
        prompts_desc=dataset.describe(args.dataset, args.dataset_path, args.random_input_len, args.seed, tokenizer),
        num_prompts=num_prompts, prompts_per_concurrency=1 if phases else waves, repeats=args.repeats,
        load_phases=phases, drafter=args.drafter, base_urls=base_urls,
        output_len=args.output_len, random_range_ratio=_check_range_ratio(args), ignore_eos=args.ignore_eos,
        temperature=args.temperature, endpoint=kind, num_warmups=args.num_warmups, api_key=args.api_key,
        seed=args.seed,
        server_args=args.server_arg + _tp_server_args(getattr(args, "tensor_parallel_size", None)),
        spec_extra=spec_extra, startup_timeout=args.startup_timeout,
        force_new=getattr(args, "force_new", False),
        progress=not args.disable_tqdm,
        report=not args.no_report, log=log,
    )


def _earlier_concurrency(args) -> list[int]:
    """The concurrencies an earlier sweep in --out measured (none with --force-new)."""
    import json
    from pathlib import Path

    if getattr(args, "force_new", False):
        return []
    try:
        old = json.loads((Path(args.out) / "manifest.json").read_text())
        return [int(c) for c in old.get("concurrency") or []]
    except (OSError, ValueError, TypeError, AttributeError):
        return []  # no earlier sweep, or a record the sweep itself refuses with a clearer message


def _check_range_ratio(args) -> float:
    from adaspec.bench.lengths import check_range_ratio

    try:
        return check_range_ratio(args.random_range_ratio)
    except ValueError as e:
        raise AdaspecError(str(e)) from None


def _tp_server_args(size) -> list[str]:
    if size is None:
        return []
    if size < 1:
        raise AdaspecError(f"--tensor-parallel-size must be at least 1, got {size}")
    return ["--tensor-parallel-size", str(size)]


def cmd_sweep(args) -> int:
    from adaspec.bench.sweep import run_sweep

    res = run_sweep(sweep_config_from_args(args))
    if "report" in res:
        print(f"report: {res['report']['report_md']}  plot: {res['report']['frontier_png']}")
    return 0


def cmd_merge(args) -> int:
    from adaspec.bench.merge import merge_sweeps

    arms = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
    try:
        conc = [int(c) for c in args.concurrency.split(",")] if args.concurrency else None
    except ValueError:
        raise AdaspecError(f"--concurrency {args.concurrency!r}: expected integers, e.g. 64,256") from None
    res = merge_sweeps(args.sources, args.out, assume_same_checkpoints=args.assume_same_checkpoints, arms=arms,
                       concurrency=conc, assume_same_code=args.assume_same_code)
    print(res["report"]["markdown"])
    print(f"\nmerged {res['points']} points into {res['out']}; written: {res['report']['report_md']}, "
          f"{res['report']['frontier_png']}", file=sys.stderr)
    return 0


def cmd_report(args) -> int:
    from adaspec.bench.report import write_report

    res = write_report(args.dir, html_too=args.html)
    print(res["markdown"])
    print(f"\nwritten: {res['report_md']}, {res['frontier_png']}" + (f", {res['report_html']}" if args.html else ""),
          file=sys.stderr)
    return 0
