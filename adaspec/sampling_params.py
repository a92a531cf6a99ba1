"""SamplingParams: vLLM's names and defaults, validated once at construction."""
from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass

from adaspec.errors import InvalidRequestError


class RequestOutputKind(enum.Enum):
    """What LLMEngine.step reports for a request (vLLM's names): CUMULATIVE, its whole output so
    far after every step; FINAL_ONLY, nothing until it finishes (LLM.generate: no per-step copy of
    every request's tokens, which grows with the output length). NEW_TOKENS (ours, what the
    server asks for: serve/engine_thread.py, serve/engine_process.py): after every step, the token ids and
    logprobs that step added only, the text whole as in CUMULATIVE (unlike vLLM's DELTA, whose text
    is the new part): a cumulative copy of 256 requests' 2,000-token outputs took 4.3 ms a step on
    a CPU core, 0.4 ms at 64 tokens."""

    CUMULATIVE = 0
    FINAL_ONLY = 2
    NEW_TOKENS = 3

# Below this a temperature is greedy (vLLM's _SAMPLING_EPS): dividing logits by e.g. 1e-39
# overflows to inf and the softmax to NaN, so such a request would end at once.
SAMPLING_EPS = 1e-5
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 2**31 - 1  # the step builds int tensors from top_k; larger means "off" anyway
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # vLLM's bound (torch.long): a seed fits a tensor
MAX_TOKEN_ID = 2**63 - 1
MAX_N = 4096  # samples of one request (each is a request of the engine's: parallel_sampling.py)

# vLLM SamplingParams fields adaspec does not implement, with the values that ask for nothing
# (None always does): any other value is refused, naming the field, since ignoring it would sample
# from another distribution than the one asked for. The server refuses them the same way.
UNSUPPORTED_UNLESS: dict[str, tuple] = {
    "guided_decoding": (), "logits_processors": ([],), "best_of": (1,), "spaces_between_special_tokens": (True,),
}
MAX_PENALTY = 2.0  # presence and frequency penalties: OpenAI's and vLLM's range, [-2, 2]


def is_neutral(value, neutral: tuple) -> bool:
    """None, or one of `neutral` (an int standing for a float neutral counts: 0 for 0.0)."""
    if value is None:
        return True
    for n in neutral:
        same_kind = type(value) is type(n) or (type(n) is float and type(value) is int)
        if same_kind and value == n:
            return True
    return False


