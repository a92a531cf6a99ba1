"""Models shipped inside the package, reachable by name, and the messages that say what to
pass when a name does not resolve to a usable model."""
from __future__ import annotations

import re
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
EMBEDDED_MODELS = {
    "tiny": ASSETS / "models" / "tiny",
    "tiny-dspark": ASSETS / "models" / "tiny-dspark",
}
# default drafter for an embedded target
DEFAULT_DRAFTERS = {"tiny": "tiny-dspark"}
DRAFTER_ARCHITECTURE = "Qwen3DSparkModel"  # DeepSpec's DSpark drafter config.json
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model_path(name_or_path: str | Path) -> Path:
    """An embedded name ("tiny") or a directory path -> the directory."""
    key = str(name_or_path)
    if key in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[key]
    return Path(key).expanduser()


def model_display_name(name_or_path: str | Path) -> str:
    key = str(name_or_path)
    return key if key in EMBEDDED_MODELS else Path(key).expanduser().resolve().name


def embedded_names() -> str:
    """'tiny (target), tiny-dspark (drafter for tiny)'."""
    drafter_of = {d: t for t, d in DEFAULT_DRAFTERS.items()}
    return ", ".join(f"{n} (drafter for {drafter_of[n]})" if n in drafter_of else f"{n} (target)"
                     for n in EMBEDDED_MODELS)


def missing_model_message(name_or_path: str | Path, path: Path) -> str:
    """Why `name_or_path` is not a model directory, and what to pass instead."""
    key = str(name_or_path)
    hub = (bool(_HUB_ID.fullmatch(key)) and not key.startswith((".", "/", "~"))
           and not Path(key).expanduser().parent.is_dir())
    head = (f"{key!r} looks like a Hugging Face Hub id, but adaspec does not download models: download it "
            f"first (e.g. huggingface-cli download {key} --local-dir DIR) and pass the local directory"
            if hub else f"model directory not found: {key} (looked at {path.expanduser().resolve()})")
    return f"{head}. Embedded models, usable by name: {embedded_names()}"


def is_drafter_config(config: dict) -> bool:
    return DRAFTER_ARCHITECTURE in (config.get("architectures") or [])


def drafter_as_target_message(name_or_path: str | Path, path: Path) -> str:
    """`name_or_path` holds a DSpark drafter where a target model was expected."""
    name = next((n for n, p in EMBEDDED_MODELS.items() if Path(path).resolve() == p.resolve()), str(name_or_path))
    target = next((t for t, d in DEFAULT_DRAFTERS.items() if d == name), "TARGET")
    return (f"{name} is a DSpark drafter ({DRAFTER_ARCHITECTURE} in its config.json), not a target model: "
            f"load its target and pass the drafter as the speculative model, e.g. "
            f"adaspec generate {target} --speculative-config '{{\"method\": \"dspark\", \"model\": \"{name}\"}}' "
            f"or LLM(\"{target}\", speculative_config={{\"method\": \"dspark\", \"model\": \"{name}\"}})")
