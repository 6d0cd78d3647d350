"""HTTP API: native `/v1/encode`, OpenAI-compatible `/v1/embeddings`, models, health, metrics."""

from .app import create_app

__all__ = ["create_app"]
