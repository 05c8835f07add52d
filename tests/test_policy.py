"""forge_load.control.policy: filling / yielding / boosted, with reasons, in passed-in time."""

from __future__ import annotations

import pytest

from forge_load.control.policy import Policy, State, Transition


def make(target: float = 0.5, boost: float = 0.6, resume_after_s: float = 10.0,
         boost_after_s: float = 100.0, now_s: float = 0.0) -> Policy:
    return Policy(target, boost, resume_after_s, boost_after_s, now_s)


def quiet_until(p: Policy, start_s: float, end_s: float, step_s: float = 0.5) -> list[tuple[float, Transition]]:
    """Clear verdicts from start_s to end_s inclusive; returns the transitions with their times."""
    out = []
    n = round((end_s - start_s) / step_s)
    for i in range(n + 1):
        t = start_s + i * step_s
        tr = p.update(t, None)
        if tr is not None:
            out.append((t, tr))
    return out


def test_starts_filling_at_target() -> None:
    p = make()
    assert p.state is State.FILLING
    assert p.current_target == 0.5
    assert p.update(0.1, None) is None


@pytest.mark.parametrize("reason", ["process 1234 on the GPU", "900 MiB of device memory", "utilization 0.7"])
def test_yields_at_once_with_the_reason(reason: str) -> None:
    p = make()
    p.update(1.0, None)
    tr = p.update(1.1, reason)
    assert tr == Transition("yield", State.YIELDING, reason)
    assert p.state is State.YIELDING
    assert p.current_target == 0.0


def test_stays_yielding_while_signals_fire() -> None:
    p = make(resume_after_s=2.0)
    assert p.update(1.0, "process 1") is not None
    for k in range(1, 100):  # 50 s of a running job: no new transition, no resume
        assert p.update(1.0 + 0.5 * k, "process 1") is None
        assert p.state is State.YIELDING


def test_resumes_only_after_resume_after_s_of_quiet() -> None:
    p = make(resume_after_s=10.0)
    p.update(5.0, "memory")
    p.update(20.0, "memory")  # the job ends just after 20 s
    transitions = quiet_until(p, 20.5, 40.0)
    assert [(t, tr.event, tr.state) for t, tr in transitions] == [(30.0, "resume", State.FILLING)]
    assert "10.0 s" in transitions[0][1].reason
    assert p.current_target == 0.5


def test_new_signal_restarts_the_resume_wait() -> None:
    p = make(resume_after_s=10.0)
    p.update(0.0, "memory")
    assert quiet_until(p, 0.5, 9.5) == []
    assert p.update(9.7, "utilization") is None  # a flicker just before the resume was due
    assert quiet_until(p, 10.0, 19.5) == []
    assert p.state is State.YIELDING
    tr = p.update(19.7, None)
    assert tr is not None and tr.event == "resume"


def test_boost_after_boost_after_s_of_quiet() -> None:
    p = make(boost_after_s=100.0, now_s=0.0)
    transitions = quiet_until(p, 0.5, 150.0)
    assert [(t, tr.event, tr.state) for t, tr in transitions] == [(100.0, "boost", State.BOOSTED)]
    assert "100 s" in transitions[0][1].reason
    assert p.current_target == 0.6


def test_boost_counts_from_the_last_foreign_activity() -> None:
    p = make(resume_after_s=10.0, boost_after_s=100.0)
    p.update(50.0, "process 7")
    transitions = quiet_until(p, 50.5, 200.0)
    assert [(t, tr.event) for t, tr in transitions] == [(60.0, "resume"), (150.0, "boost")]


@pytest.mark.parametrize(("boost", "boost_after_s"), [(0.6, 0.0), (0.5, 100.0), (0.4, 100.0)])
def test_no_boost_when_disabled_or_not_higher(boost: float, boost_after_s: float) -> None:
    p = make(target=0.5, boost=boost, boost_after_s=boost_after_s)
    assert quiet_until(p, 0.0, 1000.0, step_s=5.0) == []
    assert p.state is State.FILLING
    assert p.current_target == 0.5


def test_boosted_yield_resume_returns_to_filling_not_boosted() -> None:
    p = make(resume_after_s=10.0, boost_after_s=100.0)
    quiet_until(p, 0.0, 100.0)
    assert p.state is State.BOOSTED
    tr = p.update(120.0, "process 99 on the GPU")
    assert tr == Transition("yield", State.YIELDING, "process 99 on the GPU")
    assert p.current_target == 0.0
    tr = p.update(130.0, None)
    assert tr is not None and tr.event == "resume" and tr.state is State.FILLING
    assert p.state is State.FILLING
    assert p.current_target == 0.5
    # And the boost comes back only after another full boost_after_s of quiet.
    transitions = quiet_until(p, 130.5, 230.0)
    assert [(t, tr.event) for t, tr in transitions] == [(220.0, "boost")]


def test_resume_after_zero_resumes_on_the_first_quiet_update() -> None:
    p = make(resume_after_s=0.0)
    p.update(1.0, "memory")
    tr = p.update(1.1, None)
    assert tr is not None and tr.event == "resume"


