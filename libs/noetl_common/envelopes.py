"""Envelope v3 <-> protobuf. The dict form is what ``noetl.event.result`` stores:
``{status, reference: {ref_id, type, uri} | null, parent_ref: {ref_id} | null, context[, error]}``."""

from __future__ import annotations

import json
from typing import Any

from noetl_proto.v1 import common_pb2


def to_dict(pb: common_pb2.ResultEnvelope) -> dict[str, Any]:
    out: dict[str, Any] = {
        "status": pb.status or "ok",
        "reference": ({"ref_id": pb.reference.ref_id, "type": pb.reference.type, "uri": pb.reference.uri}
                      if pb.HasField("reference") and pb.reference.ref_id else None),
        "parent_ref": ({"ref_id": pb.parent_ref.ref_id}
                       if pb.HasField("parent_ref") and pb.parent_ref.ref_id else None),
        "context": json.loads(pb.context_json) if pb.context_json else {},
    }
    if pb.HasField("error") and (pb.error.code or pb.error.message):
        out["error"] = {"code": pb.error.code, "message": pb.error.message, "kind": pb.error.kind,
                        "retryable": pb.error.retryable}
    return out


def from_dict(env: dict[str, Any]) -> common_pb2.ResultEnvelope:
    pb = common_pb2.ResultEnvelope(status=str(env.get("status") or "ok"),
                                   context_json=json.dumps(env.get("context") or {}, default=str))
    ref = env.get("reference")
    if ref:
        pb.reference.CopyFrom(common_pb2.ResultReference(ref_id=int(ref["ref_id"]), type=str(ref.get("type", "")),
                                                         uri=str(ref.get("uri", ""))))
    parent = env.get("parent_ref")
    if parent and parent.get("ref_id"):
        pb.parent_ref.CopyFrom(common_pb2.ResultReference(ref_id=int(parent["ref_id"])))
    err = env.get("error")
    if err:
        details = err.get("details")
        pb.error.CopyFrom(common_pb2.ErrorInfo(
            code=str(err.get("code") or "TOOL_ERROR"), message=str(err.get("message") or ""),
            kind=str(err.get("kind") or ""), retryable=bool(err.get("retryable")),
            details_json=json.dumps(details, default=str) if details else ""))
    return pb
