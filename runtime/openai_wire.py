"""OpenAI's shapes on the wire: the streamed reply (server-sent events of `chat.completion.chunk` /
`text_completion` objects, then `data: [DONE]`) and the OpenAPI schemas of the request bodies,
replies and errors that the server's routes document (built from runtime/openai_api.py's table of
every request field)."""

from __future__ import annotations

import asyncio
import json
import time

from loopspec.runtime.openai_api import CHAT, COMPLETIONS, APIError, endpoint_fields


async def sse_stream(queue: asyncio.Queue, rid: str, kind: str, chat: bool, include_usage: bool, model: str):
    """SSE chunks from the scheduler's Events, then `data: [DONE]`."""
    created = int(time.time())
    kind = kind + ".chunk" if chat else kind

    def chunk(choice: dict | None, usage: dict | None = None) -> str:
        out = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice] if choice else []}
        if include_usage:
            out["usage"] = usage
        return f"data: {json.dumps(out)}\n\n"

    def piece(text: str | None = None, finish: str | None = None, role: bool = False) -> dict:
        if chat:
            delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    if chat:
        yield chunk(piece(role=True))
    while True:
        event = await queue.get()
        if event.kind == "text":
            yield chunk(piece(event.text))
        elif event.kind == "error":
            yield f"data: {json.dumps(APIError(event.status, event.message).body())}\n\n"
            break
        else:
            yield chunk(piece(finish=event.finish_reason))
            if include_usage:
                yield chunk(None, event.usage)
            break
    yield "data: [DONE]\n\n"


ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _body_schema(endpoint: str, required: str) -> dict:
    """The OpenAPI schema of a body sent to `endpoint`: each of its FIELDS, nothing else."""
    return {
        "type": "object",
        "required": [required],
        "additionalProperties": False,
        "properties": {name: field.schema for name, field in endpoint_fields(endpoint).items()},
    }


COMPLETION_BODY = _body_schema(COMPLETIONS, "prompt")
CHAT_BODY = _body_schema(CHAT, "messages")
REPLY_SCHEMA = {
    "type": "object",
    "required": ["id", "object", "choices"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string"},
        "choices": {"type": "array"},
        "usage": {"type": ["object", "null"]},
    },
}


def error_responses(*statuses: int) -> dict:
    """OpenAPI `responses` for these error statuses, each in OpenAI's error shape."""
    return {
        s: {"description": APIError.TYPES[s], "content": {"application/json": {"schema": ERROR_SCHEMA}}}
        for s in statuses
    }


def post_route_doc(body: dict) -> dict:
    """The OpenAPI description of a POST route taking `body` (FastAPI's add_api_route keywords)."""
    return dict(
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}},
        responses={
            200: {
                "description": "the completion (JSON), or server-sent events with stream: true",
                "content": {"application/json": {"schema": REPLY_SCHEMA}, "text/event-stream": {}},
            },
            **error_responses(400, 401, 404, 413, 429, 500, 503, 504),
        },
    )
