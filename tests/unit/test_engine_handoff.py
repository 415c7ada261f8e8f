"""Which commands the engine hands to the worker that offered to take them, and what it
sends (``ShardEngine._offer`` / ``_hand``; docs/ARCHITECTURE.md "Handoff"). The flow
through the processes is tests/e2e/test_handoff.py."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from noetl_api.catalog import parse
from noetl_api.claims import Claims
from noetl_api.engine.handoff import MAX_HANDOFF_BYTES, Offer, OfferBook
from noetl_api.engine.placing import Placed
from noetl_api.engine.shard import ShardEngine, _Input
from noetl_common import auth
from noetl_common.config import CommandSettings
from noetl_flow import NewCommand
from noetl_proto.v1 import messages_pb2

KEY = b"k" * 32
EID = 4242
PLAYBOOK = parse("""apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: handoff, path: tests/handoff}
workflow:
  - step: a
    tool: {kind: python, code: "result = 1"}
    next: {arcs: [{step: b}]}
  - step: b
    tool: {kind: python, input: {v: "{{ a }}"}, code: "result = v + 1"}
""")


class FakeCatalog:
    async def compiled(self, catalog_id: int) -> Any:
        return SimpleNamespace(playbook=PLAYBOOK)


def engine(*, handoff: bool = True, workload: dict[str, Any] | None = None, ref: int | None = None) -> ShardEngine:
    e = ShardEngine.__new__(ShardEngine)
    e.shard = 3
    e.d = SimpleNamespace(  # type: ignore[assignment]
        claims=Claims(None, FakeCatalog(), 30.0, KEY),  # type: ignore[arg-type]
        nc=SimpleNamespace(max_payload=1024 * 1024),
        commands=CommandSettings(handoff=handoff),
        workloads={} if workload is None else {EID: workload}, workload_refs={EID: ref}, offers=OfferBook())
    return e


def result(offer: messages_pb2.HandoffOffer | None, worker: str = "worker-1") -> _Input:
    r = messages_pb2.CallResult(command_id=f"{EID}:a:1", execution_id=EID, step="a", attempt=1, worker_id=worker)
    if offer is not None:
        r.handoff.CopyFrom(offer)
    return _Input("call_result", EID, r)


def offer(pools: tuple[str, ...] = ("default",), labels: dict[str, str] | None = None,
          tools: tuple[str, ...] = ()) -> messages_pb2.HandoffOffer:
    return messages_pb2.HandoffOffer(pools=list(pools), labels=labels or {}, tools=list(tools))


def command(context: dict[str, Any] | None = None) -> NewCommand:
    return NewCommand(f"{EID}:b:1", "b", "python", 1, context if context is not None else {"a": {"v": 1}}, 5.0)


async def test_a_command_is_handed_to_the_offering_worker_as_its_claim_would_give_it() -> None:
    e = engine(workload={"seed": 7})
    got = e._offer(result(offer()))
    assert got is not None and got.worker == "worker-1"
    handed, left = await e._hand(got, EID, 11, command(), Placed("default", None, "normal"))
    assert handed is not None and left is None
    worker, data = handed
    cmd = messages_pb2.Command.FromString(data)
    assert worker == "worker-1"
    assert (cmd.command_id, cmd.step, cmd.attempt, cmd.kind, cmd.shard_id, cmd.timeout_seconds) == (
        f"{EID}:b:1", "b", 1, "python", 3, 5.0)
    # the engine accepts its result only with this token: of this attempt, for this worker
    assert auth.claim_token_valid(KEY, cmd.claim_token, cmd.command_id, 1, "worker-1")
    assert not auth.claim_token_valid(KEY, cmd.claim_token, cmd.command_id, 1, "worker-2")
    spec, context = json.loads(cmd.spec_json), json.loads(cmd.context_json)
    assert spec["step"] == "b" and spec["tool"]["code"] == "result = v + 1"
    assert context["workload"] == {"seed": 7} and context["a"] == {"v": 1} and context["execution_id"] == EID


async def test_a_large_workload_travels_by_reference_as_in_a_claim() -> None:
    e = engine(workload={"big": "x"}, ref=99)
    got = e._offer(result(offer()))
    assert got is not None
    handed, _ = await e._hand(got, EID, 11, command(), Placed("default", None, "normal"))
    assert handed is not None
    context = json.loads(messages_pb2.Command.FromString(handed[1]).context_json)
    assert context["workload_ref"] == {"ref_id": 99} and "workload" not in context


def test_no_offer_no_setting_or_another_input_hands_nothing() -> None:
    assert engine()._offer(result(None)) is None
    assert engine(handoff=False)._offer(result(offer())) is None
    assert engine()._offer(result(offer(), worker="")) is None
    assert engine()._offer(_Input("cancel", EID, messages_pb2.CancelRequested(execution_id=EID))) is None


@pytest.mark.parametrize(("why", "the_offer", "placed", "context"), [
    ("another pool", offer(("default",)), Placed("gpu", None, "normal"), None),
    ("a label the worker lacks", offer(labels={"zone": "a"}), Placed("default", {"zone": "b"}, "normal"), None),
    ("a tool the worker does not run", offer(tools=("http",)), Placed("default", None, "normal"), None),
    ("a loop iteration", offer(), Placed("default", None, "normal"),
     {"loop": {"instance": "i", "index": 0, "iterator": "x"}}),
])
async def test_a_command_the_worker_may_not_take_is_queued(why: str, the_offer: messages_pb2.HandoffOffer,
                                                          placed: Placed, context: dict[str, Any] | None) -> None:
    e = engine(workload={})
    got = e._offer(result(the_offer))
    assert got is not None
    handed, left = await e._hand(got, EID, 11, command(context), placed)
    assert handed is None and left is got, why
    assert len(e.d.offers) == 0


async def test_an_execution_whose_workload_is_not_at_hand_is_queued() -> None:
    e = engine(workload=None)
    got = e._offer(result(offer()))
    assert got is not None
    assert (await e._hand(got, EID, 11, command(), Placed("default", None, "normal")))[0] is None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def kept(worker: str, pools: tuple[str, ...] = ("default",)) -> Offer:
    return Offer(worker, pools, {}, ())


def test_a_kept_offer_is_given_once_newest_first_and_only_while_fresh() -> None:
    clock = Clock()
    book = OfferBook(0.25, clock=clock)
    book.keep(kept("w1"))
    clock.now += 0.1
    book.keep(kept("w2"))
    book.keep(kept("gpu-1", ("gpu",)))
    assert book.take("default", None, "python") == kept("w2")  # the newest that qualifies
    assert book.take("gpu", None, "python") == kept("gpu-1", ("gpu",))
    assert book.take("gpu", None, "python") is None  # given once
    clock.now += 0.2  # w1's offer is 0.3 s old now
    assert book.take("default", None, "python") is None
    assert len(book) == 0


async def test_a_command_without_an_offer_of_its_own_takes_a_kept_one() -> None:
    e = engine(workload={"seed": 1})
    e.d.offers = OfferBook()
    e.d.offers.keep(kept("worker-9"))
    taken: list[Offer] = []
    handed, left = await e._hand(None, EID, 11, command(), Placed("default", None, "normal"), taken)
    assert handed is not None and handed[0] == "worker-9" and left is None
    assert [o.worker for o in taken] == ["worker-9"], "recorded: given back if the batch is folded again"
    token = messages_pb2.Command.FromString(handed[1]).claim_token
    assert auth.claim_token_valid(KEY, token, f"{EID}:b:1", 1, "worker-9")
    # none left: the next command is queued
    handed, _ = await e._hand(None, EID, 11, command(), Placed("default", None, "normal"), taken)
    assert handed is None and len(taken) == 1


async def test_an_own_offer_that_does_not_fit_is_left_for_the_next_command() -> None:
    e = engine(workload={})
    e.d.offers = OfferBook()
    own = kept("worker-1", ("gpu",))
    handed, left = await e._hand(own, EID, 11, command(), Placed("default", None, "normal"))
    assert handed is None and left is own
    handed, left = await e._hand(own, EID, 11, command(), Placed("gpu", None, "normal"))
    assert handed is not None and handed[0] == "worker-1" and left is None


async def test_a_command_too_large_for_a_handoff_is_queued_and_the_offer_kept() -> None:
    """A handoff is one core-NATS message: a command past MAX_HANDOFF_BYTES (or the
    server's max_payload) is claimed over gRPC instead, and a kept offer stays kept."""
    e = engine(workload={"seed": 1})
    big = command({"a": {"v": "x" * (MAX_HANDOFF_BYTES + 1)}})
    own = e._offer(result(offer()))
    assert await e._hand(own, EID, 11, big, Placed("default", None, "normal")) == (None, own)
    e.d.offers.keep(kept("worker-9"))
    assert await e._hand(None, EID, 11, big, Placed("default", None, "normal")) == (None, None)
    assert len(e.d.offers) == 1
    e.d.nc.max_payload = 1000  # a server with a smaller limit
    assert (await e._hand(own, EID, 11, command({"a": {"v": "x" * 1000}}),
                          Placed("default", None, "normal")))[0] is None
