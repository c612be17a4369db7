"""LangChain models served by the batching engine.

``from mlx_parallm_provider.langchain import MLXParallmLLM, ChatMLXParallm``; see
:mod:`mlx_parallm_provider.integrations.langchain`.
"""

from .integrations.langchain import ChatMLXParallm, MLXParallmLLM

__all__ = ["ChatMLXParallm", "MLXParallmLLM"]
