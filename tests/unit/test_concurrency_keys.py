"""Concurrency limit keys: the template an operator gives is checked when the limit is set,
and rendered over each execution's workload when it is to start."""

from __future__ import annotations

import pytest

from noetl_api.concurrency import key_template
from noetl_api.engine.limits import render_key
from noetl_common.errors import InvalidInput


def test_keys_render_over_the_workload() -> None:
    assert render_key("", {"customer": "acme"}, 1) == ""
    assert render_key("{{ workload.customer }}", {"customer": "acme"}, 1) == "acme"
    assert render_key("{{ workload.region }}/{{ workload.customer }}", {"customer": "a", "region": "eu"}, 1) == "eu/a"
    # a key that cannot render queues in a queue of its own kind instead of escaping the limit
    assert render_key("{{ workload.customer.name | int }}", {"customer": None}, 1).startswith("!")


@pytest.mark.parametrize(("text", "needle"), [
    ("acme", "is not a template"),
    ("{{ secrets.token }}", "reads secrets"),
    ("{{ workload.customer", "key_template"),
    ("x" * 1001, "at most 1000 characters"),
])
def test_bad_key_templates_are_refused(text: str, needle: str) -> None:
    with pytest.raises(InvalidInput, match=needle):
        key_template(text)


def test_good_key_templates_are_kept() -> None:
    assert key_template("  {{ workload.customer }} ") == "{{ workload.customer }}"
    assert key_template("") == ""
