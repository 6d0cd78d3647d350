"""Adapters of shoal's SDK to the frameworks users already build with. Each module imports its
framework on import (install it yourself); none imports torch (haystack itself does, where installed).

    shoal.integrations.langchain   ShoalEmbeddings (Embeddings, with embed_image), ShoalRerank (BaseDocumentCompressor)
    shoal.integrations.llamaindex  ShoalEmbedding (BaseEmbedding), ShoalMultiModalEmbedding
                                   (MultiModalEmbedding), ShoalRerank (BaseNodePostprocessor)
    shoal.integrations.haystack    ShoalTextEmbedder, ShoalDocumentEmbedder, ShoalRanker (components)
    shoal.integrations.chroma      ShoalEmbeddingFunction (chromadb EmbeddingFunction, registered as "shoal")
    shoal.integrations.lancedb     ShoalEmbeddingFunction (LanceDB registry entry "shoal")
    shoal.integrations.qdrant      ShoalHybrid: a dense + sparse collection, queries fused by RRF
"""
