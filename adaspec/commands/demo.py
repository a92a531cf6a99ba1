"""`adaspec demo`: the README's main command. A small sweep on the embedded `tiny` target and its
drafter, through the real server: no speculation, fixed k = 7, adaptive k = 7 at concurrency
1, 4, 16; then the report table and the frontier plot. Sized for < 5 minutes on 2 CPU cores;
the server picks the GPU itself when there is one.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from adaspec.errors import AdaspecError

DEFAULTS = {"arms": "none,fixed:7,adaptive:7", "concurrency": "1,4,16", "num_prompts": 8, "output_len": 64}
QUICK = {"concurrency": "1,4", "num_prompts": 4, "output_len": 32}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="run a small benchmark sweep on the tiny model and show the frontier",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="adaspec-demo", help="results directory (default: ./adaspec-demo)")
    p.add_argument("--quick", action="store_true", help="concurrency 1,4, fewer prompts, shorter outputs")
    p.add_argument("--fresh", action="store_true", help="discard earlier results in --out instead of resuming")
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


def demo_sweep_args(opts) -> argparse.Namespace:
    """The `bench sweep` arguments the demo stands for (printed, so users can rerun it bigger)."""
    from adaspec.bench.dataset import eval_code_path

    size = QUICK if opts.quick else DEFAULTS
    conc_text = opts.concurrency or size["concurrency"]
    try:
        concurrency = [int(c) for c in conc_text.split(",") if c.strip()]
    except ValueError:
        raise AdaspecError(f"--concurrency takes comma-separated integers, got {conc_text!r}") from None
    if not concurrency or min(concurrency) < 1:
        raise AdaspecError(f"--concurrency takes positive integers, got {conc_text!r}")
    return argparse.Namespace(
        model=opts.model, drafter=opts.drafter, arms=opts.arms or DEFAULTS["arms"], base_url=None,
        concurrency=concurrency,
        repeats=1, num_prompts=opts.num_prompts or size["num_prompts"], num_warmups=1, out=opts.out,
        dataset=opts.dataset or ("eval-code" if eval_code_path().is_file() else "random"), dataset_path=None,
        random_input_len=32, seed=0, output_len=opts.output_len or size["output_len"], ignore_eos=True,
        temperature=opts.temperature, endpoint="completions", api_key=None, disable_tqdm=False,
        # the servers never need more slots than the sweep's concurrency, and the adaptive arm
        # profiles its cost tables up to max_num_seqs at startup: keep that small
        server_arg=(["--max-num-seqs", str(max(concurrency))]
                    if not any(a.startswith("--max-num-seqs") for a in opts.server_arg) else []) + opts.server_arg,
        startup_timeout=300.0, no_report=False,
    )


def run_demo(opts, launcher: list[str] | None = None, log=print) -> dict:
    from adaspec.bench.cli import sweep_config_from_args
    from adaspec.bench.sweep import run_sweep

    out = Path(opts.out)
    if opts.fresh:
        # Only what a sweep writes; anything else the user keeps there stays.
        shutil.rmtree(out / "points", ignore_errors=True)
        for name in ("manifest.json", "report.md", "frontier.png"):
            (out / name).unlink(missing_ok=True)
    args = demo_sweep_args(opts)
    cfg = sweep_config_from_args(args, log=log)
    cfg.launcher = launcher
    cmd = (f"adaspec bench sweep --model {args.model}" + (f" --drafter {args.drafter}" if args.drafter else "")
           + f" --arms {args.arms} --concurrency {','.join(map(str, args.concurrency))} --repeats 1"
           f" --num-prompts {args.num_prompts} --output-len {args.output_len} --ignore-eos"
           f" --temperature {args.temperature} --dataset {args.dataset} --out {args.out}")
    log(f"adaspec demo: {len(cfg.arms)} arms x {len(args.concurrency)} concurrencies, 1 repeat; same as:\n  {cmd}")
    res = run_sweep(cfg)
    rep = res["report"]
    md = rep["markdown"]
    # The tables and verdict are the demo's answer; the conditions stay in report.md.
    body = md[md.index("## Output throughput"):] if "## Output throughput" in md else md
    log("\n" + body)
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
        print(f"\ninterrupted; rerun the same command to continue from the finished points in {args.out}",
              file=sys.stderr)
        return 130
    return 0
