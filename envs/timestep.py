"""The one home for time: a site's step and every conversion between the hours a user sets and the steps code counts.

A site steps in ``dt_h`` hours (its TOML's top-level ``dt_h``): a whole number of minutes that divides the hour,
:data:`STEP_MINUTES`. The study runs at 15 minutes (``dt_h = 0.25``), the earlier hourly study at ``dt_h = 1``, and
every controller is also scored on a 5-minute simulation of the site (:data:`PHYSICS_DT_H`). Every duration a user sets
is in hours (a planner's horizon, a training episode, a context window, a forecast half-life in days, an agent's
discount per hour) and becomes steps here, so that a setting means the same at every step.

Units: hours (``_h``), minutes, steps (ints).
"""

from __future__ import annotations

import datetime
import math

STEP_MINUTES = (1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30, 60)
"""The steps a site may take, minutes: the whole-minute divisors of the hour (a step that does not divide the hour
would put the hours of the day, the MOER's hours and the forecasts' hourly leads at different places in each hour).
Whether the site's sources can give data at the step is checked when the data are ingested (a 5-minute MOER source
supports multiples of 5 minutes)."""

PHYSICS_DT_H = 5 / 60
"""The step of the site simulation every controller is also scored on, hours (5 minutes: the MOER's own resolution
and ACN-Sim's and SustainGym's step)."""

HOURS_PER_DAY = 24
DAYS_PER_WEEK = 7


class StepError(ValueError):
    """A step that no site can take (not a whole-minute divisor of the hour), or a duration that is not a whole number
    of steps where one must be."""


def step_minutes(dt_h: float) -> int:
    """The step in whole minutes, from ``dt_h`` hours written to any precision (``0.0833333`` is 5 minutes).

    Raises:
        StepError: ``dt_h`` is not within 0.01 minutes of one of :data:`STEP_MINUTES`; the message lists them.
    """
    minutes = float(dt_h) * 60.0
    m = round(minutes) if math.isfinite(minutes) else -1
    if m not in STEP_MINUTES or abs(minutes - m) > 0.01:
        shown = ", ".join(f"{x / 60:.6g} ({x} min)" for x in (60, 30, 15, 5))
        raise StepError(
            f"{dt_h!r} hours is not a step a site can take: the step must divide the hour into whole minutes "
            f"({', '.join(map(str, STEP_MINUTES))} minutes), for example {shown}"
        )
    return m


def step_timedelta(dt_h: float) -> datetime.timedelta:
    """The step as a :class:`datetime.timedelta` of whole minutes (pandas takes it as a ``Timedelta``), exact where
    ``pd.Timedelta(hours=dt_h)`` rounds a fraction such as ``5 / 60`` to nanoseconds.

    Raises:
        StepError: as :func:`step_minutes`.
    """
    return datetime.timedelta(minutes=step_minutes(dt_h))


def exact_dt_h(dt_h: float) -> float:
    """``dt_h`` as the exact quotient ``minutes / 60`` (:func:`step_minutes`): ``0.0833333`` becomes ``5 / 60``.

    Raises:
        StepError: as :func:`step_minutes`.
    """
    return step_minutes(dt_h) / 60.0


def steps(hours: float, dt_h: float, *, at_least: int = 1) -> int:
    """Steps of ``dt_h`` hours in ``hours`` hours, rounded to the nearest (half to even), at least ``at_least``."""
    return max(int(at_least), int(round(float(hours) / float(dt_h))))


def steps_per_hour(dt_h: float) -> int:
    """Steps in one hour (1 at hourly steps, 4 at 15 minutes, 12 at 5 minutes)."""
    return steps(1.0, dt_h)


def steps_per_day(dt_h: float) -> int:
    """Steps in a day of 24 hours (24 at hourly steps, 96 at 15 minutes)."""
    return steps(HOURS_PER_DAY, dt_h)


def steps_per_week(dt_h: float) -> int:
    """Steps in a week of 168 hours."""
    return steps(HOURS_PER_DAY * DAYS_PER_WEEK, dt_h)


def hours(n_steps, dt_h: float):
    """Hours of ``n_steps`` steps (an int, a float or an array of them)."""
    return n_steps * dt_h


def per_step(rate_per_hour: float, dt_h: float) -> float:
    """A factor given per hour of site time as the factor per step, ``rate ** dt_h`` (a discount of 0.99 an hour is
    0.99 ** 0.25 = 0.9975 a 15-minute step), so that it compounds to the same over an hour at every step."""
    return float(rate_per_hour) ** float(dt_h)


def substeps(dt_h: float, fine_dt_h: float) -> int:
    """How many steps of ``fine_dt_h`` make one of ``dt_h`` (3 five-minute steps in 15 minutes).

    Raises:
        StepError: ``fine_dt_h`` is longer than ``dt_h`` or does not divide it.
    """
    coarse, fine = step_minutes(dt_h), step_minutes(fine_dt_h)
    if fine > coarse or coarse % fine:
        raise StepError(f"a step of {fine} minutes does not divide a step of {coarse} minutes")
    return coarse // fine
