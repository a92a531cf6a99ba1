"""The offline API, shaped like vLLM's: LLM(model, **engine_args).generate(prompts, params)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence as Seq

from adaspec.config import EngineConfig
from adaspec.errors import InvalidRequestError
from adaspec.inputs import is_single_prompt, prompt_of
from adaspec.models.tokenizer import check_template_kwargs, message_for_template
from adaspec.outputs import RequestOutput
from adaspec.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str, **engine_args: Any):
        from adaspec.engine.llm_engine import LLMEngine

        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_args))
        self._counter = 0

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the model's recommended values (its generation_config.json,
        unless the engine was built with generation_config="vllm"), what generate uses without any."""
        return SamplingParams(**self.llm_engine.sampling_defaults)

    def chat(
        self,
        messages: list[dict] | Seq[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | Callable = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} messages) or a list of
        them, each through the model's chat template (its special tokens the template's own), then
        generate. ``tools``: OpenAI's function definitions, for the template (an assistant message's
        tool_calls reach it too, their arguments parsed); ``chat_template``, a template (or the name
        of one of the model's) in place of the model's; ``continue_final_message``, generation continues
        the last message (add_generation_prompt must then be false). Each output's `prompt` is the templated
        text; reading calls out of the text is the server's (serve/tool_parsers.py)."""
        tok = self.llm_engine.tokenizer
        if tok is None:
            raise InvalidRequestError("chat needs a tokenizer (this engine runs with skip_tokenizer_init=True)",
                                      param="messages")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of messages, or a list of such lists",
                                      param="messages")
        check_template_kwargs(chat_template_kwargs)
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        texts = []
        for conv in conversations:
            if not isinstance(conv, (list, tuple)) or not all(isinstance(m, dict) for m in conv):
                raise InvalidRequestError("each conversation must be a list of {\"role\", \"content\"} dicts",
                                          param="messages")
            conv = [message_for_template(m, f"messages[{i}]") for i, m in enumerate(conv)]
            texts.append(tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tools=tools,
                                                 chat_template=chat_template,
                                                 continue_final_message=continue_final_message,
                                                 **(chat_template_kwargs or {})))
        outs = self.generate([{"prompt_token_ids": tok.encode(t)} for t in texts], sampling_params, use_tqdm)
        for out, text in zip(outs, texts):
            out.prompt = text
        return outs

    def generate(
        self,
        prompts: str | list[int] | dict | Seq[str | list[int] | dict],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | Callable = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in input order. A
        prompt is a string, a list of token ids, or vLLM's TextPrompt / TokensPrompt dict
        (adaspec/inputs.py)."""
        if is_single_prompt(prompts):
            prompts = [prompts]
        prompts = [prompt_of(p) for p in prompts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        # only finished outputs are read here: the engine need not report the others every step
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) if isinstance(p, SamplingParams)
                  else p for p in params]
        engine = self.llm_engine
        ids, done = [], {}
        try:
            for prompt, p in zip(prompts, params):
                rid = f"gen-{self._counter}"
                self._counter += 1
                engine.add_request(rid, prompt, p)
                ids.append(rid)
            self._run_to_completion(ids, done, use_tqdm)
        except BaseException:  # a bad request, the progress bar, Ctrl-C: none of this call's requests go on
            for rid in ids:
                engine.abort_request(rid)
            try:
                while engine.has_unfinished_requests():  # the aborts' outputs, a step in flight
                    engine.step()
            except Exception:  # an engine that failed: the error that stopped this call is the one to see
                pass
            raise
        outs = [done[r] for r in ids]
        for out, p in zip(outs, params):
            for comp in out.outputs:
                if comp.logprobs is not None:
                    self._vllm_logprobs(comp, p.logprobs, p.greedy and not p.rules_may_move_argmax)
            if out.prompt_logprobs is not None:
                self._vllm_prompt_logprobs(out)
        return outs

    def _run_to_completion(self, ids: list[str], done: dict, use_tqdm: bool | Callable) -> None:
        """Step the engine until it has no work, keeping the finished outputs by request id."""
        bar = None
        if use_tqdm:  # vLLM's: True, or a tqdm-like class to make the bar with
            if callable(use_tqdm):
                make = use_tqdm
            else:
                from tqdm import tqdm as make
            bar = make(total=len(ids), desc="generate", unit="req")
        engine = self.llm_engine
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()

    def _vllm_prompt_logprobs(self, out) -> None:
        """Prompt logprobs as vLLM's Logprob objects: the top-n ranked 1..n, the prompt token with
        its exact rank (engine/prompt_logprobs.py), each with its decoded text."""
        from adaspec.outputs import Logprob, ranked_prompt_logprobs

        text = self._token_text
        out.prompt_logprobs = [None if r is None else {t: Logprob(lp, rank, text(t)) for t, lp, rank in r}
                               for r in ranked_prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs,
                                                               out.prompt_logprob_ranks)]

    def _token_text(self, tid: int) -> str:
        tok = self.llm_engine.tokenizer
        return tok.decode([tid], skip_special_tokens=False) if tok is not None else f"token_id:{tid}"

    def _vllm_logprobs(self, comp, top_n: int, argmax_is_chosen: bool = False) -> None:
        """A completion's logprob dicts as vLLM's LLM returns them: Logprob values with their rank
        and decoded token, and its cumulative_logprob. Each dict holds the vocabulary's top_n, whose
        ranks are exact, and the chosen token, an entry of its own when outside them (chosen_rank)."""
        from adaspec.outputs import Logprob

        text = self._token_text
        rebuilt, total = [], 0.0
        for chosen, d in zip(comp.token_ids, comp.logprobs):
            outside = len(d) > top_n  # the chosen token is not among the top_n
            top = sorted((t for t in d if not (outside and t == chosen)), key=lambda t: -d[t])
            lp = {t: Logprob(d[t], i + 1, text(t)) for i, t in enumerate(top)}
            if outside:
                rank = chosen_rank(d[chosen], [d[t] for t in top], argmax_is_chosen)
                lp[chosen] = Logprob(d[chosen], rank, text(chosen))
            rebuilt.append(lp)
            total += d[chosen]
        comp.logprobs, comp.cumulative_logprob = rebuilt, total



def chosen_rank(chosen_lp: float, top_lps: list[float], argmax_is_chosen: bool) -> int | None:
    """vLLM's rank (1 + the tokens with a higher logprob) of a chosen token that is no entry of
    the requested top n (top_lps, descending), where it can be known from them: the chosen token
    ties or beats the last of them (only the top n can then be above it), or none were asked
    for and the pick is the argmax (greedy, no rule moving it). None otherwise (not computed)."""
    if top_lps and chosen_lp >= top_lps[-1]:
        return 1 + sum(1 for v in top_lps if v > chosen_lp)
    if not top_lps and argmax_is_chosen:
        return 1
    return None
