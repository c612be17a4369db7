"""LangChain models served by the batching engine.

``from mlx_parallm_provider.langchain import MLXParallmLLM, ChatMLXParallm, MLXParallmEmbeddings``; see
:mod:`mlx_parallm_provider.integrations.langchain`.
"""

from .integrations.langchain import ChatMLXParallm, MLXParallmEmbeddings, MLXParallmLLM

__all__ = ["ChatMLXParallm", "MLXParallmEmbeddings", "MLXParallmLLM"]
