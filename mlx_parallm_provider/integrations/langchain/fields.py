"""What both LangChain models share: the model name, every sampling field, and the
mapping of usage and logprobs to LangChain's shapes."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Optional, Union

from langchain_core.messages import UsageMetadata
from pydantic import BaseModel, Field, model_validator
from typing_extensions import Self

from ...engine import EngineLike, SamplingParams, TokenLogprob, Usage, get_engine
from ...errors import InvalidParameterError
from .._common import PROVIDER

#: The :class:`SamplingParams` fields, settable as model fields and per call (``bind``).
#: ``constraint`` is not one: the chat layer derives it from ``response_format`` and tools.
SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "constraint")
#: Call kwargs LangChain itself may add, ignored here (tracing only, or already honoured).
_IGNORED_CALL_KWARGS = frozenset(("stream", "ls_structured_output_format", "structured_output_format"))
#: ``ChatOpenAI``'s other names for fields here, taken as constructor arguments and per call.
FIELD_ALIASES = {"max_completion_tokens": "max_tokens", "model_name": "model", "stop_sequences": "stop"}

_DEFAULTS = SamplingParams()  # the adapters' defaults are the engine's own


def engine_for(model: str) -> EngineLike:
    """The shared engine for ``model`` (one lookup, so tests can substitute one)."""
    return get_engine(model)


class EngineFields(BaseModel):
    """The fields both adapters share: the model name and every sampling setting.

    Defaults are :class:`SamplingParams`' own (greedy, no filtering, no penalties);
    the whole set is validated by building a :class:`SamplingParams`, so the accepted
    ranges are exactly the engine's. As in ``ChatOpenAI``, ``max_completion_tokens``,
    ``model_name`` and ``stop_sequences`` are other names for ``max_tokens``, ``model`` and
    ``stop``, and ``model_kwargs`` / ``extra_body`` hold more call parameters (vLLM's, for
    one) given to every call, under the call's own.
    """

    #: Call kwargs a subclass takes beside the sampling fields (e.g. the chat model's tools).
    CALL_KWARGS: ClassVar[frozenset[str]] = frozenset()

    model: str = Field(
        default="default",
        description="'default', a path to an mlx-lm folder or a .gguf file, or a Hugging Face "
        "repo id; the same names as the LiteLLM provider's 'mlx-parallm/<model>'.",
    )
    max_tokens: int = Field(default=_DEFAULTS.max_tokens, description="Most tokens to generate.")
    temperature: float = Field(default=_DEFAULTS.temperature, description="0 is greedy decoding.")
    top_p: float = _DEFAULTS.top_p
    top_k: int = _DEFAULTS.top_k
    min_p: float = _DEFAULTS.min_p
    repetition_penalty: float = _DEFAULTS.repetition_penalty
    presence_penalty: float = _DEFAULTS.presence_penalty
    frequency_penalty: float = _DEFAULTS.frequency_penalty
    logit_bias: Optional[dict[int, float]] = None
    stop: Optional[list[str]] = Field(default=None, description="Stop strings (not included in the output).")
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = _DEFAULTS.ignore_eos
    seed: Optional[int] = Field(default=None, description="Seed of this request's sampler (batch-independent).")
    logprobs: bool = _DEFAULTS.logprobs
    top_logprobs: int = _DEFAULTS.top_logprobs
    timeout: Optional[float] = Field(default=None, description="Per-request timeout in seconds.")
    lora: Optional[str] = Field(default=None, description="A LoRA adapter to answer through: a name registered with the engine's "
                                "add_lora, or an mlx-lm adapter folder (adapters.safetensors + adapter_config.json).")
    include_stop_str_in_output: bool = Field(default=_DEFAULTS.include_stop_str_in_output,
                                             description="Keep the stop string that ends the answer at its end.")
    min_tokens: int = Field(default=_DEFAULTS.min_tokens, description="Fewest tokens to generate before EOS, a stop token "
                            "or a stop string may end the answer.")
    allowed_token_ids: Optional[list[int]] = Field(default=None, description="The only token ids the answer may use.")
    bad_words: Optional[list[str]] = Field(default=None, description="Words the answer never writes.")
    skip_special_tokens: bool = Field(default=_DEFAULTS.skip_special_tokens,
                                      description="Leave special tokens' text out of the answer.")
    model_kwargs: dict[str, Any] = Field(default_factory=dict, description="More call parameters, given to every call "
                                         "(a call's own win).")
    extra_body: Optional[dict[str, Any]] = Field(default=None, description="More call parameters, as ChatOpenAI sends vLLM's "
                                                 "(min_tokens, structured_outputs, chat_template_kwargs, ...); a call's own win.")
    truncate_prompt_tokens: Optional[int] = Field(default=None, description="Keep only a longer prompt's last that many tokens "
                                                  "(-1: as many as fit beside max_tokens) instead of refusing it.")
    prompt_logprobs: Optional[int] = Field(default=None, description="vLLM's: each prompt token's logprob, with this many top "
                                           "alternatives (0-20), in response_metadata['prompt_logprobs'].")
    prediction: Optional[Union[str, dict[str, Any]]] = Field(default=None, description="OpenAI's predicted output (text the answer is "
                                                             "expected to be much like): drafts with n-gram speculation on.")

    @model_validator(mode="before")
    @classmethod
    def _none_is_unset(cls, data: Any) -> Any:
        return _without_unset(canonical_names(data)) if isinstance(data, Mapping) else data

    @model_validator(mode="after")
    def _validate_sampling(self) -> Self:
        try:
            _, sampling, _ = self._split_call_kwargs({})
            self._sampling_params(None, sampling)
        except InvalidParameterError as error:
            raise ValueError(str(error)) from None
        return self

    def _sampling_params(self, stop: Optional[list[str]], overrides: Mapping[str, Any]) -> SamplingParams:
        """This model's settings with per-call ``overrides``; a call's ``stop`` replaces the field's."""
        values = {name: getattr(self, name) for name in SAMPLING_FIELDS}
        values.update(_without_unset(overrides))
        if stop is not None:
            values["stop"] = stop
        return SamplingParams(**values)

    def _split_call_kwargs(self, kwargs: Mapping[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
        """``(model name, sampling overrides, other allowed kwargs)`` of a call's kwargs over
        ``model_kwargs`` and ``extra_body``; unknown kwargs raise."""
        extra = self.CALL_KWARGS
        body = kwargs.get("extra_body") or {}
        if not isinstance(body, Mapping):
            raise InvalidParameterError("extra_body", f"must be a dict of call parameters, got {type(body).__name__}")
        kwargs = {**canonical_names(self.model_kwargs), **canonical_names(self.extra_body or {}), **canonical_names(body),
                  **canonical_names({k: v for k, v in kwargs.items() if k != "extra_body"})}
        known = {*SAMPLING_FIELDS, *extra, *_IGNORED_CALL_KWARGS, "model"}
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            raise InvalidParameterError(
                unknown[0],
                f"is not a parameter of {type(self).__name__}; use one of "
                f"{', '.join(sorted((*SAMPLING_FIELDS, 'model', *extra)))}",
            )
        model = kwargs.get("model") or self.model
        sampling = {k: v for k, v in kwargs.items() if k in SAMPLING_FIELDS}
        rest = {k: v for k, v in kwargs.items() if k in extra}
        return model, sampling, rest

    def get_token_ids(self, text: str) -> list[int]:
        """``text``'s token ids as this model's own tokenizer writes them (no BOS or other
        special token added), or ``custom_get_token_ids``' where it is set; LangChain's token
        counts (``get_num_tokens``, ``trim_messages``) come from here. Loads the model on
        first use, as a call would."""
        custom = getattr(self, "custom_get_token_ids", None)
        if custom is not None:
            return custom(text)
        return list(engine_for(self.model).tokenizer.encode(text, add_special_tokens=False))

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, **{name: getattr(self, name) for name in SAMPLING_FIELDS},
                "model_kwargs": self.model_kwargs, "extra_body": self.extra_body}

    def _get_ls_params(self, stop: Optional[list[str]] = None, **kwargs: Any) -> Any:
        params = super()._get_ls_params(stop=stop, **kwargs)  # type: ignore[misc]
        params["ls_provider"] = PROVIDER
        params["ls_model_name"] = kwargs.get("model") or self.model
        if "ls_stop" not in params and self.stop:
            params["ls_stop"] = self.stop
        return params


#: Sampling fields that always have a value: None given for one means "not set" (the
#: engine's default on the model, the model's own value in a call), as LangChain models
#: take ``temperature=None`` or ``max_tokens=None``.
_NONE_IS_UNSET = frozenset(name for name in SAMPLING_FIELDS if EngineFields.model_fields[name].default is not None)


def canonical_names(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with :data:`FIELD_ALIASES`' names as the fields' own; both names given raise."""
    out = dict(values)
    for alias, name in FIELD_ALIASES.items():
        if alias in out:
            if name in out:
                raise InvalidParameterError(alias, f"is another name for {name}: give one of them")
            out[name] = out.pop(alias)
    return out


def _without_unset(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` without the fields of :data:`_NONE_IS_UNSET` given as None."""
    return {k: v for k, v in values.items() if not (v is None and k in _NONE_IS_UNSET)}


def usage_metadata(usage: Usage) -> UsageMetadata:
    """LangChain's ``usage_metadata`` for a request's usage."""
    return UsageMetadata(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        input_token_details={"cache_read": usage.cached_tokens},
        output_token_details={"reasoning": usage.reasoning_tokens},
    )


def logprobs_dict(logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's ``logprobs`` shape: ``{"content": [{"token", "logprob", "top_logprobs"}]}``."""
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "top_logprobs": [{"token": text, "logprob": value} for _, text, value in lp.top_logprobs],
            }
            for lp in logprobs
        ]
    }
