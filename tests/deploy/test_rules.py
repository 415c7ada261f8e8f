"""The chart's alerts: `promtool check rules`, and `promtool test rules` showing every alert
firing on synthetic series (tests/deploy/alerts_test.yaml)."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml
from deploytools import HERE, alert_rules, rules_file, run, tool, without_thresholds

REQUIRED_ANNOTATIONS = ("summary", "description", "runbook")


def test_promtool_check_rules(rendered: dict[str, str], tmp_path: Path) -> None:
    for values in ("scale-3", "live"):
        path = tmp_path / f"{values}.rules.yaml"
        path.write_text(rules_file(rendered[values]))
        out = run([tool("promtool"), "check", "rules", str(path)], timeout=60).stdout
        assert f"SUCCESS: {len(alert_rules(rendered[values]))} rules found" in out, out


def test_every_alert_has_severity_and_runbook_text(rendered: dict[str, str]) -> None:
    rules = alert_rules(rendered["scale-3"])
    assert len(rules) == 13
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        for key in REQUIRED_ANNOTATIONS:
            assert len(rule["annotations"].get(key, "")) > 20, (rule["alert"], key)
        assert rule["annotations"]["runbook_url"].endswith("#" + rule["alert"].lower())
        assert 'namespace="noetl"' in rule["expr"], rule["alert"]  # scoped to the release namespace


def test_promtool_unit_tests_fire_every_alert(rendered: dict[str, str], tmp_path: Path) -> None:
    """alerts_test.yaml covers every alert of the rendered rules with a case that fires it."""
    doc = yaml.safe_load(rules_file(rendered["live"]))
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)  # promtool compares annotations verbatim
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    shutil.copy(HERE / "alerts_test.yaml", tmp_path / "alerts_test.yaml")
    tests = yaml.safe_load((HERE / "alerts_test.yaml").read_text())["tests"]
    fired = {case["alertname"] for t in tests for case in t["alert_rule_test"] if case["exp_alerts"]}
    assert fired == {r["alert"] for r in alert_rules(rendered["live"])}
    out = run([tool("promtool"), "test", "rules", "alerts_test.yaml"], cwd=tmp_path, timeout=120)
    assert "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_thresholds_are_stripped_the_way_the_live_check_expects() -> None:
    assert without_thresholds('max by (a) (x{n="1"} and on (a) (y == 1)) > 1000') == [
        'max by (a) (x{n="1"} and on (a) (y))']
    assert without_thresholds("(sum(rate(a[5m])) > 0)\nunless on (s)\n(sum(rate(b[5m])) > 0)") == [
        "(sum(rate(a[5m])))", "(sum(rate(b[5m])))"]
    assert without_thresholds('up{code!="0"} == 0') == ['up{code!="0"}']
    assert without_thresholds("a / (b * 8) > 0.9") == ["a / (b * 8)"]
