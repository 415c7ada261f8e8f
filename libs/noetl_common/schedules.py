"""Schedule ticks: pure computation, no I/O (the api validates with it and lists next
runs; the reaper's scheduler decides which ticks fire with it).

A schedule is a cron expression in a time zone, or a fixed interval. Its durable state
is one timestamp, ``next_tick`` (the earliest tick not yet decided). A round at ``now``
decides every tick in ``[next_tick, now]`` by the catch-up policy and moves
``next_tick`` past ``now``:

    policy  ticks due in [next_tick, now]           fired
    ------  ------------------------------------    ---------------------------------
    all     t1 < t2 < ... < tn                      all of them, oldest first (at most
                                                    ``limit`` per round; the rest next round)
    once    t1 < ... < tn                           tn only (one run for what was missed)
    skip    t1 < ... < tn                           tn only if now - tn <= grace, else none

Cron follows Debian cron's daylight-saving rules (``cronsim``): a time skipped by a
spring-forward runs at the first instant after the gap, a time repeated by a fall-back
runs once. Interval ticks are exact multiples of the interval (integer milliseconds)
from the schedule's anchor, independent of time zones.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from .errors import InvalidInput

# Ticks fired by one round of an ``all`` schedule; the rest fire in the next rounds.
CATCH_UP_LIMIT = 100
# Search windows for the latest due tick of a cron schedule behind by a long way.
_WINDOWS = (timedelta(minutes=2), timedelta(hours=2), timedelta(days=2), timedelta(days=40),
            timedelta(days=400))
_MAX_ITERATIONS = 200_000


class CatchUp(StrEnum):
    SKIP = "skip"
    ONCE = "once"
    ALL = "all"


def parse_catch_up(text: str) -> CatchUp:
    try:
        return CatchUp(text or CatchUp.SKIP)
    except ValueError:
        raise InvalidInput(f"catch_up: unknown policy {text!r} (one of: {', '.join(c.value for c in CatchUp)})"
                           ) from None


def zone(name: str) -> ZoneInfo:
    """A time zone by IANA name ('' = UTC); InvalidInput naming the field otherwise."""
    try:
        return ZoneInfo(name or "UTC")
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidInput(f"time_zone: unknown time zone {name!r} (an IANA name such as 'Europe/Berlin')"
                           ) from None


@dataclass(frozen=True)
class Spec:
    """When a schedule ticks: ``cron`` in ``time_zone``, or every ``interval_ms``."""

    cron: str = ""
    time_zone: str = "UTC"
    interval_ms: int = 0

    def validate(self, min_interval_sec: float) -> Spec:
        if bool(self.cron) == bool(self.interval_ms):
            raise InvalidInput("schedule: exactly one of cron and interval is required")
        if self.cron:
            zone(self.time_zone)
            try:
                CronSim(self.cron, datetime(2000, 1, 1, tzinfo=UTC))
            except CronSimError as exc:
                raise InvalidInput(f"cron: invalid expression {self.cron!r}: {exc}") from None
        elif self.interval_ms < min_interval_sec * 1000:
            raise InvalidInput(f"interval: {self.interval_ms / 1000:g}s is below the minimum of "
                               f"{min_interval_sec:g}s (NOETL_SCHEDULE_MIN_INTERVAL_SEC)")
        return self

    def ticks_after(self, after: datetime, *, inclusive: bool = False,
                    anchor: datetime | None = None) -> Iterator[datetime]:
        """Ticks later than ``after`` (or equal when ``inclusive``), ascending, tz-aware UTC."""
        if self.interval_ms:
            base = anchor or after
            step = timedelta(milliseconds=self.interval_ms)
            k = _ceil_div(_ms(after - base), self.interval_ms)
            t = base + k * step
            if t == after and not inclusive:
                t += step
            while True:
                yield t
                t += step
        else:
            tz = zone(self.time_zone)
            # arithmetic in UTC: an aware datetime in a zone adds wall-clock time
            start = (after.astimezone(UTC) - timedelta(microseconds=1 if inclusive else 0)).astimezone(tz)
            for t in CronSim(self.cron, start):
                yield t.astimezone(UTC)


def _ms(delta: timedelta) -> int:
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def first_tick(spec: Spec, now: datetime) -> datetime:
    """The first tick of a new (or resumed) schedule: the first cron time after ``now``,
    or one interval after ``now`` (whole milliseconds)."""
    now = now.replace(microsecond=now.microsecond // 1000 * 1000)
    if spec.interval_ms:
        return now + timedelta(milliseconds=spec.interval_ms)
    return next(spec.ticks_after(now))


def next_runs(spec: Spec, next_tick: datetime, count: int) -> list[datetime]:
    """The next ``count`` ticks from ``next_tick`` (inclusive)."""
    out: list[datetime] = []
    for t in spec.ticks_after(next_tick, inclusive=True, anchor=next_tick):
        if len(out) >= count:
            break
        out.append(t)
    return out


@dataclass(frozen=True)
class Decision:
    fire: list[datetime]   # ticks to fire, oldest first
    skipped: int           # due ticks the policy dropped
    next_tick: datetime    # the new next_tick (> now unless a capped ``all`` round left ticks due)


def decide(spec: Spec, next_tick: datetime, now: datetime, policy: CatchUp, *, grace_sec: float,
           limit: int = CATCH_UP_LIMIT) -> Decision:
    """Which ticks in ``[next_tick, now]`` fire under ``policy``, and the next ``next_tick``."""
    if next_tick > now:
        return Decision([], 0, next_tick)
    if policy is CatchUp.ALL:
        fire: list[datetime] = []
        for t in spec.ticks_after(next_tick, inclusive=True, anchor=next_tick):
            if t > now or len(fire) >= limit:
                return Decision(fire, 0, t)
            fire.append(t)
    latest, count = _latest_due(spec, next_tick, now)
    following = next(spec.ticks_after(now, anchor=latest))
    if policy is CatchUp.SKIP and (now - latest).total_seconds() > grace_sec:
        return Decision([], count, following)
    return Decision([latest], count - 1, following)


def _latest_due(spec: Spec, next_tick: datetime, now: datetime) -> tuple[datetime, int]:
    """The latest tick in ``[next_tick, now]`` (``next_tick`` itself is one) and how many
    ticks that range holds (exact for intervals; for cron counted up to a bound)."""
    if spec.interval_ms:
        k = _ms(now - next_tick) // spec.interval_ms
        return next_tick + timedelta(milliseconds=k * spec.interval_ms), k + 1
    for window in (*_WINDOWS, None):
        start = next_tick if window is None else max(next_tick, now - window)
        latest, count = None, 0
        for t in spec.ticks_after(start, inclusive=True):
            if t > now or count >= _MAX_ITERATIONS:
                break
            latest, count = t, count + 1
        if latest is not None:
            return latest, count  # a lower bound when the window started after next_tick
    return next_tick, 1
