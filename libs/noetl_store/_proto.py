"""Envelope dict <-> protobuf ``ResultEnvelope``: the one converter. The worker sends
the proto in ``CallResult``; the engine turns it back into the dict it records in
``noetl.event.result`` (and folds with ``noetl_flow``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from noetl_client import values
from noetl_proto.v1 import common_pb2

from ._envelope import error_info, is_secret_key


def envelope_to_proto(env: Mapping[str, Any], *, error_details: Mapping[str, Any] | None = None
                      ) -> common_pb2.ResultEnvelope:
    """The protobuf form of an envelope dict; ``error_details`` (traceback, SQLSTATE, ...)
    travels in ``ErrorInfo.details`` (a Struct: errors are rare, and dead letters show it to
    clients); the context stays JSON text (``context_json``: every result carries one)."""
    pb = common_pb2.ResultEnvelope(status=str(env.get("status") or ""),
                                   context_json=json.dumps(env.get("context") or {}, separators=(",", ":")))
    ref = env.get("reference")
    if ref:
        pb.reference.CopyFrom(common_pb2.ResultReference(ref_id=int(ref["ref_id"]), type=str(ref.get("type") or ""),
                                                         uri=str(ref.get("uri") or "")))
    parent = env.get("parent_ref")
    if parent:
        pb.parent_ref.CopyFrom(common_pb2.ResultReference(ref_id=int(parent["ref_id"]),
                                                          type=str(parent.get("type") or ""),
                                                          uri=str(parent.get("uri") or "")))
    err = env.get("error")
    if err:
        pb.error.CopyFrom(common_pb2.ErrorInfo(
            code=str(err.get("code") or ""), message=str(err.get("message") or ""),
            kind=str(err.get("kind") or ""), retryable=bool(err.get("retryable")),
            details=values.to_struct(dict(error_details), default=str, too_deep="json") if error_details else None,
            exception_type=str(err.get("exception_type") or ""), traceback=str(err.get("traceback") or ""),
            status_code=int(err.get("status_code") or 0)))
    return pb


def envelope_from_proto(pb: common_pb2.ResultEnvelope) -> dict[str, Any]:
    """The envelope dict (v3 keys only) of a protobuf ``ResultEnvelope``: exactly what the
    engine records in ``noetl.event.result`` and ``noetl_flow`` reads.

    ``{status, reference: {ref_id, type, uri} | None, parent_ref: {ref_id} | None,
    context[, error: {code, message, kind, type, retryable[, exception_type, traceback,
    status_code]}]}``. An empty status reads as
    ``"ok"``; a reference without a ``ref_id`` (0) reads as absent; ``error`` is present
    only when the message carries one (its ``details`` stay out of events).
    Context keys that look like credentials are dropped here too: a worker in another
    language may not filter them.
    """
    context = json.loads(pb.context_json) if pb.context_json else {}
    if isinstance(context, dict):
        context = {k: v for k, v in context.items() if not is_secret_key(str(k))}
    env: dict[str, Any] = {
        "status": pb.status or "ok",
        "reference": ({"ref_id": pb.reference.ref_id, "type": pb.reference.type, "uri": pb.reference.uri}
                      if pb.HasField("reference") and pb.reference.ref_id else None),
        "parent_ref": ({"ref_id": pb.parent_ref.ref_id}
                       if pb.HasField("parent_ref") and pb.parent_ref.ref_id else None),
        "context": context,
    }
    if pb.HasField("error"):
        env["error"] = error_info(pb.error.code, pb.error.message, kind=pb.error.kind,
                                  retryable=pb.error.retryable, exception_type=pb.error.exception_type,
                                  traceback=pb.error.traceback, status_code=pb.error.status_code)
    return env
