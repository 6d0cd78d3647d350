"""Adapters of shoal's SDK to the frameworks users already build with. Each module imports its
framework on import (install it yourself); none imports torch.

    shoal.integrations.langchain   ShoalEmbeddings (Embeddings), ShoalRerank (BaseDocumentCompressor)
"""
