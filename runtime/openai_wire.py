"""OpenAI's shapes on the wire: the streamed reply (server-sent events of `chat.completion.chunk` /
`text_completion` objects, then `data: [DONE]`) and the OpenAPI schemas of the request bodies,
replies and errors that the server's routes document (built from runtime/openai_api.py's table of
every request field)."""

from __future__ import annotations

import asyncio
import json
import time

from loopspec.runtime.openai_api import CHAT, COMPLETIONS, APIError, endpoint_fields
from loopspec.runtime.tool_calls import Call, ToolCallParser, ToolRequest, finish_reason, new_call_id


def tool_call_deltas(call: Call, index: int) -> list[dict]:
    """A call as OpenAI streams it: its id, type and name (arguments ""), then its arguments' text.
    (The call is whole when it is sent: it was parsed and checked against its schema first.)"""
    return [
        {"index": index, "id": new_call_id(), "type": "function", "function": {"name": call.name, "arguments": ""}},
        {"index": index, "function": {"arguments": call.arguments}},
    ]


async def sse_stream(
    queue: asyncio.Queue,
    rid: str,
    kind: str,
    chat: bool,
    include_usage: bool,
    model: str,
    tools: ToolRequest | None = None,
):
    """SSE chunks from the scheduler's Events, then `data: [DONE]`. With `tools` whose calls are
    parsed, the text goes through a ToolCallParser: content deltas, and a `delta.tool_calls` per call
    once it is whole and checked (text that may be a call is held back until then)."""
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

    parser = ToolCallParser(tools) if chat and tools is not None and tools.parses else None
    calls = 0

    def classified(pieces: list) -> list[str]:
        nonlocal calls
        out = []
        for p in pieces:
            if isinstance(p, Call):
                for delta in tool_call_deltas(p, calls):
                    out.append(
                        chunk({"index": 0, "delta": {"tool_calls": [delta]}, "logprobs": None, "finish_reason": None})
                    )
                calls += 1
            elif p:
                out.append(chunk(piece(p)))
        return out

    if chat:
        yield chunk(piece(role=True))
    while True:
        event = await queue.get()
        if event.kind == "text":
            for out in classified(parser.feed(event.text)) if parser else [chunk(piece(event.text))]:
                yield out
        elif event.kind == "error":
            yield f"data: {json.dumps(APIError(event.status, event.message).body())}\n\n"
            break
        else:
            for out in classified(parser.finish()) if parser else []:
                yield out
            yield chunk(piece(finish=finish_reason(event.finish_reason, calls)))
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
