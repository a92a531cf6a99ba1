"""Models shipped inside the package, reachable by name."""
from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
EMBEDDED_MODELS = {
    "tiny": ASSETS / "models" / "tiny",
    "tiny-dspark": ASSETS / "models" / "tiny-dspark",
}
# default drafter for an embedded target
DEFAULT_DRAFTERS = {"tiny": "tiny-dspark"}


def resolve_model_path(name_or_path: str | Path) -> Path:
    """An embedded name ("tiny") or a directory path -> the directory."""
    key = str(name_or_path)
    if key in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[key]
    return Path(key).expanduser()


def model_display_name(name_or_path: str | Path) -> str:
    key = str(name_or_path)
    return key if key in EMBEDDED_MODELS else Path(key).expanduser().resolve().name
