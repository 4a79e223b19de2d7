"""DeadlineSlots: FIFO slots whose waiters give up at their deadline."""

from __future__ import annotations

import asyncio

import pytest

from gateway.core.slots import DeadlineSlots


def later(seconds: float) -> float:
    return asyncio.get_running_loop().time() + seconds


async def test_free_slots_are_taken_without_waiting() -> None:
    slots = DeadlineSlots(2)
    assert await slots.acquire(later(10))
    assert await slots.acquire(later(10))
    waiter = asyncio.create_task(slots.acquire(later(10)))
    await asyncio.sleep(0)
    assert not waiter.done() and slots.waiting == 1
    slots.release()
    assert await waiter


async def test_waiters_are_served_in_arrival_order() -> None:
    slots = DeadlineSlots(1)
    assert await slots.acquire(later(10))
    served: list[int] = []

    async def wait(i: int) -> None:
        assert await slots.acquire(later(10))
        served.append(i)

    tasks = [asyncio.create_task(wait(i)) for i in range(5)]
    await asyncio.sleep(0)
    for _ in range(5):
        slots.release()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert served == [0, 1, 2, 3, 4]


async def test_a_waiter_gives_up_at_its_deadline_without_taking_a_slot() -> None:
    slots = DeadlineSlots(1)
    assert await slots.acquire(later(10))
    short = asyncio.create_task(slots.acquire(later(0.05)))
    long = asyncio.create_task(slots.acquire(later(10)))
    assert await short is False  # only the timer can end it: no slot is released
    assert not long.done() and slots.waiting == 1
    slots.release()  # goes to the waiter that is still waiting, not the expired one
    assert await long is True
    slots.release()
    assert await slots.acquire(later(10))  # and the slot count is intact


async def test_later_deadlines_stay_armed_after_an_earlier_one_expires() -> None:
    slots = DeadlineSlots(1)
    assert await slots.acquire(later(10))
    first = asyncio.create_task(slots.acquire(later(0.02)))
    second = asyncio.create_task(slots.acquire(later(0.06)))
    assert await first is False
    assert not second.done()
    assert await second is False
    assert slots.waiting == 0


async def test_waiters_expire_in_deadline_order_whatever_their_arrival() -> None:
    slots = DeadlineSlots(1)
    assert await slots.acquire(later(10))
    waiters = {
        name: asyncio.create_task(slots.acquire(later(seconds)))
        for name, seconds in (("late", 0.06), ("early", 0.01), ("middle", 0.03))
    }
    ended: list[str] = []
    pending = set(waiters.values())
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        ended += sorted(name for name, task in waiters.items() if task in done)
    assert ended == ["early", "middle", "late"]
    assert all(task.result() is False for task in waiters.values())


async def test_expired_and_served_waiters_are_not_kept() -> None:
    """Both the FIFO and the deadline heap let go of waiters that are done with: a
    saturated lane must not hold a second copy of its queue until deadlines pass."""
    slots = DeadlineSlots(1)
    assert await slots.acquire(later(10))
    expiring = [asyncio.create_task(slots.acquire(later(0.01))) for _ in range(500)]
    assert not any(await asyncio.gather(*expiring))
    assert len(slots._waiters) <= 64 and len(slots._deadlines) == 0  # from 500
    served = [asyncio.create_task(slots.acquire(later(60))) for _ in range(500)]
    await asyncio.sleep(0)
    for _ in served:
        slots.release()
    assert all(await asyncio.gather(*served))
    assert len(slots._deadlines) <= 65
    assert slots.waiting == 0


async def test_a_past_deadline_fails_at_once_when_full() -> None:
    slots = DeadlineSlots(1)
    assert await slots.acquire(later(10))
    assert await slots.acquire(later(-1)) is False


async def test_a_cancelled_waiter_does_not_swallow_a_slot() -> None:
    slots = DeadlineSlots(1)
    assert await slots.acquire(later(10))
    cancelled = asyncio.create_task(slots.acquire(later(10)))
    other = asyncio.create_task(slots.acquire(later(10)))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    slots.release()
    assert await asyncio.wait_for(other, 5) is True


async def test_granted_then_cancelled_passes_the_slot_on() -> None:
    slots = DeadlineSlots(1)
    assert await slots.acquire(later(10))
    first = asyncio.create_task(slots.acquire(later(10)))
    second = asyncio.create_task(slots.acquire(later(10)))
    await asyncio.sleep(0)
    slots.release()  # grants `first` ...
    first.cancel()  # ... which is cancelled before it runs again
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await asyncio.wait_for(second, 5) is True  # a leaked slot would never come


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        DeadlineSlots(0)
