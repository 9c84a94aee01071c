"""The OpenAPI schema's request bodies. Routes parse their bodies themselves (serve/body.py: size limits, Unicode
checks, errors in the route's own shape), so FastAPI cannot see the pydantic model behind a body; a route names
it with `openapi_extra=request_body(Model)`, and `install` puts every named model (and the models it nests) under
`components/schemas`, where the `$ref`s point."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"
_BODIES: dict[str, type[BaseModel]] = {}  # schema name -> model, for every request_body() a route declared


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body `model` parses."""
    _BODIES[model.__name__] = model
    ref = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def install(app: FastAPI) -> None:
    """Make app.openapi() add the request-body models to the generated components."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, model in _BODIES.items():
                body = model.model_json_schema(ref_template=REF)
                components.update(body.pop("$defs", {}))
                components[name] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
