"""OpenAI / LiteLLM call parameters to what the engine and the chat layer take.

:func:`prepare_call` reads one LiteLLM call (messages, ``optional_params``,
``litellm_params``, ``timeout``) into a :class:`LiteLLMCall`: the prepared prompts, one
:class:`SamplingParams`, ``n``. Parameters this provider cannot honour are a
``litellm.BadRequestError`` unless ``drop_params`` is on.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import litellm

from .._validation import check_int
from ..chat import PreparedPrompt, prepare_chat, prepare_text, structured_outputs_constraint
from ..engine import EngineLike, SamplingParams
from ..engine.fanout import MAX_N
from ..errors import InvalidParameterError
from ._common import PROVIDER

#: Parameters copied straight into :class:`SamplingParams`.
_SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "logit_bias", "seed", "stop", "stop_token_ids", "ignore_eos", "lora", "include_stop_str_in_output",
    "min_tokens", "allowed_token_ids", "bad_words", "skip_special_tokens", "truncate_prompt_tokens", "prompt_logprobs",
    "prediction",
)
#: Parameters of the chat layer.
_CHAT_KEYS = (
    "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "response_format", "continue_final_message",
    "structured_outputs", "chat_template_kwargs", "reasoning_effort", "thinking",
)
#: vLLM's structured-output fields before 0.12, by the ``structured_outputs`` key each became.
_GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
#: Parameters this provider honours.
_HANDLED_KEYS = frozenset((*_SAMPLING_KEYS, *_CHAT_KEYS, *_GUIDED_KEYS, "max_tokens", "max_completion_tokens", "n", "logprobs", "top_logprobs"))
#: Keys LiteLLM or OpenAI clients add that mean nothing for a local model: ignored.
_IGNORED_KEYS = frozenset((
    "stream", "stream_options", "max_retries", "timeout", "request_timeout", "user", "metadata",
    "extra_headers", "extra_query", "store", "service_tier", "safety_identifier",
    "prompt_cache_key", "prompt_cache_retention", "api_version", "deployment_id",
    "guided_decoding_backend",  # (vLLM's choice of grammar library; llguidance is the one here)
))


@dataclass(frozen=True)
class LiteLLMCall:
    """One LiteLLM call, translated: ``n`` choices of each prepared prompt."""

    model: str
    engine: EngineLike
    prompts: list[PreparedPrompt]
    params: SamplingParams
    n: int
    request_id: str

    @property
    def prompt_texts(self) -> list[Any]:
        return [p.prompt for p in self.prompts]


def prepare_call(
    engine: EngineLike,
    model: str,
    messages: list,
    optional_params: Mapping[str, Any],
    litellm_params: Mapping[str, Any],
    timeout: Any,
    *,
    stream: bool,
) -> LiteLLMCall:
    """Validate and translate one call; raises the package's errors (or LiteLLM's
    ``BadRequestError`` for parameters this provider does not support)."""
    params = _honoured_params(optional_params, litellm_params, model, stream=stream)
    sampling = _sampling_params(params, timeout)
    n = params.get("n", 1)
    check_int("n", n, minimum=1, maximum=MAX_N)
    if litellm_params.get("text_completion"):
        prompts = [prepare_text(p) for p in _text_prompts(messages)]
        constraint = structured_outputs_constraint(_structured_outputs(params))
    else:
        prompts = [_chat_prompt(engine, messages, params)]
        constraint = prompts[0].constraint  # JSON output, a forced tool call, structured_outputs
        if _flag(litellm_params.get("merge_reasoning_content_in_choices")):  # LiteLLM's: the thinking stays in the content
            prompts = [dataclasses.replace(p, reasoning=None) for p in prompts]
    if constraint is not None:
        sampling = dataclasses.replace(sampling, constraint=constraint)
    call_id = str(litellm_params.get("litellm_call_id") or time.time_ns())
    return LiteLLMCall(model, engine, prompts, sampling, n, call_id)


def merged_params(optional_params: Mapping[str, Any]) -> dict[str, Any]:
    """The call's parameters that are set, ``extra_body``'s merged in (they win)."""
    params = {k: v for k, v in optional_params.items() if v is not None and k != "extra_body"}
    extra_body = optional_params.get("extra_body") or {}
    if not isinstance(extra_body, Mapping):
        raise InvalidParameterError("extra_body", f"must be a dict, got {type(extra_body).__name__}")
    params.update({k: v for k, v in extra_body.items() if v is not None})
    return params


def refuse_unless_dropped(unsupported: list[str], params: Mapping[str, Any], litellm_params: Mapping[str, Any], model: str,
                          what: str = "", why: str = "") -> None:
    """LiteLLM's ``BadRequestError`` naming the ``unsupported`` parameters (and ``why``, where
    given), unless the call (or ``litellm.drop_params``) says to drop them."""
    if unsupported and not _drop_params(litellm_params):
        them = "them" if len(unsupported) > 1 else "it"
        raise litellm.BadRequestError(
            message=(
                f"{PROVIDER}{what} cannot honour {', '.join(f'{k}={params.get(k)!r}' for k in unsupported)}"
                f"{f' ({why})' if why else ''}. "
                f"Remove {them}, or set litellm.drop_params=True (or pass drop_params=True) to drop {them}."
            ),
            model=model,
            llm_provider=PROVIDER,
        )


def _honoured_params(
    optional_params: Mapping[str, Any], litellm_params: Mapping[str, Any], model: str, *, stream: bool
) -> dict[str, Any]:
    """The call's parameters (``extra_body`` merged in) minus ignored and dropped ones."""
    params = merged_params(optional_params)
    for key in _IGNORED_KEYS:
        params.pop(key, None)
    unsupported = _unsupported(params, stream=stream)
    refuse_unless_dropped(unsupported, params, litellm_params, model)
    if stream and params.get("prompt_logprobs") is not None:
        refuse_unless_dropped(["prompt_logprobs"], params, litellm_params, model, " streams",
                              "as in vLLM, they come with a whole response, not with stream=True")
        unsupported.append("prompt_logprobs")
    if litellm_params.get("text_completion"):
        asked = [k for k in ("logprobs", "top_logprobs") if params.get(k)] + (["prompt_logprobs"] if params.get("prompt_logprobs") is not None else [])
        refuse_unless_dropped(asked, params, litellm_params, model, " text completions",
                              "LiteLLM's text_completion returns no logprobs from a provider that answers as chat; litellm.completion does")
        unsupported += asked
    for key in unsupported:
        params.pop(key, None)
    return params


