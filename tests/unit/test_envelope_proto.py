"""``envelope_from_proto`` is the one protobuf -> envelope converter (worker and engine):
its output is exactly the v3 dict the engine records and ``noetl_flow`` folds."""

from __future__ import annotations

import json

from noetl_client import values
from noetl_proto.v1 import common_pb2
from noetl_store import envelope, envelope_from_proto, envelope_to_proto

V3_KEYS = {"status", "reference", "parent_ref", "context"}


def test_ok_result_has_the_v3_keys_only() -> None:
    pb = common_pb2.ResultEnvelope(
        status="ok", context_json=json.dumps({"n": 1}),
        reference=common_pb2.ResultReference(ref_id=7, type="db", uri="pg://result_payload/7"),
        parent_ref=common_pb2.ResultReference(ref_id=6, type="db", uri="pg://result_payload/6"))
    assert envelope_from_proto(pb) == {
        "status": "ok", "reference": {"ref_id": 7, "type": "db", "uri": "pg://result_payload/7"},
        "parent_ref": {"ref_id": 6}, "context": {"n": 1}}


def test_defaults_empty_status_and_unset_references() -> None:
    env = envelope_from_proto(common_pb2.ResultEnvelope())
    assert env == {"status": "ok", "reference": None, "parent_ref": None, "context": {}}
    zero = common_pb2.ResultEnvelope(status="ok", reference=common_pb2.ResultReference(ref_id=0),
                                     parent_ref=common_pb2.ResultReference(ref_id=0))
    assert envelope_from_proto(zero)["reference"] is None and envelope_from_proto(zero)["parent_ref"] is None


def test_error_carries_its_fields_and_no_details() -> None:
    pb = common_pb2.ResultEnvelope(status="error", error=common_pb2.ErrorInfo(
        code="TOOL_ERROR", message="boom", kind="schema", retryable=True, details=values.to_struct({"secret_detail": "x"})))
    env = envelope_from_proto(pb)
    assert set(env) == V3_KEYS | {"error"}
    assert env["error"] == {"code": "TOOL_ERROR", "message": "boom", "kind": "schema", "type": "schema",
                            "retryable": True}


def test_error_carries_exception_type_traceback_and_http_status_both_ways() -> None:
    err = {"code": "HTTP_ERROR", "message": "GET x: HTTP 503", "kind": "server_error", "retryable": True,
           "exception_type": "HTTPStatusError", "traceback": "T" * 5000, "status_code": 503, "details": {"a": 1}}
    env = envelope_from_proto(envelope_to_proto(envelope("error", None, None, None, err)))
    assert env["error"]["kind"] == env["error"]["type"] == "server_error"
    assert (env["error"]["exception_type"], env["error"]["status_code"]) == ("HTTPStatusError", 503)
    assert len(env["error"]["traceback"]) == 4000 and env["error"]["traceback"].endswith("T")
    assert "details" not in env["error"]
