"""``/docs``: Swagger UI over ``/openapi.json``, its script and style served from the installed
``swagger-ui-py`` package (Swagger UI 5, which reads OpenAPI 3.1), so the page works on a machine
with no network; ``/favicon.ico`` is its icon. The package's folder is found without importing it
(its Python side, which renders pages for other frameworks, is not used)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from aiohttp import web

# path -> (the file in the package's static folder, its content type)
DOCS_ASSETS = {"/docs/swagger-ui.css": ("swagger-ui.css", "text/css"),
               "/docs/swagger-ui-bundle.js": ("swagger-ui-bundle.js", "text/javascript"),
               "/favicon.ico": ("favicon-32x32.png", "image/png")}

DOCS_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>pagedserve API</title>
<link rel="stylesheet" href="/docs/swagger-ui.css"></head>
<body><div id="ui"></div>
<script src="/docs/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#ui"});</script>
<noscript>The API description is at <a href="/openapi.json">/openapi.json</a>.</noscript>
</body></html>
"""


async def docs(request: web.Request) -> web.Response:
    return web.Response(text=DOCS_PAGE, content_type="text/html")


async def docs_asset(request: web.Request) -> web.Response:
    name, kind = DOCS_ASSETS[request.path]
    return web.Response(body=(_static() / name).read_bytes(), content_type=kind,
                        headers={"Cache-Control": "public, max-age=86400"})


@functools.cache
def _static() -> Path:
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        raise web.HTTPNotFound(text="Swagger UI's files are not installed (pip install swagger-ui-py)")
    return Path(spec.submodule_search_locations[0]) / "static"
