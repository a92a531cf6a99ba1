"""DrafterConfig: DeepSpec's DSpark config.json (the target's Qwen3 config plus drafter
fields) and our optional extras under the key "adaspec"."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from adaspec.errors import ConfigError, ModelLoadError
from adaspec.models.config import ModelConfig

ARCHITECTURE = "Qwen3DSparkModel"
OUR_KEY = "adaspec"  # our own extras in config.json; a public checkpoint lacks it
_DRAFT_KEYS = (
    "block_size", "mask_token_id", "target_layer_ids", "num_target_layers", "markov_rank",
    "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
)


def default_target_layers(num_target_layers: int, m: int | None = None) -> list[int]:
    """m layers spread evenly over 1..L-1 (the last decoder layer included: for a small target
    it carries most of the next-token information)."""
    L = num_target_layers
    m = m or min(5, max(1, L // 2))
    if m == 1:
        return [L - 1]
    return sorted({round(1 + i * (L - 2) / (m - 1)) for i in range(m)})


@dataclass
class DrafterConfig:
    base: ModelConfig  # layer shapes; base.num_hidden_layers = number of DRAFTER layers
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int
    markov_rank: int
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    confidence_temperatures: list[float] | None = None  # ours, from calibration (sampled requests)
    # ours: a second STS fit at T = 0 for greedy requests, whose acceptance (argmax match) is
    # higher than the 1 - TV rate the confidence head learns; falls back to the set above
    confidence_temperatures_greedy: list[float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # our other extras, kept as-is

    @property
    def num_layers(self) -> int:
        return self.base.num_hidden_layers

    @classmethod
    def from_target(cls, target: ModelConfig, *, mask_token_id: int, block_size: int = 7, num_layers: int = 1,
                    markov_rank: int = 64, target_layer_ids: list[int] | None = None) -> "DrafterConfig":
        hf = target.to_hf()
        hf["num_hidden_layers"] = num_layers
        base = ModelConfig.from_hf(hf)
        ids = list(target_layer_ids) if target_layer_ids else default_target_layers(target.num_hidden_layers)
        cfg = cls(base=base, block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=ids,
                  num_target_layers=target.num_hidden_layers, markov_rank=markov_rank)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.markov_head_type != "vanilla":
            raise ModelLoadError(f"markov_head_type {self.markov_head_type!r} is not supported (only 'vanilla')")
        if self.block_size < 1 or self.markov_rank < 1 or self.num_layers < 1:
            raise ModelLoadError("block_size, markov_rank and num_hidden_layers must be >= 1")
        bad = [i for i in self.target_layer_ids if not -1 <= i < self.num_target_layers]
        if bad or not self.target_layer_ids:
            raise ModelLoadError(
                f"target_layer_ids {self.target_layer_ids} must be non-empty and within -1..{self.num_target_layers - 1}"
            )
        if not 0 <= self.mask_token_id < self.base.vocab_size:
            raise ModelLoadError(f"mask_token_id {self.mask_token_id} is outside the vocabulary")
        for key in ("confidence_temperatures", "confidence_temperatures_greedy"):
            t = getattr(self, key)
            if t is not None and (len(t) != self.block_size or min(t) <= 0):
                raise ModelLoadError(f"{OUR_KEY}.{key} must be {self.block_size} positive numbers")

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> "DrafterConfig":
        archs = d.get("architectures") or []
        if ARCHITECTURE not in archs:
            raise ModelLoadError(f"not a DSpark drafter config: architectures {archs!r}, expected [{ARCHITECTURE!r}]")
        missing = [k for k in ("block_size", "mask_token_id", "target_layer_ids", "markov_rank") if k not in d]
        if missing:
            raise ModelLoadError(f"drafter config.json lacks {missing}")
        base_d = dict(d, architectures=["Qwen3ForCausalLM"], model_type=d.get("model_type") or "qwen3")
        base = ModelConfig.from_hf(base_d)
        ours = dict(d.get(OUR_KEY) or {})
        temps = ours.pop("confidence_temperatures", None)
        temps_greedy = ours.pop("confidence_temperatures_greedy", None)
        cfg = cls(
            base=base,
            block_size=int(d["block_size"]),
            mask_token_id=int(d["mask_token_id"]),
            target_layer_ids=[int(i) for i in d["target_layer_ids"]],
            num_target_layers=int(d.get("num_target_layers") or max(d["target_layer_ids"]) + 1),
            markov_rank=int(d["markov_rank"]),
            markov_head_type=str(d.get("markov_head_type", "vanilla")),
            enable_confidence_head=bool(d.get("enable_confidence_head", True)),
            confidence_head_with_markov=bool(d.get("confidence_head_with_markov", True)),
            confidence_temperatures=[float(t) for t in temps] if temps is not None else None,
            confidence_temperatures_greedy=[float(t) for t in temps_greedy] if temps_greedy is not None else None,
            extra=ours,
        )
        cfg.validate()
        return cfg

    def to_hf(self) -> dict[str, Any]:
        d = self.base.to_hf()
        d.pop(OUR_KEY, None)
        d.update(architectures=[ARCHITECTURE], model_type="qwen3", tie_word_embeddings=False,
                 **{k: getattr(self, k) for k in _DRAFT_KEYS})
        d["target_layer_ids"] = list(self.target_layer_ids)
        ours = dict(self.extra)
        if self.confidence_temperatures is not None:
            ours["confidence_temperatures"] = [float(t) for t in self.confidence_temperatures]
        if self.confidence_temperatures_greedy is not None:
            ours["confidence_temperatures_greedy"] = [float(t) for t in self.confidence_temperatures_greedy]
        if ours:
            d[OUR_KEY] = ours
        return d

    def check_target(self, target: ModelConfig) -> None:
        """Raise ConfigError saying what to change when this drafter cannot serve `target`."""
        problems = []
        if target.vocab_size != self.base.vocab_size:
            problems.append(f"vocab_size {self.base.vocab_size} != target's {target.vocab_size}")
        if target.hidden_size != self.base.hidden_size:
            problems.append(f"hidden_size {self.base.hidden_size} != target's {target.hidden_size}")
        if target.num_hidden_layers != self.num_target_layers:
            problems.append(f"num_target_layers {self.num_target_layers} != target's {target.num_hidden_layers} layers")
        if any(i >= target.num_hidden_layers for i in self.target_layer_ids):
            problems.append(f"target_layer_ids {self.target_layer_ids} exceed the target's {target.num_hidden_layers} layers")
        if problems:
            raise ConfigError(
                "the drafter was not trained for this target (" + "; ".join(problems) + "); "
                "pass the drafter trained for this target, or retrain one with `adaspec train drafter --target ...`"
            )


def with_temperatures(cfg: DrafterConfig, temps, greedy: bool = False) -> DrafterConfig:
    key = "confidence_temperatures_greedy" if greedy else "confidence_temperatures"
    return replace(cfg, **{key: [float(t) for t in temps]})
