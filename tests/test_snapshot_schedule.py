"""The timed snapshots' schedule (:mod:`hpcps.train.snapshot_schedule`) as a pure function of given
write times: the work a kill can lose (from a committed snapshot's data point to its successor's
commit) stays within ``checkpoint.delta_every_s``, where taking a snapshot every interval would lose
the interval plus a write. (The jobs that take and restore them: tests/test_deltas.py.)"""

from __future__ import annotations

import pytest

from hpcps.train.snapshot_schedule import SnapshotSchedule

D = 2.0  # checkpoint.delta_every_s
STEP = 0.01


def simulate(write, step_s: float = STEP, until: float = 60.0, schedule=None) -> list[tuple[float, float]]:
    """(data point, commit) of each delta snapshot a run of ``step_s``-second steps takes up to
    ``until``, the k-th one's write taking ``write(k, seconds since the data point before)``; one
    write at a time, the next waiting for the one before (as the first worker does). Without
    ``schedule``: the schedule; with ``"every interval"``: a snapshot each ``D`` from data point
    to data point (the rule before it)."""
    sched, now, out = SnapshotSchedule(D, 0.0), 0.0, []
    while now < until:
        now += step_s
        if sched.pending and out[-1][1] <= now:
            sched.committed(out[-1][1])
        due = now - sched.point >= D if schedule == "every interval" else sched.due(now, step_s, "delta")
        if due:
            if sched.pending:  # (the one before not committed yet: training waits for it)
                now = out[-1][1]
                sched.committed(now)
            covered = now - sched.point
            sched.taken(now, "delta")
            out.append((now, now + write(len(out), covered)))
    return out


def lost(snapshots) -> list[float]:
    """For each snapshot after the first: the most a kill loses just before it commits (from the
    data point of the one before, the newest committed then)."""
    return [b[1] - a[0] for a, b in zip(snapshots, snapshots[1:])]


@pytest.mark.parametrize("w", [0.05, 0.5, 0.95])
def test_steady_writes_lose_at_most_the_interval_where_every_interval_lost_it_plus_the_write(w):
    ours, before = simulate(lambda k, _: w), simulate(lambda k, _: w, schedule="every interval")
    assert max(lost(ours)) <= D + 1e-9 and len(ours) > 20
    assert min(lost(before)) == pytest.approx(D + w, abs=2 * STEP)  # (the rule it replaces)
    assert min(lost(ours)[12:]) >= D - 2 * STEP  # (then no more snapshots than the bound needs)


def test_a_delta_written_slower_per_second_than_the_recent_ones_exceeds_the_bound_only_then():
    rates = [0.3, 0.2, 0.7, 0.4, 0.4, 0.4, 0.4, 0.4, 0.8, 0.1] * 4  # (seconds of write a second covered)
    snaps = simulate(lambda k, covered: rates[k % len(rates)] * covered, until=50)
    for k, got in enumerate(lost(snaps), start=1):
        if k >= 2 and rates[k % len(rates)] <= max(rates[j % len(rates)] for j in range(max(1, k - 4), k)):
            assert got <= D + 1e-9, (k, got)
    assert max(lost(snaps)) > D  # (the jumps to 0.7 and 0.8 did exceed it)


def test_one_slow_delta_shortens_the_next_intervals_but_puts_no_snapshot_back_to_back():
    rates = [0.2] * 5 + [0.9] + [0.2] * 30
    snaps = simulate(lambda k, covered: rates[min(k, len(rates) - 1)] * covered, until=40)
    assert all(b[0] > a[1] for a, b in zip(snaps, snaps[1:]))  # (none waited for the one before)
    assert min(b[0] - a[0] for a, b in zip(snaps[5:], snaps[6:])) >= D / 1.9 - 2 * STEP


def test_deltas_whose_write_grows_with_the_interval_settle_where_interval_plus_write_is_the_bound():
    snaps = simulate(lambda k, covered: 0.6 * covered, until=40)  # (the rows changed: the time covered)
    tail = snaps[-10:]
    assert max(lost(snaps)) <= D + 1e-9
    gaps = [b[0] - a[0] for a, b in zip(tail, tail[1:])]
    assert all(g == pytest.approx(D / 1.6, abs=0.05) for g in gaps), gaps  # interval (1 + 0.6) = D


def test_writes_over_half_the_interval_are_said_once_and_come_back_to_back():
    s = SnapshotSchedule(D, 0.0)
    assert s.next_interval("delta") == D / 2 and s.over_half() == ""  # (nothing seen: half the interval)
    s.taken(1.0, "delta")
    s.committed(2.5)
    line = s.over_half()
    assert "1.50 s" in line and "delta_every_s = 2" in line and s.over_half() == ""
    assert s.due(1.8, STEP, "delta") and not s.due(1.7, STEP, "delta")  # (I = 2 / (1 + 1.5 / 1) after 1)
    snaps = simulate(lambda k, _: 1.5, until=20)
    assert all(b[0] == a[1] for a, b in zip(snaps[1:], snaps[2:]))  # (each waits for the one before)


def test_without_timed_snapshots_no_write_is_said_to_be_over_half_the_interval():
    """A signal's checkpoint (or one by count) with ``checkpoint.delta_every_s = 0`` warned that it
    took more than half of an interval of 0."""
    s = SnapshotSchedule(0.0, 0.0)
    s.taken(1.0, "full")
    s.committed(1.2)
    assert s.over_half() == ""


def test_full_writes_are_expected_as_long_and_deltas_as_long_for_the_time_they_cover():
    s = SnapshotSchedule(D, 0.0)
    s.taken(0.0, "full")
    s.committed(0.9)
    s.taken(0.5, "delta")  # (covers 0.5 s, written in 0.25: half a second of write a second covered)
    s.committed(0.75)
    assert s.next_interval("full") == pytest.approx(D - 0.9)
    assert s.next_interval("delta") == pytest.approx(D / 1.5)  # I + I / 2 = D
    assert s.deadline("delta") == pytest.approx(0.5 + D / 1.5)
    assert s.most_lost == pytest.approx(0.75)  # (a kill just before 0.75 lost from 0.0 on)
    s.start(9.0)  # (a snapshot seen: the first step was earlier)
    assert s.point == 0.5
    s.taken(2.0, "delta")
    s.missed()
    s.committed(9.0)  # (nothing under way: ignored)
    assert [pytest.approx(w) for w in s.writes["delta"]] == [(0.5, 0.25)] and s.point == 2.0


def test_a_full_write_longer_than_the_interval_spaces_full_snapshots_by_half_of_it_and_is_said():
    """A full snapshot that takes longer than ``D`` to write cannot keep the bound: the next one is
    still half an interval on (not at every step, holding training at each), and a line says so."""
    s = SnapshotSchedule(D, 0.0)
    s.taken(0.0, "full")
    s.committed(3.0)
    assert s.next_interval("full") == pytest.approx(D / 2)
    assert not s.due(0.5, STEP, "full") and s.due(D / 2, STEP, "full")
    assert "more than half" in s.over_half() and s.over_half() == ""
