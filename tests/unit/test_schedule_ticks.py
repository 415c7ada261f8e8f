"""Schedule ticks (noetl_common.schedules): intervals, cron in a time zone across DST,
and the catch-up policies."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from noetl_common.errors import InvalidInput
from noetl_common.schedules import CatchUp, Spec, decide, first_tick, next_runs, parse_catch_up

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
NY = ZoneInfo("America/New_York")
EVERY_SEC = Spec(interval_ms=1000)


def s(n: float) -> timedelta:
    return timedelta(seconds=n)


def test_interval_next_runs_are_exact_multiples() -> None:
    assert next_runs(Spec(interval_ms=1500), T0, 3) == [T0, T0 + s(1.5), T0 + s(3)]


def test_first_interval_tick_is_one_interval_after_now() -> None:
    assert first_tick(EVERY_SEC, T0 + timedelta(microseconds=1234)) == T0 + timedelta(milliseconds=1001)


def test_on_time_tick_fires_under_every_policy() -> None:
    for policy in CatchUp:
        d = decide(EVERY_SEC, T0, T0 + s(0.2), policy, grace_sec=5)
        assert (d.fire, d.skipped, d.next_tick) == ([T0], 0, T0 + s(1)), policy


def test_nothing_due_fires_nothing() -> None:
    d = decide(EVERY_SEC, T0, T0 - s(0.5), CatchUp.ALL, grace_sec=5)
    assert (d.fire, d.next_tick) == ([], T0)


def test_all_fires_every_missed_tick_in_order() -> None:
    d = decide(EVERY_SEC, T0, T0 + s(4.5), CatchUp.ALL, grace_sec=5)
    assert d.fire == [T0 + s(i) for i in range(5)]
    assert (d.skipped, d.next_tick) == (0, T0 + s(5))


def test_all_is_capped_per_round_and_resumes_where_it_stopped() -> None:
    d = decide(EVERY_SEC, T0, T0 + s(9.5), CatchUp.ALL, grace_sec=5, limit=4)
    assert d.fire == [T0 + s(i) for i in range(4)] and d.next_tick == T0 + s(4)
    d2 = decide(EVERY_SEC, d.next_tick, T0 + s(9.5), CatchUp.ALL, grace_sec=5, limit=4)
    assert d2.fire == [T0 + s(i) for i in range(4, 8)]


def test_once_fires_only_the_latest_missed_tick() -> None:
    d = decide(EVERY_SEC, T0, T0 + s(30.2), CatchUp.ONCE, grace_sec=5)
    assert (d.fire, d.skipped, d.next_tick) == ([T0 + s(30)], 30, T0 + s(31))


def test_skip_fires_the_latest_tick_within_grace_only() -> None:
    late = decide(EVERY_SEC, T0, T0 + s(30.2), CatchUp.SKIP, grace_sec=5)
    assert (late.fire, late.skipped, late.next_tick) == ([T0 + s(30)], 30, T0 + s(31))
    minute = Spec(interval_ms=60_000)
    gone = decide(minute, T0, T0 + s(130), CatchUp.SKIP, grace_sec=5)
    assert (gone.fire, gone.skipped, gone.next_tick) == ([], 3, T0 + s(180))


def test_cron_in_a_time_zone() -> None:
    spec = Spec(cron="0 9 * * 1-5", time_zone="Europe/Berlin")
    runs = next_runs(spec, first_tick(spec, datetime(2026, 1, 2, 9, 0, tzinfo=UTC)), 2)  # a Friday
    assert [r.astimezone(ZoneInfo("Europe/Berlin")).isoformat() for r in runs] == [
        "2026-01-05T09:00:00+01:00", "2026-01-06T09:00:00+01:00"]


def test_cron_spring_forward_runs_a_skipped_time_once_after_the_gap() -> None:
    spec = Spec(cron="30 2 * * *", time_zone="America/New_York")
    runs = next_runs(spec, first_tick(spec, datetime(2026, 3, 7, 12, tzinfo=NY)), 2)
    assert [r.astimezone(NY).isoformat() for r in runs] == ["2026-03-08T03:00:00-04:00",
                                                            "2026-03-09T02:30:00-04:00"]


def test_cron_fall_back_runs_a_repeated_time_once() -> None:
    spec = Spec(cron="30 1 * * *", time_zone="America/New_York")
    runs = next_runs(spec, first_tick(spec, datetime(2026, 10, 31, 12, tzinfo=NY)), 2)
    assert [r.astimezone(NY).isoformat() for r in runs] == ["2026-11-01T01:30:00-04:00",
                                                            "2026-11-02T01:30:00-05:00"]


def test_cron_once_after_a_long_outage_finds_the_latest_tick() -> None:
    spec = Spec(cron="*/5 * * * *")
    d = decide(spec, T0, T0 + timedelta(days=3, minutes=7), CatchUp.ONCE, grace_sec=5)
    assert d.fire == [T0 + timedelta(days=3, minutes=5)]
    assert d.next_tick == T0 + timedelta(days=3, minutes=10)


def test_cron_all_decided_at_the_tick_itself() -> None:
    spec = Spec(cron="* * * * *")
    d = decide(spec, T0, T0, CatchUp.ALL, grace_sec=5)
    assert d.fire == [T0] and d.next_tick == T0 + s(60)


@pytest.mark.parametrize(("spec", "field"), [
    (Spec(cron="61 * * * *"), "cron"),
    (Spec(cron="* * * * *", time_zone="Mars/Olympus"), "time_zone"),
    (Spec(interval_ms=500), "interval"),
    (Spec(), "schedule"),
    (Spec(cron="* * * * *", interval_ms=1000), "schedule"),
])
def test_validation_names_the_field(spec: Spec, field: str) -> None:
    with pytest.raises(InvalidInput, match=f"^{field}: "):
        spec.validate(min_interval_sec=1.0)


def test_interval_below_minimum_names_the_limit() -> None:
    with pytest.raises(InvalidInput, match=r"below the minimum of 1s \(NOETL_SCHEDULE_MIN_INTERVAL_SEC\)"):
        Spec(interval_ms=999).validate(min_interval_sec=1.0)


def test_catch_up_parsing() -> None:
    assert parse_catch_up("") is CatchUp.SKIP and parse_catch_up("all") is CatchUp.ALL
    with pytest.raises(InvalidInput, match=r"^catch_up: unknown policy 'never'"):
        parse_catch_up("never")