def test_yield_from_filling_and_boosted_only_once() -> None:
    p = make(boost_after_s=1.0)
    p.update(1.0, None)
    assert p.state is State.BOOSTED
    events = [p.update(1.5 + 0.1 * k, "process 5") for k in range(5)]
    assert [e.event if e else None for e in events] == ["yield", None, None, None, None]


def test_state_values_are_the_log_words() -> None:
    assert [s.value for s in State] == ["filling", "yielding", "boosted", "paused", "held"]


# --- paused: outside the hours, a pause file, SIGUSR1 ---------------------------------------------------------


def test_pause_holds_whatever_the_verdicts_and_unpause_fills_when_quiet() -> None:
    p = make(resume_after_s=10.0)
    assert p.pause(5.0, "SIGUSR1") == Transition("pause", State.PAUSED, "SIGUSR1")
    assert p.current_target == 0.0
    assert quiet_until(p, 5.0, 200.0) == []  # no resume, no boost while paused
    assert p.state is State.PAUSED
    assert p.unpause(200.0, "SIGUSR2") == Transition("unpause", State.FILLING, "SIGUSR2")
    assert p.current_target == 0.5


def test_a_foreign_job_during_a_pause_counts_for_the_resume_wait() -> None:
    p = make(resume_after_s=10.0)
    p.pause(1.0, "outside FORGE_ACTIVE_HOURS")
    assert p.update(2.0, "process 7 on the GPU") is None  # no yield line: nothing of ours runs anyway
    assert p.update(20.0, "process 7 on the GPU") is None
    tr = p.unpause(25.0, "inside FORGE_ACTIVE_HOURS")
    assert tr is not None and tr.state is State.YIELDING
    assert tr.reason == "inside FORGE_ACTIVE_HOURS; foreign activity 5.0 s ago: filling after 10.0 s without any"
    assert quiet_until(p, 25.0, 29.5) == []
    assert quiet_until(p, 30.0, 30.0) == [(30.0, Transition("resume", State.FILLING, "no foreign activity for 10.0 s"))]


def test_a_pause_while_yielding_or_boosted_and_a_new_reason_while_paused() -> None:
    p = make(boost_after_s=50.0)
    quiet_until(p, 0.0, 60.0)
    assert p.state is State.BOOSTED
    assert p.pause(61.0, "SIGUSR1") == Transition("pause", State.PAUSED, "SIGUSR1")
    assert p.pause(62.0, "SIGUSR1; pause file /x") == Transition("pause", State.PAUSED, "SIGUSR1; pause file /x")
    tr = p.unpause(63.0, "SIGUSR2; pause file removed")
    assert tr == Transition("unpause", State.FILLING, "SIGUSR2; pause file removed")
    assert p.update(63.5, None) == Transition("boost", State.BOOSTED, "no foreign activity for 64 s")
    p.update(64.0, "process 1")
    assert p.pause(65.0, "SIGUSR1") is not None and p.state is State.PAUSED


def test_unpause_when_not_paused_changes_nothing() -> None:
    p = make()
    assert p.unpause(1.0, "SIGUSR2") is None
    assert p.state is State.FILLING


# --- held: a hold names the GPU (holds.py) ---------------------------------------------------------------


def test_a_hold_stops_everything_and_its_release_fills_when_quiet() -> None:
    p = make(resume_after_s=10.0)
    assert p.hold(1.0, "Slurm job 42") == Transition("hold", State.HELD, "Slurm job 42")
    assert p.current_target == 0.0
    assert quiet_until(p, 1.0, 300.0) == []  # no resume, no boost while held
    assert p.release(300.0, "released") == Transition("release", State.FILLING, "released")
    assert p.release(301.0, "released") is None


def test_the_job_behind_a_hold_keeps_the_filler_yielding_after_the_release() -> None:
    p = make(resume_after_s=10.0)
    p.hold(1.0, "job")
    assert p.update(5.0, "process 7 on the GPU") is None  # no yield line while held
    tr = p.release(8.0, "released")
    assert tr is not None and tr.state is State.YIELDING and tr.event == "release"
    assert quiet_until(p, 15.0, 15.0) == [(15.0, Transition("resume", State.FILLING, "no foreign activity for 10.0 s"))]


def test_a_hold_outranks_a_pause_and_the_pause_outlives_it() -> None:
    p = make(resume_after_s=10.0)
    p.pause(0.0, "SIGUSR1")
    assert p.hold(1.0, "job") == Transition("hold", State.HELD, "job")
    assert p.pause(2.0, "SIGUSR1; pause file") == Transition("pause", State.HELD, "SIGUSR1; pause file")
    assert p.release(3.0, "released") == Transition("release", State.PAUSED, "released")
    p.hold(4.0, "job 2")
    assert p.unpause(50.0, "SIGUSR2") == Transition("unpause", State.HELD, "SIGUSR2")
    assert p.state is State.HELD
    assert p.release(60.0, "expired") == Transition("release", State.FILLING, "expired")
