"""Build the adaptive policy's step-cost tables (verify cost by token count, draft cost by
request count), print them and plot both curves.

The tables are the ones the engine builds at startup with enable_adaptive_verification: read
from the disk cache when a run with the same model, drafter, device and limits made them
before (--fresh profiles again). --speculative-config picks the drafter and k; adaptive
verification is always turned on.
"""
from __future__ import annotations

import json
from pathlib import Path

from adaspec.commands.options import ENGINE_OPTIONS, add_engine_args, add_option, engine_kwargs
from adaspec.commands.writable import OutputPath


def add_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure the verify/draft step-cost tables of the adaptive policy",
                       description=__doc__)
    add_option(p, ENGINE_OPTIONS["model"])
    p.add_argument("--out", type=OutputPath(Path, "dir"), default=Path("profile_out"),
                   help="folder for cost_model.json and cost_model.png")
    p.add_argument("--fresh", action="store_true", help="ignore the disk cache and profile again")
    add_engine_args(p, speculative_config='{"method": "dspark"}; adaptive verification is always on')
    p.set_defaults(func=run)


def run(args) -> int:
    import tempfile

    from adaspec.config import EngineConfig
    from adaspec.engine.llm_engine import LLMEngine
    from adaspec.errors import ConfigError
    from adaspec.spec_decode.cost_model import plot_cost_model

    try:
        spec = json.loads(args.speculative_config) if args.speculative_config else {"method": "dspark"}
    except json.JSONDecodeError as e:
        raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ConfigError("--speculative-config must be a JSON object")
    spec["enable_adaptive_verification"] = True
    if args.fresh:
        spec["cost_model_cache_dir"] = tempfile.mkdtemp(prefix="adaspec-profile-")
    kw = engine_kwargs(args)
    kw["speculative_config"] = spec
    engine = LLMEngine(EngineConfig.from_kwargs(args.model, **kw))
    cm = engine.spec.cost_model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cost_model.json").write_text(json.dumps(
        {"device": str(engine.device), "dtype": str(engine.dtype), "model": engine.model_name,
         "speculative_config": spec, "cost_model": cm.to_dict()}, indent=2))
    plot_cost_model(cm, out / "cost_model.png")
    print(f"{engine.model_name} on {engine.device} ({engine.dtype}), k={engine.spec.num_spec_tokens}")
    print(cm.describe())
    print(f"wrote {out / 'cost_model.json'} and {out / 'cost_model.png'}")
    return 0
