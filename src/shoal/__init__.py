"""shoal: an inference engine and cluster for small models (embedders, rerankers, extractors).

Importing this package is cheap: it does not import torch. Build a server with
`shoal.api.create_app(settings, service)` over any `shoal.service.Service` (the in-process
`shoal.engine.Engine` needs the `engine` extra), or run `shoal serve`.
"""

__version__ = "0.1.0"
