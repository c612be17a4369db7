"""LangChain adapters on the shared engine: :class:`MLXParallmLLM` (text completion,
``BaseLLM``) and :class:`ChatMLXParallm` (``BaseChatModel``).

They only map types: LangChain messages and call kwargs to the chat layer
(:func:`~mlx_parallm_provider.chat.prepare_chat`) and :class:`SamplingParams`, engine
results to LangChain generations, messages and chunks. Batching happens in the engine,
which every front door (LiteLLM, LangChain, direct calls) shares per model name; errors
of this package (``ModelNotFoundError``, ``InvalidParameterError``, ...) propagate
unchanged. Tool calling and JSON output are prompted (there is no constrained decoding);
malformed calls become ``invalid_tool_calls``, never an exception.
"""

from .chat import ChatMLXParallm
from .llm import MLXParallmLLM

__all__ = ["ChatMLXParallm", "MLXParallmLLM"]