def _unsupported(params: Mapping[str, Any], *, stream: bool) -> list[str]:
    names = [k for k in params if k not in _HANDLED_KEYS]
    if stream and params.get("n", 1) != 1:
        names.append("n")  # LiteLLM's stream wrapper folds every choice into index 0
    return names


def _drop_params(litellm_params: Mapping[str, Any]) -> bool:
    return _flag(getattr(litellm, "drop_params", None)) or _flag(litellm_params.get("drop_params"))


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return value is True


def _sampling_params(params: Mapping[str, Any], timeout: Any) -> SamplingParams:
    kwargs = {k: params[k] for k in _SAMPLING_KEYS if k in params}
    max_tokens = params.get("max_completion_tokens", params.get("max_tokens"))
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    logprobs = params.get("logprobs")
    if isinstance(logprobs, int) and not isinstance(logprobs, bool):  # text completions: a count
        kwargs["logprobs"], kwargs["top_logprobs"] = logprobs > 0, logprobs
    elif logprobs is not None:
        kwargs["logprobs"] = logprobs
    if params.get("top_logprobs") is not None:
        kwargs["top_logprobs"] = params["top_logprobs"]
    kwargs["timeout"] = _timeout_seconds(timeout)
    return SamplingParams(**kwargs)  # validates every field


def _timeout_seconds(timeout: Any) -> Optional[float]:
    """LiteLLM's ``timeout`` (seconds, or an ``httpx.Timeout``) as the request's timeout."""
    if hasattr(timeout, "read"):  # an httpx.Timeout: its read timeout counts
        timeout = timeout.read
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidParameterError("timeout", f"must be a number of seconds > 0, got {timeout!r}")
    return float(timeout)


def _chat_prompt(engine: EngineLike, messages: list, params: Mapping[str, Any]) -> PreparedPrompt:
    tools, tool_choice = params.get("tools"), params.get("tool_choice")
    if tools is None and params.get("functions"):  # the legacy OpenAI form
        tools, tool_choice = params["functions"], params.get("function_call", tool_choice)
    if isinstance(tools, list) and not tools:
        # OpenAI rejects an empty list too; LiteLLM also turns a `tools` that is not a list
        # of dicts (tools="abc") into [] before the provider sees it.
        raise InvalidParameterError("tools", "must be a non-empty list of tool definitions (omit it for no tools)")
    return prepare_chat(
        engine.tokenizer,
        messages,
        tools=tools,
        tool_choice=tool_choice,
        response_format=params.get("response_format"),
        parallel_tool_calls=params.get("parallel_tool_calls"),
        continue_final_message=params.get("continue_final_message", False),
        structured_outputs=_structured_outputs(params),
        chat_template_kwargs=params.get("chat_template_kwargs"),
        reasoning_effort=params.get("reasoning_effort"),
        thinking=params.get("thinking"),
    )


def _structured_outputs(params: Mapping[str, Any]) -> Any:
    """vLLM's ``structured_outputs``, or the one its older ``guided_*`` fields make."""
    guided = {kind: params[key] for key, kind in _GUIDED_KEYS.items() if key in params}
    if not guided:
        return params.get("structured_outputs")
    if "structured_outputs" in params:
        raise InvalidParameterError("structured_outputs", f"give it or {', '.join(k for k in _GUIDED_KEYS if k in params)}, not both")
    return guided


def _text_prompts(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """``litellm.text_completion`` wraps each prompt as a user message: unwrap them."""
    prompts = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, str):
            raise InvalidParameterError(f"prompt[{i}]", "must be a string")
        prompts.append(content)
    return prompts
