"""The HTTP API over any `Service`: `create_app` serves the routes of the route table
(`api/table.py`: every path, its handler, its body types), which the OpenAPI document describes.

    table     the routes, once          routes, tei  the verbs' handlers (wire types <-> calls)
    app       create_app, `endpoint`    plain        probes, metrics, the document
    openapi   the OpenAPI document      errors       the one error -> HTTP status map
    auth      bearer tokens             server       uvicorn with a public server's limits
"""

from .app import create_app

__all__ = ["create_app"]
