"""`GET /openapi.json`: every route, with the request bodies the API validates.

The API endpoints read their bodies themselves (size cap, JSON checks,
then the pydantic models of each API's `schemas.py`), so FastAPI cannot see those bodies; they are added
here from the same models, so the published schema is the one requests are
checked against, each field described with its treatment (`fields.py`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from .anthropic.schemas import CountTokensRequest, MessagesRequest
from .fields import FIELDS
from .openai.schemas import ChatCompletionRequest, CompletionRequest
from .responses.schemas import ResponsesRequest

BODIES = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/completions": CompletionRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/responses": ResponsesRequest,
}
# each body model and its fields' treatments
DOCUMENTED = (
    (ChatCompletionRequest, FIELDS["chat"]),
    (CompletionRequest, FIELDS["completions"]),
    (MessagesRequest, FIELDS["messages"]),
    (CountTokensRequest, FIELDS["messages"]),  # the fields of Messages that shape the prompt
    (ResponsesRequest, FIELDS["responses"]),
)


def openapi_document(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(
        title="mlx-kvq",
        version=app.version,
        description="OpenAI-compatible server on quantized KV caches (mlx-kvq serve)",
        routes=app.routes,
    )
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model, fields in DOCUMENTED:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        for name, prop in schema["properties"].items():
            doc_ = fields[name]
            prop["description"] = f"{doc_.treatment.value}: {doc_.note}"
        schemas[model.__name__] = schema
    for path, model in BODIES.items():
        operation = doc["paths"][path]["post"]
        operation["requestBody"] = {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            },
        }
    return doc
