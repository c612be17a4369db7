""":class:`MLXParallmLLM`: LangChain text completion (``BaseLLM``) on the shared engine."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, Optional, Union

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM, LanguageModelInput
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from langchain_core.runnables import Runnable, RunnableConfig
from pydantic import ConfigDict

from ...chat import structured_outputs_constraint
from ...engine import Completion, Delta, EngineLike, SamplingParams, Usage
from .._common import PROVIDER, usage_dict, vllm_prompt_logprobs
from .batch import BatchesFromOneThread, prefetched
from .fields import EngineFields, engine_for, logprobs_dict


class MLXParallmLLM(EngineFields, BatchesFromOneThread, BaseLLM):
    """Text completion on the shared batching engine: prompts go to the model as is.

    ``batch`` / ``abatch`` / ``generate`` submit every prompt to the engine at once
    (``generate_many``; sync calls from the calling thread), so they decode as one
    batch. With ``return_exceptions=True`` each prompt succeeds or fails on its own.
    Example::

        llm = MLXParallmLLM(model="default", max_tokens=64)
        await llm.abatch(["The capital of France is", "Two plus two is"])

    ``structured_outputs`` (vLLM's: ``{"choice": [...]}``, ``regex``, ``json``,
    ``grammar``, ``json_object``), given to ``bind`` or a call, constrains decoding.
    """

    model_config = ConfigDict(extra="forbid")
    CALL_KWARGS = frozenset(("structured_outputs",))

    @property
    def _llm_type(self) -> str:
        return PROVIDER

    def _generate(
        self,
        prompts: list[str],
        stop: Optional[list[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> LLMResult:
        engine, params, model = self._prepare(stop, kwargs)
        done = prefetched(engine, prompts[0], params) if len(prompts) == 1 else None
        return _llm_result([done] if done is not None else engine.generate_many_sync(prompts, params), model)

    async def _agenerate(
        self,
        prompts: list[str],
        stop: Optional[list[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> LLMResult:
        engine, params, model = self._prepare(stop, kwargs)
        return _llm_result(await engine.generate_many(prompts, params), model)

    def _stream(
        self,
        prompt: str,
        stop: Optional[list[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        engine, params, _ = self._prepare(stop, kwargs)
        deltas = engine.stream_sync(prompt, params)
        try:
            for delta in deltas:
                chunk = _generation_chunk(delta)
                if run_manager:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        finally:
            deltas.close()

    async def _astream(
        self,
        prompt: str,
        stop: Optional[list[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        engine, params, _ = self._prepare(stop, kwargs)
        deltas = engine.stream(prompt, params)
        try:
            async for delta in deltas:
                chunk = _generation_chunk(delta)
                if run_manager:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        finally:
            await deltas.aclose()

    def _batch_per_input(self, return_exceptions: bool) -> bool:
        # One generation for all inputs; with ``return_exceptions``, one run per input
        # (still one decode batch), so a bad input fails alone.
        return return_exceptions

    def _batch_request(self, value: LanguageModelInput, stop: Optional[list[str]], kwargs: dict[str, Any]) -> tuple[EngineLike, str, SamplingParams]:
        engine, params, _ = self._prepare(stop, kwargs)
        return engine, self._convert_input(value).to_string(), params

    async def abatch(
        self,
        inputs: list[LanguageModelInput],
        config: Union[RunnableConfig, list[RunnableConfig], None] = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[Any]:
        """One generation for all inputs; with ``return_exceptions``, concurrent runs per
        input (meeting in one decode batch), so a bad input fails alone."""
        if not return_exceptions or len(inputs) < 2:
            return await super().abatch(inputs, config, return_exceptions=return_exceptions, **kwargs)
        return await Runnable.abatch(self, inputs, config, return_exceptions=True, **kwargs)

    def _prepare(self, stop: Optional[list[str]], kwargs: Mapping[str, Any]) -> tuple[EngineLike, SamplingParams, str]:
        model, sampling, extra = self._split_call_kwargs(kwargs)
        params = self._sampling_params(stop, sampling)
        constraint = structured_outputs_constraint(extra.get("structured_outputs"))
        if constraint is not None:
            params = dataclasses.replace(params, constraint=constraint)
        return engine_for(model), params, model


def _llm_result(completions: list[Completion], model: str) -> LLMResult:
    generations = [[Generation(text=c.text, generation_info=_generation_info(c))] for c in completions]
    usage = Usage(
        prompt_tokens=sum(c.usage.prompt_tokens for c in completions),
        completion_tokens=sum(c.usage.completion_tokens for c in completions),
    )
    return LLMResult(generations=generations, llm_output={"token_usage": usage_dict(usage), "model_name": model})


def _generation_info(completion: Completion) -> dict[str, Any]:
    info: dict[str, Any] = {"finish_reason": completion.finish_reason, "token_usage": usage_dict(completion.usage)}
    if completion.logprobs is not None:
        info["logprobs"] = logprobs_dict(completion.logprobs)
    if completion.prompt_logprobs is not None:
        info["prompt_logprobs"] = vllm_prompt_logprobs(completion.prompt_logprobs)
    return info


def _generation_chunk(delta: Delta) -> GenerationChunk:
    info: Optional[dict[str, Any]] = None
    if delta.finish_reason is not None:
        info = {"finish_reason": delta.finish_reason}
        if delta.usage is not None:
            info["token_usage"] = usage_dict(delta.usage)
    if delta.logprobs:
        info = {**(info or {}), "logprobs": logprobs_dict(delta.logprobs)}
    if delta.prompt_logprobs is not None:
        info = {**(info or {}), "prompt_logprobs": vllm_prompt_logprobs(delta.prompt_logprobs)}
    return GenerationChunk(text=delta.text, generation_info=info)
