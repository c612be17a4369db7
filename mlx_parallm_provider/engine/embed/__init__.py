"""Embeddings: the request type, its forward pass and the engine's embedding methods."""