@dataclass
class SamplingParams:
    """How one request samples. Temperature 0 (or below ``SAMPLING_EPS``) means greedy.

    Field names follow vLLM's ``SamplingParams`` so code can move between the two.
    """

    n: int = 1  # samples of the prompt (engine/parallel_sampling.py: n child requests)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0: just the chosen)
    prompt_logprobs: int | None = None  # the same for every prompt token (engine/prompt_logprobs.py)
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: max_model_len), as vLLM
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's: False = the engine produces no text (token ids only; the server's API processes then
    # decode it, serve/engine_process.py). Stop strings need the text in the engine.
    detokenize: bool = True
    # the target's logits before sampling, in vLLM's order (sample/logits_rules.py): rows with any
    # of these run eagerly, outside the CUDA graphs
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # end-of-sequence and stop_token_ids masked (and stop strings unchecked) until then
    min_p: float = 0.0
    logit_bias: dict | None = None  # {token id: added to its logit}
    allowed_token_ids: list | None = None
    bad_words: list | None = None  # words (strings) whose last token is masked after the rest of them
    # the output follows a JSON schema, regex, choice or grammar (sample/structured_outputs.py);
    # a dict of StructuredOutputsParams' fields is taken too (it becomes one)
    structured_outputs: "StructuredOutputsParams | None" = None
    # vLLM's fields adaspec does not implement (UNSUPPORTED_UNLESS): vLLM's defaults, refused
    # at any value that asks for something (vLLM's old name of structured_outputs among them)
    guided_decoding: object = None
    logits_processors: list | None = None
    best_of: int | None = None
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [as_int(t) for t in self.stop_token_ids or []]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
        if self.temperature < SAMPLING_EPS:
            # greedy, as vLLM does below _SAMPLING_EPS; top-p and top-k cannot change an argmax, and
            # a row that kept them would take the filtered sampling paths for nothing (vLLM drops
            # them too: a model's recommended top_k reaches greedy requests as a default)
            self.temperature, self.top_p, self.top_k = 0.0, 1.0, 0

    def verify(self) -> None:
        """Validate again (fields are mutable): the engine calls this when a request is added, so
        a value the step could not use fails that request alone, never the step of a batch."""
        self.__post_init__()

    def _validate(self) -> None:
        def bad(msg: str, param: str) -> InvalidRequestError:
            return InvalidRequestError(msg, param=param)

        for name, neutral in UNSUPPORTED_UNLESS.items():
            v = getattr(self, name)
            if not is_neutral(v, neutral):
                only = " or ".join(repr(x) for x in neutral + (None,))
                hint = "; use structured_outputs (vLLM's newer name)" if name == "guided_decoding" else ""
                raise bad(f"{name} is not supported by adaspec (only {only}), got {v!r}{hint}", name)
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            raise bad(f"n must be an integer in [1, {MAX_N}], got {self.n!r}", "n")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise bad(f"{name} must be a number, got {v!r}", name)
            if v != v:  # NaN
                raise bad(f"{name} must be a number, got NaN", name)
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if self.temperature > MAX_TEMPERATURE:
            raise bad(f"temperature must be <= {MAX_TEMPERATURE:g}, got {self.temperature}", "temperature")
        if not (0 < self.top_p <= 1):
            raise bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOP_K:
            raise bad(f"top_k must be an integer in [0, {MAX_TOP_K}] (0 or -1 disables it), got {self.top_k!r}",
                      "top_k")
        if self.max_tokens is not None:
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
                raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}", "seed")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop must be a non-empty string or a list of non-empty strings", "stop")
        if self.stop and not self.detokenize:
            raise bad("stop strings need detokenize=True: the engine matches them in the text", "stop")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID
                   for t in self.stop_token_ids):
            raise bad("stop_token_ids must be a list of non-negative 64-bit integers", "stop_token_ids")
        k = self.truncate_prompt_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not (k == -1 or k >= 1)):
            raise bad(f"truncate_prompt_tokens must be -1 (max_model_len) or an integer >= 1, got {k!r}",
                      "truncate_prompt_tokens")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 20):
                raise bad(f"{name} must be an integer in [0, 20], got {v!r}", name)
        self._validate_logits_rules(bad)
        if self.structured_outputs is not None:
            if isinstance(self.structured_outputs, dict):
                self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs must be a StructuredOutputsParams (or a dict of its fields), got "
                          f"{type(self.structured_outputs).__name__}", "structured_outputs")
            self.structured_outputs.verify()
            if self.ignore_eos:  # the grammar's end allows the end-of-sequence token only: nothing could follow
                raise bad("structured_outputs cannot be combined with ignore_eos: once the output is complete, "
                          "the end of sequence is the only token it allows", "ignore_eos")

    def _validate_logits_rules(self, bad) -> None:
        """The fields of sample/logits_rules.py, with vLLM's ranges (token ids are checked against
        the model's vocabulary when the engine adds the request). logit_bias keys become ints."""
        def number(name: str):
            v = getattr(self, name)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise bad(f"{name} must be a finite number, got {v!r}", name)
            return v

        for name in ("presence_penalty", "frequency_penalty"):
            v = number(name)
            if v is not None and not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise bad(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v}", name)
        v = number("repetition_penalty")
        if v is not None and v <= 0:
            raise bad(f"repetition_penalty must be > 0 (1 disables it), got {v}", "repetition_penalty")
        v = number("min_p")
        if v is not None and not 0 <= v <= 1:
            raise bad(f"min_p must be in [0, 1], got {v}", "min_p")
        m = self.min_tokens
        if m is not None:
            if isinstance(m, bool) or not isinstance(m, int) or m < 0:
                raise bad(f"min_tokens must be an integer >= 0, got {m!r}", "min_tokens")
            if self.max_tokens is not None and m > self.max_tokens:
                raise bad(f"min_tokens ({m}) must be <= max_tokens ({self.max_tokens})", "min_tokens")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}",
                          "logit_bias")
            biases = {}
            for key, value in self.logit_bias.items():
                token = token_id(key)
                if token is None:
                    raise bad(f"logit_bias keys must be token ids (integers >= 0), got {key!r}", "logit_bias")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise bad(f"logit_bias values must be finite numbers, got {value!r} for token {key!r}",
                              "logit_bias")
                biases[token] = float(value)
            self.logit_bias = biases
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not ids or not all(token_id(t) is not None and
                                                                      not isinstance(t, str) for t in ids):
                raise bad("allowed_token_ids must be a non-empty list of token ids (integers >= 0)",
                          "allowed_token_ids")
            self.allowed_token_ids = list(ids)
        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
                raise bad("bad_words must be a list of non-empty strings", "bad_words")
            self.bad_words = list(words)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def rules_may_move_argmax(self) -> bool:
        """Whether a logits rule of sample/logits_rules.py may make the target's pick differ from
        the argmax of its raw logprobs (what logprobs report): penalties, min_tokens, a bias, an
        allowed set or bad words. min_p cannot, and a grammar's mask shows in the logprobs."""
        return not (is_neutral(self.repetition_penalty, (1.0,)) and is_neutral(self.presence_penalty, (0.0,))
                    and is_neutral(self.frequency_penalty, (0.0,)) and not self.min_tokens
                    and not any((self.logit_bias or {}).values()) and self.allowed_token_ids is None
                    and not self.bad_words)


