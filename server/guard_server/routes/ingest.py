"""POST /v1/reports: authenticate, bound, validate, then store a batch (or store nothing)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from guard_server.auth import authorization, authorized
from guard_server.deps import BodySlotsDep, SettingsDep, StoreDep
from guard_server.errors import BodyTooLargeError, BusyError, CapacityError, StepJumpError
from guard_server.framing import ambiguous_framing
from guard_server.limits import read_body
from guard_server.responses import Accepted, Problem, ValidationProblem
from guard_server.shape import ShapeError, read_batch
from guard_server.wire import ReportBatch

__all__ = ["router"]

router = APIRouter(tags=["ingest"])


def _inline_refs(node: Any, defs: dict[str, Any]) -> Any:
    # The request body is parsed by hand (see below), so FastAPI cannot document it; pydantic's
    # schema points into its own "$defs", which do not exist at the OpenAPI document's root.
    if isinstance(node, dict):
        if "$ref" in node:
            return _inline_refs(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {key: _inline_refs(value, defs) for key, value in node.items()}
    if isinstance(node, list):
        return [_inline_refs(item, defs) for item in node]
    return node


def _open(node: Any) -> Any:
    # The route stores a batch without the fields it does not know (a newer guard's), so the
    # document promises no "additionalProperties": false (docs/wire.md, "Versions").
    if isinstance(node, dict):
        return {k: _open(v) for k, v in node.items()
                if not (k == "additionalProperties" and v is False)}
    return [_open(v) for v in node] if isinstance(node, list) else node


def _request_body() -> dict[str, Any]:
    schema = ReportBatch.model_json_schema()
    body = _open(_inline_refs(schema, schema.pop("$defs", {})))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}}


# Seconds a client is asked to wait after a 429: ranks free their place only when they expire
# (minutes), so retrying sooner only adds load.
RETRY_AFTER_S = 30
# ... but a turn to have a body read frees in milliseconds, or at most at the read timeout.
BUSY_RETRY_AFTER_S = 2


# Problems listed in a 422: a batch of 1000 reports with every count a string has ~60,000, and
# listing them all is the costliest answer a client can ask for.
LISTED = 32


def _problems(exc: ValidationError) -> list[dict[str, Any]]:
    """The 422's detail: what is wrong, where (`loc`), at most LISTED of them."""
    if exc.error_count() > LISTED:  # errors() would build every one of them
        return [{"type": "too_many_errors", "loc": ["body"], "msg": f"{exc.error_count()} "
                 f"problems, more than the {LISTED} an answer lists: the body is no batch of "
                 "this wire (docs/wire.md)"}]
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    # Fields it does not know cost a batch nothing: the 422 names what is wrong with it.
    return [{"type": e["type"], "loc": ["body", *e["loc"]], "msg": e["msg"]} for e in errors
            if e["type"] != "extra_forbidden"]


def _is_json(content_type: str | None) -> bool:
    # A browser can POST text/plain, form and multipart bodies cross-site without a CORS
    # preflight; requiring JSON keeps web pages from writing reports.
    media = (content_type or "").partition(";")[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


@router.post(
    "/v1/reports",
    status_code=202,
    response_model=Accepted,
    summary="Push a batch of step reports from one rank of one run",
    responses={
        400: {"model": Problem, "description": "both Content-Length and Transfer-Encoding"},
        401: {"model": Problem, "description": "missing or wrong bearer token"},
        408: {"model": Problem, "description": "the body did not arrive in time"},
        413: {"model": Problem, "description": "body over GUARD_SERVER_MAX_BODY_BYTES"},
        409: {"model": Problem, "description": "a step further ahead than time allows"},
        415: {"model": Problem, "description": "Content-Type is not application/json"},
        422: {"model": ValidationProblem, "description": "invalid batch; `loc` names the field"},
        429: {"model": Problem, "description": "over the server's caps or its byte budget, or "
              "too many bodies in flight"},
    },
    openapi_extra=_request_body(),
)
async def post_reports(
    request: Request, settings: SettingsDep, store: StoreDep, slots: BodySlotsDep
) -> Accepted:
    """Store the batch and answer 202, or reject it whole with 400, 401, 408, 409, 413, 415,
    422 or 429."""
    # The body is read by hand rather than by a pydantic parameter: the size limit must hold
    # on the streamed bytes, and parsing JSON straight into the model is ~2x faster.
    if ambiguous_framing(request.scope["headers"]):
        # Which body did the sender (or a proxy in front) mean? Store neither; the connection
        # closes after this answer (guard_server.framing).
        store.rejections.count("bad_framing")
        raise HTTPException(400, "both Content-Length and Transfer-Encoding: ambiguous framing "
                            "(RFC 9112 section 6.3); nothing was stored. Send one of them.")
    if not authorized(authorization(request.scope["headers"]), settings.token):
        store.rejections.count("unauthorized")
        raise HTTPException(
            401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
        )
    if not _is_json(request.headers.get("content-type")):
        store.rejections.count("not_json")
        raise HTTPException(415, "reports must be sent with Content-Type: application/json")
    try:
        async with asyncio.timeout(settings.read_timeout_s):
            body = await read_body(request, settings.max_body_bytes, slots)
    except BodyTooLargeError as exc:
        store.rejections.count("too_large")
        raise HTTPException(413, str(exc)) from None
    except BusyError as exc:
        store.rejections.count("busy")
        headers = {"Retry-After": str(BUSY_RETRY_AFTER_S)}
        raise HTTPException(429, str(exc), headers=headers) from None
    except TimeoutError:
        store.rejections.count("timeout")
        raise HTTPException(
            408, f"the body did not arrive within {settings.read_timeout_s} s "
            "(GUARD_SERVER_READ_TIMEOUT_S); nothing was stored"
        ) from None
    except ClientDisconnect:
        # The client left mid-body: nobody to answer, nothing to store; counted, not logged.
        store.rejections.count("disconnected")
        return Accepted(accepted=0)
    try:
        batch, unknown = read_batch(body, settings.max_unknown_fields, settings.max_unknown_bytes)
    except ShapeError as exc:
        store.rejections.count("invalid")
        raise HTTPException(422, [{"type": exc.kind, "loc": ["body", *exc.loc],
                                   "msg": str(exc)}]) from None
    except ValidationError as exc:
        store.rejections.count("invalid")
        raise HTTPException(422, _problems(exc)) from None
    try:
        store.ingest(batch)
    except StepJumpError as exc:
        # 409: valid on its own, the report conflicts with the rank's state (a forged step).
        raise HTTPException(409, f"reports[{exc.index}].step: {exc}") from None
    except CapacityError as exc:
        raise HTTPException(429, str(exc), headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    if unknown:  # counted once the batch is stored: a refused one was not read
        store.unknown.count(unknown)
    return Accepted(accepted=len(batch.reports))
