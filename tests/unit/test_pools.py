"""Worker pools and priorities: the vocabulary (noetl_common.pools), a playbook's placement
(noetl_dsl.placement, checked at submit), the engine's choice (placing.place) and the
worker's fetch order (notices.Queues)."""

from __future__ import annotations

import pytest

from noetl_api.engine.placing import DEFAULT, place
from noetl_common import natsio, pools
from noetl_common.errors import PlaybookInvalid
from noetl_dsl import Placement, parse_playbook, placements
from noetl_worker.notices import EMPTY_TTL_SEC, Queues, queue_of, queues

PLAYBOOK = """
apiVersion: noetl.io/v2
kind: Playbook
metadata: {name: placed}
spec: {priority: low}
workflow:
  - step: start
    tool: {kind: noop}
    next: [{step: train}]
  - step: train
    spec: {pool: gpu, requires: {accelerator: a100}, priority: high}
    tool: {kind: python, code: "result = 1", spec: {requires: {memory: large}}}
    next: [{step: report}]
  - step: report
    tool: {kind: python, code: "result = 2", spec: {pool: gpu, requires: {cuda: true}}}
"""


def test_a_steps_placement_merges_playbook_tasks_and_step() -> None:
    got = placements(parse_playbook(PLAYBOOK))
    assert got["start"] == Placement("default", {}, "low")
    assert got["train"] == Placement("gpu", {"memory": "large", "accelerator": "a100"}, "high")
    assert got["report"] == Placement("gpu", {"cuda": "true"}, "low")


def test_a_playbook_without_placement_has_none() -> None:
    text = "apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: p}\nworkflow:\n  - step: start\n    tool: {kind: noop}\n"
    assert placements(parse_playbook(text)) == {}


@pytest.mark.parametrize(("spec", "path", "words"), [
    ("{pool: 'GPU nodes'}", "workflow[0].spec.pool", "lowercase"),
    ("{priority: urgent}", "workflow[0].spec.priority", "high, normal, low"),
    ("{requires: [gpu]}", "workflow[0].spec.requires", "mapping"),
])
def test_a_bad_placement_is_refused_at_submit_naming_the_field(spec: str, path: str, words: str) -> None:
    text = ("apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: p}\nworkflow:\n"
            f"  - step: start\n    spec: {spec}\n    tool: {{kind: noop}}\n")
    with pytest.raises(PlaybookInvalid) as err:
        parse_playbook(text)
    assert path in str(err.value) and words in str(err.value)


def test_the_tasks_of_one_step_must_agree_on_a_pool() -> None:
    text = ("apiVersion: noetl.io/v2\nkind: Playbook\nmetadata: {name: p}\nworkflow:\n  - step: start\n    tool:\n"
            "      - {kind: noop, spec: {pool: gpu}}\n      - {kind: noop, spec: {pool: cpu}}\n")
    with pytest.raises(PlaybookInvalid, match="run on one worker"):
        parse_playbook(text)


def test_the_submissions_priority_wins() -> None:
    ps = {"train": Placement("gpu", {"a": "b"}, "low")}
    assert place(ps, "train", None) == ("gpu", {"a": "b"}, "low")
    assert place(ps, "train", "high") == ("gpu", {"a": "b"}, "high")
    assert place(ps, "other", None) is DEFAULT
    assert place(ps, "other", "low") == ("default", None, "low")


def test_subjects_and_consumers() -> None:
    assert natsio.commands_subject("gpu", "high", 3) == "noetl.commands.gpu.high.3"
    assert natsio.commands_filter("gpu", "high") == "noetl.commands.gpu.high.*"
    assert pools.consumer_name("gpu", "high") == "noetl-workers-gpu-high"
    assert [str(p) for p in pools.PRIORITIES] == ["high", "normal", "low"]


def test_qualifies() -> None:
    q = pools.qualifies
    assert q(("default",), {}, (), command_pool="default", requires=None, kind="python")
    assert not q(("default",), {}, (), command_pool="gpu", requires=None, kind="python")
    assert q(("gpu", "default"), {"gpu": "true"}, (), command_pool="gpu", requires={"gpu": "true"}, kind="http")
    assert not q(("gpu",), {"gpu": "false"}, (), command_pool="gpu", requires={"gpu": "true"}, kind="http")
    assert not q(("gpu",), {}, ("python",), command_pool="gpu", requires=None, kind="http")
    assert pools.parse_labels("a=b, c") == {"a": "b", "c": "true"}
    assert pools.parse_pools("gpu, default,gpu") == ("gpu", "default")
    assert pools.parse_pools("") == ("default",)
    with pytest.raises(ValueError, match="pool must be"):
        pools.parse_pools("Bad.Pool")


def test_a_worker_drains_higher_priorities_first_and_skips_a_consumer_found_empty_for_a_while() -> None:
    now = [100.0]
    keys = queues(("gpu", "default"))
    assert keys == ["gpu.high", "default.high", "gpu.normal", "default.normal", "gpu.low", "default.low"]
    q = Queues(keys, clock=lambda: now[0])
    assert q.to_drain() == keys  # at start every consumer may have notices
    for k in keys:
        q.found_empty(k)
    assert q.to_drain() == []
    q.found_notice("default.normal")  # a waiting slot got one: there may be more
    assert q.to_drain() == ["default.normal"]
    now[0] += EMPTY_TTL_SEC * 1.01
    assert q.to_drain() == keys
    q.found_notice("elsewhere.high")  # not one of ours: ignored
    assert q.to_drain() == keys


def test_a_notice_subject_names_its_consumer() -> None:
    assert queue_of("noetl.commands.gpu.high.7") == "gpu.high"
    assert queue_of("noetl.commands.7") == ""