@dataclass
class StructuredOutputsParams:
    """What the output must follow (vLLM's names): exactly one of a JSON schema (`json`, a dict or
    its JSON text), any JSON object (`json_object`), a regular expression, one of a list of
    strings (`choice`), a Lark or GBNF grammar (`grammar`), or a structural tag (`structural_tag`:
    llguidance's JSON form of one). disable_any_whitespace: JSON without whitespace between its
    tokens; disable_additional_properties: objects of a schema get no properties beyond those it
    names. Compiled and checked against the model's tokenizer when the engine adds the request
    (sample/structured_outputs.py)."""

    json: object = None
    regex: str | None = None
    choice: list | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    # vLLM's backend options: one backend here (llguidance), so these can only ask for its behaviour
    disable_fallback: bool = False
    whitespace_pattern: str | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    @classmethod
    def from_dict(cls, fields: dict) -> "StructuredOutputsParams":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(str(k) for k in fields if k not in known)
        if unknown:
            raise InvalidRequestError(f"structured_outputs has unknown field(s) {unknown}; it takes "
                                      f"{sorted(known)}", param="structured_outputs")
        return cls(**fields)

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg, param="structured_outputs")

        if self.structural_tag is not None:
            raise bad("structured_outputs.structural_tag is not supported by adaspec (json, regex, choice, grammar "
                      "and json_object are)")
        given = [k for k in self.KINDS if getattr(self, k) is not None and getattr(self, k) is not False]
        if len(given) != 1:
            raise bad("structured_outputs takes exactly one of json, regex, choice, grammar, json_object and "
                      f"structural_tag, got {given or 'none'}")
        kind = given[0]
        v = getattr(self, kind)
        if kind == "json" and not isinstance(v, (str, dict)):
            raise bad(f"structured_outputs.json must be a JSON schema (an object or its JSON text), got "
                      f"{type(v).__name__}")
        if kind in ("regex", "grammar", "structural_tag") and not (isinstance(v, str) and v):
            raise bad(f"structured_outputs.{kind} must be a non-empty string, got {v!r}")
        if kind == "choice" and not (isinstance(v, (list, tuple)) and v and all(isinstance(c, str) for c in v)):
            raise bad(f"structured_outputs.choice must be a non-empty list of strings, got {v!r}")
        if kind == "json_object" and v is not True:
            raise bad(f"structured_outputs.json_object must be true, got {v!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(getattr(self, name), bool):
                raise bad(f"structured_outputs.{name} must be a boolean, got {getattr(self, name)!r}")
        if self.whitespace_pattern is not None:
            raise bad("structured_outputs.whitespace_pattern is not supported (llguidance, adaspec's grammar "
                      "engine, takes disable_any_whitespace instead)")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) is not None and getattr(self, k) is not False)


def as_int(value):
    """An integer of any integral type (numpy's too) as a Python int; anything else (a bool among
    them) as it is, for the validation to name."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value) is not int:
        return int(value)
    return value


def token_ids(values) -> list[int] | None:
    """A list or tuple of integers (numpy's too, as a list of them converts) as Python ints, else None."""
    if not isinstance(values, (list, tuple)):
        return None
    ids = [as_int(t) for t in values]
    return ids if all(type(t) is int for t in ids) else None


def token_id(key) -> int | None:
    """A token id given as an int or a decimal string (JSON object keys are strings), else None."""
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key if 0 <= key <= MAX_TOKEN_ID else None
    if isinstance(key, str) and key.isascii() and key.isdigit():  # ("²".isdigit() is True)
        v = int(key)
        return v if v <= MAX_TOKEN_ID else None
    return None


def truncated_prompt(ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """The prompt's last truncate_prompt_tokens tokens (-1: max_model_len), as vLLM keeps them."""
    k = params.truncate_prompt_tokens
    if k is None:
        return ids
    k = max_model_len if k == -1 else k
    return ids[-k:] if len(ids) > k else ids
