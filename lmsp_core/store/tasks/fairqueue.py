"""The fair share of each model's queue between principals (docs/queue.md, "Fair share between
principals").

arq keeps moving jobs (``lmsp_core.store.tasks.queue``); this decides *which* waiting job a worker with
a free slot starts next. Each principal's jobs wait in their own order (priority and age, the arq
queue's score), and a worker picks the head of the principal that has received the least service
for its weight (start-time fair queuing): a principal's pass grows by a job's cost / its weight
when one of its jobs starts, and a principal that returns after a pause competes from the current
virtual time (the pass of the last picked job), so it gets its share at once, not a saved-up burst.

A job's cost is what its task asks for, prompt plus output budget in tokens, charged when it
starts (known before it runs, so a flood of long tasks is paid for at once); when it ends, what
it did not use (an early stop, a cancel) is given back, so over time principals are charged for
the tokens they used.

All of it lives in Redis under one hash tag per model (``keys.fair_queue``), changed by scripts
(``scripts.FAIR_*``), so any number of API processes and workers share it, and it survives
their restarts. A picked job carries a running entry that its worker renews with the task's lease;
a worker that dies lets it lapse, which frees the principal's ``max_running`` slot and lets the
reaper give the job back (``admit`` of a known job).
"""

from collections.abc import Iterable
from datetime import datetime

import msgspec
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from lmsp_core.store import cluster, keys, scripts
from lmsp_core.store.tenants.principals import PrincipalSettings

SEP = "\x01"


def cost(prompt_tokens: int, output_budget: int) -> int:
    """What a task is charged when it starts: the tokens it asks the model for."""
    return max(1, prompt_tokens + output_budget)


def score_text(queued_at: datetime) -> str:
    """A job's arq score (ms) as the waiting set orders it: fixed width, so text order is time order."""
    return f"{max(0, int(queued_at.timestamp() * 1000)):015d}"


class Share(msgspec.Struct, frozen=True):
    """One principal's part of a model's queue now."""

    principal: str
    queued: int
    running: int


class FairQueue:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._admit = redis.register_script(scripts.FAIR_ADMIT)
        self._pick = redis.register_script(scripts.FAIR_PICK)
        self._finish = redis.register_script(scripts.FAIR_FINISH)
        self._drop = redis.register_script(scripts.FAIR_DROP)
        self._renew = redis.register_script(scripts.FAIR_RENEW)
        self._position = redis.register_script(scripts.FAIR_POSITION)

    async def admit(self, model_id: str, job_id: str, principal: str, queued_at: datetime, task_cost: int,
                    max_queued: int | None = None) -> bool:
        """Let a job wait for its principal's turn; False when the principal has ``max_queued``
        waiting jobs already. A job admitted before is left as it is (unless a worker picked it and
        its running entry lapsed: then it waits again)."""
        return bool(await self._admit(keys=keys.fair_queue(model_id),
                                      args=[job_id, principal, score_text(queued_at), task_cost, max_queued or 0]))

    async def pick(self, model_id: str, slots: int, lease_ms: int, settings: dict[str, PrincipalSettings]) -> list[str]:
        """Up to ``slots`` job ids to start now, in fair order."""
        picked = await self._pick(keys=[*keys.fair_queue(model_id), keys.queue(model_id)],
                                  args=[slots, lease_ms, _table(settings)])
        return [job.decode() for job in picked]

    async def position(self, model_id: str, job_id: str, settings: dict[str, PrincipalSettings]) -> int | None:
        """The job's 1-based place in the order jobs start in, if nothing else arrives (None: it does
        not wait in the fair queue)."""
        place = await self._position(keys=[*keys.fair_queue(model_id), keys.queue(model_id)],
                                     args=[job_id, _table(settings)])
        return None if place is None else int(place)

    async def finish(self, model_id: str, job_id: str, used_tokens: int, weight: float, *,
                     requeue: bool = False) -> None:
        """A picked job ended (``requeue``: was handed back, and waits again): give back what its
        principal was charged beyond ``used_tokens``."""
        await self._finish(keys=keys.fair_queue(model_id), args=[job_id, used_tokens, weight, int(requeue)])

    async def drop(self, model_id: str, job_id: str) -> None:
        """Forget a job that left the arq queue without running."""
        await self._drop(keys=keys.fair_queue(model_id), args=[job_id])

    def drop_in(self, pipe: Pipeline, model_id: str, job_id: str) -> None:
        """``drop``, added to a pipeline or transaction."""
        cluster.evalsha(pipe, self._drop, keys.fair_queue(model_id), [job_id])

    async def renew(self, model_id: str, running: Iterable[tuple[str, str]], lease_ms: int) -> None:
        """Renew the running entries of (principal, job) pairs that this worker runs."""
        members = [f"{principal}{SEP}{job}" for principal, job in running]
        if members:
            await self._renew(keys=[keys.fair_queue(model_id)[3]], args=[lease_ms, *members])

    async def shares(self, model_ids: list[str]) -> dict[str, list[Share]]:
        """Per model: each principal with waiting or running jobs, and how many."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.execute_command("TIME")  # (a cluster pipeline refuses its ``time()``; any node's clock)
            for model_id in model_ids:
                _, ready, _, running, _ = keys.fair_queue(model_id)
                pipe.zrange(ready, 0, -1)
                pipe.zrange(running, 0, -1, withscores=True)
            replies = await pipe.execute()
        seconds, micros = replies[0]
        now_ms = seconds * 1000 + micros // 1000
        queued = await self._waiting_counts(model_ids, replies[1::2])
        shares: dict[str, list[Share]] = {}
        for model_id, counts, running_members in zip(model_ids, queued, replies[2::2], strict=True):
            running_counts: dict[str, int] = {}
            for member, lapse in running_members:
                if lapse > now_ms:  # a lapsed entry stays until the next pick removes it
                    name = member.decode().partition(SEP)[0]
                    running_counts[name] = running_counts.get(name, 0) + 1
            names = sorted(set(counts) | set(running_counts))
            shares[model_id] = [Share(name, counts.get(name, 0), running_counts.get(name, 0)) for name in names]
        return shares

    async def _waiting_counts(self, model_ids: list[str], ready: list[list[bytes]]) -> list[dict[str, int]]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for model_id, names in zip(model_ids, ready, strict=True):
                for name in names:
                    pipe.zlexcount(keys.fair_queue(model_id)[0], f"[{name.decode()}{SEP}",  # type: ignore[no-untyped-call]
                                   f"({name.decode()}\x02")
            counts = iter(await pipe.execute())
        return [{name.decode(): int(next(counts)) for name in names} for names in ready]


def _table(settings: dict[str, PrincipalSettings]) -> bytes:
    """The principals' settings as the scripts read them: name -> [weight, max_running (0: none)]."""
    return msgspec.msgpack.encode({name: [s.weight, s.max_running or 0] for name, s in settings.items()})
