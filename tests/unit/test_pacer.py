"""The download pacer (node/exchange/fetch.py `Pacer`): reads over all downloads at its rate,
with a burst allowance, on a clock the test sets."""

import asyncio

from node.exchange.fetch import Pacer


def test_reads_wait_until_their_bytes_are_paid_at_the_rate_after_a_burst():
    now = [100.0]
    pacer = Pacer(1000.0, burst_s=0.05, clock=lambda: now[0])

    async def scenario():
        assert await pacer.wait() == 0.0  # nothing read yet
        pacer.spent(50)  # within the burst: 0.05 s of the rate
        assert await pacer.wait() == 0.0
        pacer.spent(1000)  # one second's worth more, from two downloads alike
        assert abs(pacer._paid_until - 101.0) < 1e-9
        now[0] = 100.5  # half of it paid
        pacer.spent(0)
        assert abs(pacer._paid_until - 101.0) < 1e-9
        now[0] = 200.0  # idle long past: only a burst's worth of credit, never more
        pacer.spent(100)
        assert abs(pacer._paid_until - (200.0 - 0.05 + 0.1)) < 1e-9

    asyncio.run(scenario())


def test_wait_sleeps_for_the_debt():
    async def scenario():
        loop = asyncio.get_running_loop()
        pacer = Pacer(10_000.0, burst_s=0.0)
        pacer.spent(1000)  # 0.1 s at the rate
        started = loop.time()
        waited = await pacer.wait()
        assert 0.05 < waited <= 0.1 + 1e-6 and loop.time() - started >= waited - 1e-3
        assert await pacer.wait() == 0.0

    asyncio.run(scenario())
