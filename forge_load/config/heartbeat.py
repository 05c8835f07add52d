"""How often the loop beats its heartbeat, and how old a heartbeat may be before the loop counts as stalled."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forge_load.config.settings import Config

# The loop beats its heartbeat once a second of its clock, on the first step after that (filler.py), and
# steps at least once per poll interval. /health and the health command allow twice the longest gap, and never
# less than this: under a second, /health would flap between polls.
HEARTBEAT_EVERY_S = 1.0
MIN_HEALTH_MAX_AGE_S = 2.0
DEFAULT_HEALTH_MAX_AGE_S = 30.0


def heartbeat_period_s(config: Config) -> float:
    """The longest wall-clock gap between two heartbeats of a healthy loop: a beat each HEARTBEAT_EVERY_S of
    the loop's clock, on the first step after it, with a step at least every poll interval; a simulation
    slower than real time stretches both."""
    period_s = HEARTBEAT_EVERY_S + config.poll_interval_s
    if config.simulate and 0 < config.sim.speed < 1:
        period_s /= config.sim.speed
    return period_s
