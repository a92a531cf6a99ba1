"""What the routes share: settings, the engine thread, and the drain state."""
from __future__ import annotations

from dataclasses import dataclass, field

from adaspec.serve.errors import APIError
from adaspec.serve.prompt_bound import PromptBound
from adaspec.serve.tools import ToolSettings

# Room for a long-context prompt as token ids (~7 bytes each in JSON) or a small batch of them;
# a larger body is refused before it is read, let alone tokenized. --max-request-body-bytes.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20
# the server's log lines, and the engine process's (which configures its own logging: spawned)
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass
class ServerSettings:
    served_model_names: list[str]  # the first one is reported in responses
    model_path: str = ""  # what the engine was loaded from (GET /v1/models "root")
    api_key: str | None = None
    max_queue: int | None = None  # None: unlimited
    drain_timeout: float = 30.0  # seconds running requests get after SIGTERM before being aborted
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES  # larger bodies get a 413
    disable_log_requests: bool = False  # no per-request log line
    engine_process: bool = False  # the engine in a process of its own (engine_process.py), else a thread
    api_server_count: int = 1  # HTTP server processes on the one engine (api_servers.py); > 1 needs engine_process
    api_detokenize: bool = False  # the API servers decode the text, not the engine (engine_process.py); needs engine_process
    tools: ToolSettings = field(default_factory=ToolSettings)  # tool calling's flags (serve/tools.py)
    reasoning_parser: str | None = None  # --reasoning-parser: thinking to the "reasoning" field (serve/reasoning.py)
    chat_template: str | None = None  # --chat-template: a template, or a name of one of the model's, for every chat
    trust_request_chat_template: bool = False  # --trust-request-chat-template: a request may bring its own


    def __post_init__(self) -> None:
        from adaspec.errors import ConfigError
        from adaspec.serve.reasoning import REASONING_PARSERS

        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"--reasoning-parser must be one of {list(REASONING_PARSERS)}, got {self.reasoning_parser!r}")


@dataclass
class ServeState:
    settings: ServerSettings
    engine_thread: object  # engine_thread.EngineThread, or engine_process.EngineProcess (the same interface)
    draining: bool = False
    inflight: int = 0  # generation requests between submit and their response's end
    accepted_names: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        engine = self.engine_thread.engine
        # read-only after load, so the event loop may use them (the tokenizer is stateless)
        self.tokenizer = engine.tokenizer
        self.max_model_len = int(engine.max_model_len)
        # the model's recommended sampling, for fields a request leaves out (vLLM's generation_config)
        self.sampling_defaults = dict(getattr(engine, "sampling_defaults", {}) or {})
        # the engine's grammars wait for the end of a reply's thinking (its reasoning_parser)
        self.grammar_waits_for_thinking = bool(getattr(engine, "grammar_waits_for_thinking", False))
        # what tells a text that cannot fit whatever its tokenization: refused before tokenizing it
        self.prompt_bound = PromptBound.of(self.tokenizer)
        if self.settings.chat_template is not None:
            self._check_chat_template(self.settings.chat_template)
        self.model_name = self.settings.served_model_names[0]
        self.accepted_names = set(self.settings.served_model_names)
        # a client may name the model by its path or by the engine's name when none was set
        if self.settings.model_path and self.settings.model_path == self.model_name:
            self.accepted_names.add(str(getattr(engine, "model_name", self.model_name)))

    def _check_chat_template(self, template: str) -> None:
        """--chat-template compiles (with the model's tokenizer), or the server does not start."""
        from adaspec.errors import ConfigError, InvalidRequestError

        if self.tokenizer is None:
            raise ConfigError("--chat-template needs a tokenizer (this server runs with --skip-tokenizer-init)")
        try:
            self.tokenizer.compiled_template(self.tokenizer.template_text(template))
        except InvalidRequestError as e:
            raise ConfigError(f"--chat-template: {e}") from None

    @property
    def metrics(self):
        return self.engine_thread.metrics

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_names:
            raise APIError(404, f"The model `{model}` does not exist. Served: "
                                f"{', '.join(sorted(self.accepted_names))}.", "model", "model_not_found")
