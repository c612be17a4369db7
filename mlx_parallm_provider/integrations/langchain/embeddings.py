""":class:`MLXParallmEmbeddings`: LangChain ``Embeddings`` on the shared engine."""

from __future__ import annotations

from typing import Optional

from langchain_core.embeddings import Embeddings
from pydantic import BaseModel, ConfigDict, Field, model_validator
from typing_extensions import Self

from ...engine.embed.request import check_options
from ...engine.request import check_truncate_prompt_tokens
from .fields import engine_for


class MLXParallmEmbeddings(BaseModel, Embeddings):
    """Embeddings from the shared batching engine (:meth:`Engine.embed
    <mlx_parallm_provider.engine.Engine.embed>`): every text of one ``embed_documents``
    call batches together, and concurrent calls (any thread or event loop) batch with each
    other and beside the engine's decoding rows. Vectors are L2-normalised. Example::

        embeddings = MLXParallmEmbeddings(model="default")              # mean pooling
        vectors = await embeddings.aembed_documents(["a text", "another"])
        qwen = MLXParallmEmbeddings(model="Qwen/Qwen3-Embedding-0.6B", pooling="last")
    """

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        default="default",
        description="'default', a path to an mlx-lm folder or a .gguf file, or a Hugging Face repo id; "
        "the same names as the LiteLLM provider's 'mlx-parallm/<model>'.",
    )
    pooling: str = Field(default="mean", description="'mean' over each text's tokens, or 'last' (the last token's state).")
    dimensions: Optional[int] = Field(default=None, description="Keep the first this many components (Matryoshka), renormalised.")
    timeout: Optional[float] = Field(default=None, description="Seconds one call may take; None: the engine's default.")
    truncate_prompt_tokens: Optional[int] = Field(default=None, description="Keep only a longer text's last that many tokens "
                                                  "(-1: the model's context length) instead of refusing it.")

    @model_validator(mode="after")
    def _check(self) -> Self:
        check_options(self.pooling, self.dimensions, None)
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        return self

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """One vector per text, in order, submitted as one engine call."""
        if not texts:
            return []
        return engine_for(self.model).embed_sync(texts, **self._options()).embeddings

    def embed_query(self, text: str) -> list[float]:
        """The vector of one text."""
        return engine_for(self.model).embed_sync([text], **self._options()).embeddings[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        """:meth:`embed_documents`, awaiting the engine on the caller's loop."""
        if not texts:
            return []
        return (await engine_for(self.model).embed(texts, **self._options())).embeddings

    async def aembed_query(self, text: str) -> list[float]:
        """:meth:`embed_query`, awaiting the engine on the caller's loop."""
        return (await engine_for(self.model).embed([text], **self._options())).embeddings[0]

    def _options(self) -> dict:
        return {"pooling": self.pooling, "dimensions": self.dimensions, "timeout": self.timeout,
                "truncate_prompt_tokens": self.truncate_prompt_tokens}
