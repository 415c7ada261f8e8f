"""noetl_client.values: JSON values <-> Struct/Value, numbers and depth as docs/CLIENTS.md
says, and the client package's public names (pinned)."""

from __future__ import annotations

import datetime
import json
import math
from typing import Any

import pytest
from google.protobuf import struct_pb2

import noetl_client
from noetl_client import values
from noetl_proto.v1 import execution_pb2


def round_trip(obj: Any) -> Any:
    wire = values.to_value(obj).SerializeToString()
    return values.from_value(struct_pb2.Value.FromString(wire))


@pytest.mark.parametrize("obj", [
    None, True, False, 0, 1, -7, 2**53, -(2**53), 1.5, -0.25, "", "héllo", [], {}, [1, [2, [3]]],
    {"a": {"b": [1, "x", None, True, {"c": 2.5}]}, "empty": {}, "list": []},
])
def test_json_values_round_trip_with_their_types(obj: Any) -> None:
    back = round_trip(obj)
    assert back == obj and json.dumps(back, sort_keys=True) == json.dumps(obj, sort_keys=True)  # types too


def test_integers_beyond_2_53_travel_as_their_digits_never_rounded() -> None:
    big = 2**53 + 1
    assert float(big) == float(2**53)  # what a double would have made of it
    assert round_trip({"id": big, "neg": -big}) == {"id": str(big), "neg": str(-big)}


def test_integral_doubles_read_back_as_ints_and_other_numbers_as_floats() -> None:
    assert round_trip(2.0) == 2 and isinstance(round_trip(2.0), int)
    assert isinstance(round_trip(3), int) and isinstance(round_trip(2.5), float)
    assert isinstance(round_trip(1e300), float)  # integral, but beyond 2**53
    assert round_trip(float("nan")) is None and round_trip(math.inf) is None


def test_tuples_keys_and_other_objects_as_json_dumps_does() -> None:
    assert round_trip((1, 2)) == [1, 2]
    assert round_trip({1: "a", None: "b", False: "c"}) == {"1": "a", "null": "b", "false": "c"}
    when = datetime.date(2026, 11, 24)
    assert values.from_value(values.to_value({"d": when}, default=str)) == {"d": "2026-11-24"}
    with pytest.raises(TypeError):
        values.to_value({"d": when})


def nested(depth: int) -> Any:
    obj: Any = 1
    for _ in range(depth):
        obj = {"a": obj}
    return obj


def test_the_deepest_value_a_struct_carries_decodes_in_every_message_that_holds_one() -> None:
    deepest = nested(values.MAX_DEPTH)
    request = execution_pb2.SubmitExecutionRequest(payload=values.to_struct(deepest))
    assert values.from_struct(execution_pb2.SubmitExecutionRequest.FromString(
        request.SerializeToString()).payload) == deepest
    response = execution_pb2.GetExecutionResponse()
    response.execution.steps.add(name="s").result.CopyFrom(values.to_value(deepest))
    back = execution_pb2.GetExecutionResponse.FromString(response.SerializeToString())
    assert values.from_value(back.execution.steps[0].result) == deepest


def test_a_deeper_value_is_refused_or_sent_with_its_deep_part_as_json_text() -> None:
    deeper = nested(values.MAX_DEPTH + 5)
    with pytest.raises(ValueError, match="nests deeper than 32 levels"):
        values.to_struct(deeper)
    sent = values.to_value(deeper, too_deep="json")
    response = execution_pb2.GetExecutionResponse()
    response.execution.steps.add(name="s").result.CopyFrom(sent)
    back = values.from_value(execution_pb2.GetExecutionResponse.FromString(
        response.SerializeToString()).execution.steps[0].result)
    inner = back
    for _ in range(values.MAX_DEPTH):
        inner = inner["a"]
    assert json.loads(inner) == nested(5)


def test_a_struct_holds_objects_only_and_unset_reads_as_none() -> None:
    with pytest.raises(TypeError):
        values.to_struct([1])  # type: ignore[arg-type]
    assert values.to_struct(None) == struct_pb2.Struct()
    assert values.from_value(struct_pb2.Value()) is None


def test_the_client_packages_public_names() -> None:
    assert sorted(noetl_client.__all__) == sorted([
        "MAX_DEPTH", "MAX_EXACT_INT", "TERMINAL", "ApiError", "Client", "ClientConfig", "ClientError",
        "ConfigError", "Conflict", "InvalidArgument", "NotFound", "PermissionDenied", "Unauthenticated",
        "Unavailable", "WaitTimeout", "channel", "errors", "executions", "from_struct", "from_value", "is_terminal",
        "results", "retries", "status_name", "step_result", "submit_request", "to_struct", "to_value", "values"])
    assert all(hasattr(noetl_client, name) for name in noetl_client.__all__)


def test_client_config_reads_the_clis_environment() -> None:
    config = noetl_client.ClientConfig.from_env({"NOETL_API": "h:1", "NOETL_TOKEN": " t \n",
                                                 "NOETL_TLS_CA_FILE": "/ca.crt"})
    assert (config.target, config.token, config.ca_file) == ("h:1", "t", "/ca.crt")
    with pytest.raises(noetl_client.ConfigError, match="NOETL_API"):
        noetl_client.ClientConfig.from_env({})


def reference_value(obj: Any) -> struct_pb2.Value:
    """The Value protobuf's own Python API builds (the encoder writes bytes directly)."""
    v = struct_pb2.Value()
    if isinstance(obj, dict):
        v.struct_value.SetInParent()
        for k, item in obj.items():
            v.struct_value.fields[k].CopyFrom(reference_value(item))
    elif isinstance(obj, list):
        v.list_value.SetInParent()
        for item in obj:
            v.list_value.values.add().CopyFrom(reference_value(item))
    elif obj is None:
        v.null_value = struct_pb2.NULL_VALUE
    elif isinstance(obj, bool):
        v.bool_value = obj
    elif isinstance(obj, int | float):
        v.number_value = obj
    else:
        v.string_value = obj
    return v


def test_the_encoder_writes_what_protobufs_own_api_builds() -> None:
    import random

    rnd = random.Random(7)

    def gen(depth: int) -> Any:
        makers = [lambda: None, lambda: True, lambda: False, lambda: rnd.randint(-(2**53), 2**53),
                  lambda: rnd.uniform(-1e9, 1e9),
                  lambda: "".join(rnd.choice("aé€\U0001f600\n\"") for _ in range(rnd.randrange(5))),
                  lambda: [], lambda: {f"k{i}é": gen(depth + 1) for i in range(rnd.randrange(4))},
                  lambda: [gen(depth + 1) for _ in range(rnd.randrange(4))]]
        return makers[rnd.randrange(len(makers) if depth < 6 else 7)]()

    for _ in range(300):
        obj = gen(0)
        assert values.to_value(obj) == reference_value(obj), obj
        assert values.from_value(values.to_value(obj)) == obj
