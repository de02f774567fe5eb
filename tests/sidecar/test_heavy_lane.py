"""The heavy lane (coordinator/sidecar/heavy.py): one heavy read at a time, credentials in turns,
and a credential's reads within a share of the time while another credential is served."""

from __future__ import annotations

import anyio
import pytest

from coordinator.sidecar.heavy import HeavyLane

pytestmark = pytest.mark.anyio


async def _read(lane: HeavyLane, who: str, order: list[str], release: anyio.Event | None = None, seconds: float = 0.0) -> None:
    async with lane.turn(who):
        order.append(who)
        if release is not None:
            await release.wait()
        if seconds:
            await anyio.sleep(seconds)


async def test_credentials_take_turns_so_one_with_many_reads_queued_does_not_hold_another_behind_all_of_them() -> None:
    lane = HeavyLane(share=1.0)
    order: list[str] = []
    release = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_read, lane, "mallory", order, release)
        await anyio.wait_all_tasks_blocked()
        for _ in range(5):  # queued behind the first, for mallory's turn
            tg.start_soon(_read, lane, "mallory", order)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(_read, lane, "legit", order)
        await anyio.wait_all_tasks_blocked()
        release.set()
    assert order.index("legit") == 1, order  # right after the read that ran, not after all six
    assert order.count("mallory") == 6


async def test_a_credential_whose_read_took_time_rests_while_another_is_served() -> None:
    lane = HeavyLane(share=0.5, window=10.0)
    order: list[str] = []
    lane.saw("legit")
    await _read(lane, "mallory", order, seconds=0.05)
    started = anyio.current_time()
    await _read(lane, "mallory", order)
    # At a share of a half, a read of 0.05 s is followed by as long a rest (legit was served).
    assert lane.rested >= 0.04
    assert anyio.current_time() - started >= 0.04
    await _read(lane, "legit", order)  # legit read nothing before: it does not rest
    assert order == ["mallory", "mallory", "legit"]


async def test_a_credential_alone_is_never_held_back() -> None:
    lane = HeavyLane(share=0.01, window=10.0)
    order: list[str] = []
    lane.saw("mallory")  # its own frames do not make it rest
    for _ in range(3):
        await _read(lane, "mallory", order, seconds=0.02)
    assert lane.rested == 0.0 and order == ["mallory"] * 3


async def test_a_rest_ends_when_the_others_stop_being_served() -> None:
    lane = HeavyLane(share=0.001, window=0.05)  # a rest of ~20 s if the others went on
    order: list[str] = []
    lane.saw("legit")
    await _read(lane, "mallory", order, seconds=0.02)
    with anyio.fail_after(5):
        await _read(lane, "mallory", order)  # legit's last frame ages past the window: the rest ends
    assert 0 < lane.rested < 1


async def test_a_read_cancelled_while_it_waits_leaves_the_lane_usable() -> None:
    lane = HeavyLane(share=1.0)
    order: list[str] = []
    release = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_read, lane, "a", order, release)
        await anyio.wait_all_tasks_blocked()
        with anyio.move_on_after(0.01):
            await _read(lane, "b", order)  # waits for the slot, then gives up
        release.set()
    await _read(lane, "b", order)
    assert order == ["a", "b"]


def test_a_share_outside_zero_to_one_is_refused() -> None:
    for share in (0.0, -1.0, 1.5):
        with pytest.raises(ValueError, match="fraction of the time"):
            HeavyLane(share=share)


def test_what_the_lane_remembers_of_credentials_seen_stays_bounded() -> None:
    """Without a credentials file each engine id is a credential: many engines stepping while no
    heavy read runs must not grow the lane's memory without bound (the stale ones are pruned)."""
    from coordinator.sidecar.heavy import MAX_SEEN

    now = [0.0]
    lane = HeavyLane(window=1.0, clock=lambda: now[0])
    for index in range(3 * MAX_SEEN):
        now[0] = index * 0.001  # a millisecond apart: about 1,000 of them within any window
        lane.saw(f"engine:{index}")
    assert len(lane._seen) <= MAX_SEEN + 1
    assert lane.others_served("engine:0")  # the recent ones still count
    now[0] += 2.0
    assert not lane.others_served("engine:0")
