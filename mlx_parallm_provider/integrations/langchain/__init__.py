"""LangChain adapters on the shared engine: :class:`MLXParallmLLM` (text completion,
``BaseLLM``), :class:`ChatMLXParallm` (``BaseChatModel``) and :class:`MLXParallmEmbeddings`
(``Embeddings``).

They only map types: LangChain messages and call kwargs to the chat layer
(:func:`~mlx_parallm_provider.chat.prepare_chat`) and :class:`SamplingParams`, engine
results to LangChain generations, messages and chunks. Batching happens in the engine,
which every front door (LiteLLM, LangChain, direct calls) shares per model name; errors
of this package (``ModelNotFoundError``, ``InvalidParameterError``, ...) propagate
unchanged. JSON output and forced tool calls are constrained by the chat layer's grammars;
with ``tool_choice="auto"`` malformed calls become ``invalid_tool_calls``, never an exception.
"""

from .chat import ChatMLXParallm
from .embeddings import MLXParallmEmbeddings
from .llm import MLXParallmLLM

__all__ = ["ChatMLXParallm", "MLXParallmEmbeddings", "MLXParallmLLM"]
