"""`adaspec demo`: the README's main command. A small sweep on the embedded `tiny` target and its
drafter, through the real server: no speculation, fixed k = 7, adaptive k = 7 at concurrency
1, 4, 16. It prints the exact `adaspec bench sweep` command it runs, then the report tables and a
reading computed from them (the Pareto edge per concurrency, the cost of a speculative step in
target steps, the profiled draft/verify costs), and writes the report and frontier plot to
runs/demo. Sized for < 5 minutes on 2 CPU cores; the server picks the GPU itself when there is one.
"""
from __future__ import annotations

import argparse
import shlex
import sys

from adaspec.errors import AdaspecError

DEFAULTS = {"arms": "none,fixed:7,adaptive:7", "concurrency": "1,4,16", "num_prompts": 8, "output_len": 64}
DEFAULT_OUT = "runs/demo"
QUICK = {"concurrency": "1,4", "num_prompts": 4, "output_len": 32}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="run a small benchmark sweep on the tiny model and show the frontier",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None,
                   help=f"results directory (default: ./{DEFAULT_OUT}, ./{DEFAULT_OUT}-quick with --quick; runs/ is git-ignored)")
    p.add_argument("--quick", action="store_true", help="concurrency 1,4, fewer prompts, shorter outputs")
    p.add_argument("--fresh", action="store_true", help="discard earlier results in --out instead of resuming (the sweep's --force-new)")
    p.add_argument("--model", default="tiny", help="target model (default: the embedded tiny model)")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the server's default for the model)")
    p.add_argument("--temperature", type=float, default=1.0, help="1.0 with probabilistic drafting is the headline")
    p.add_argument("--arms", default=None, help=f"default {DEFAULTS['arms']}")
    p.add_argument("--concurrency", default=None, help=f"default {DEFAULTS['concurrency']} ({QUICK['concurrency']} with --quick)")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts per point (at least C are sent)")
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--dataset", choices=["eval-code", "random"], default=None,
                   help="prompt set (default: eval-code when packaged; random suits micro test models)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG", help="extra `adaspec serve` argument")
    p.set_defaults(func=cmd_demo)


def out_dir(opts) -> str:
    # --quick measures other settings, so it keeps its own directory (a resume must not mix them).
    if opts.out == "":
        raise AdaspecError("--out takes a directory, got ''")
    return opts.out or (DEFAULT_OUT + "-quick" if opts.quick else DEFAULT_OUT)


def _given(value, default):
    """An option's value as given (0 and '' too: the sweep's parser then refuses them by name), else
    the default; `value or default` ran a given 0 or '' with the default, silently."""
    return default if value is None else value


def demo_sweep_argv(opts) -> list[str]:
    """The `bench sweep` arguments the demo runs. The demo parses exactly these with the CLI's own
    parser and prints them, so the printed command is the same run."""
    from adaspec.bench.dataset import eval_code_path

    size = QUICK if opts.quick else DEFAULTS
    conc_text = _given(opts.concurrency, size["concurrency"])
    try:
        concurrency = [int(c) for c in conc_text.split(",") if c.strip()]
    except ValueError:
        raise AdaspecError(f"--concurrency takes comma-separated integers, got {conc_text!r}") from None
    if not concurrency or min(concurrency) < 1:
        raise AdaspecError(f"--concurrency takes positive integers, got {conc_text!r}")
    dataset = opts.dataset or ("eval-code" if eval_code_path().is_file() else "random")
    argv = ["bench", "sweep", "--model", opts.model]
    if opts.drafter:
        argv += ["--drafter", opts.drafter]
    argv += ["--arms", _given(opts.arms, DEFAULTS["arms"]), "--concurrency", ",".join(map(str, concurrency)),
             "--repeats", "1", "--num-prompts", str(_given(opts.num_prompts, size["num_prompts"])), "--num-warmups", "1",
             "--output-len", str(_given(opts.output_len, size["output_len"])), "--ignore-eos",
             "--temperature", repr(float(opts.temperature)), "--dataset", dataset]
    if dataset == "random":
        argv += ["--random-input-len", "32"]
    # The servers never need more slots than the sweep's concurrency, and the adaptive arm
    # profiles its cost tables up to max_num_seqs at startup: keep that small.
    server_args = ([] if any(a.startswith("--max-num-seqs") for a in opts.server_arg)
                   else [f"--max-num-seqs={max(concurrency)}"]) + list(opts.server_arg)
    argv += [f"--server-arg={a}" for a in server_args]
    argv += ["--startup-timeout", "300", "--out", str(out_dir(opts))]
    if opts.fresh:
        argv.append("--force-new")
    return argv


def demo_sweep_args(opts) -> argparse.Namespace:
    """demo_sweep_argv parsed by the CLI's own parser."""
    from adaspec.cli import build_parser

    return build_parser().parse_args(demo_sweep_argv(opts))


def run_demo(opts, launcher: list[str] | None = None, log=print) -> dict:
    from adaspec.bench.aggregate import aggregate, arms_in_order
    from adaspec.bench.cli import sweep_config_from_args
    from adaspec.bench.reading import max_num_seqs_of, reading_lines
    from adaspec.bench.runner import BenchError
    from adaspec.bench.sweep import run_sweep

    argv = demo_sweep_argv(opts)
    args = demo_sweep_args(opts)
    cfg = sweep_config_from_args(args, log=log)
    cfg.launcher = launcher
    log(f"adaspec demo: {len(cfg.arms)} arms x {len(cfg.concurrency)} concurrencies, 1 repeat; "
        f"same as:\n  {shlex.join(['adaspec'] + argv)}")
    try:
        res = run_sweep(cfg)
    except BenchError as e:
        raise BenchError(f"{e} (`adaspec demo --fresh` is the demo's --force-new)") from None
    res["config"] = cfg  # the settings the demo ran (tests compare the printed command with them)
    rep = res["report"]
    md = rep["markdown"]
    # The tables and verdict are the demo's answer; the conditions stay in report.md.
    body = md[md.index("## Output throughput"):] if "## Output throughput" in md else md
    log("\n" + body)
    from adaspec.bench.aggregate import load_points

    points = load_points(cfg.out)
    log("\n".join(reading_lines(aggregate(points), arms_in_order(points, None), cfg.model, cfg.drafter,
                                max_num_seqs=max_num_seqs_of(cfg.server_args))))
    log(f"report: {rep['report_md']}\nplot:   {rep['frontier_png']}")
    log("This is one repeat on a toy model: a demonstration, not a published figure "
        "(use `adaspec bench sweep --repeats 3` for that).")
    return res


def cmd_demo(args) -> int:
    if args.num_prompts is not None and args.num_prompts < 1:
        raise AdaspecError("--num-prompts must be at least 1")
    try:
        run_demo(args)
    except KeyboardInterrupt:
        print(f"\ninterrupted; rerun the same command to continue from the finished points in {out_dir(args)}",
              file=sys.stderr)
        return 130
    return 0
