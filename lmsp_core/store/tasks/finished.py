"""The stream of tasks that ended (``keys.finished``): how the API learns of a task's end, at least once.

Whoever ends a task adds its id: the worker after the task's final event is stored, the API when it
cancels a queued task, the reaper when it drops a final task from its index (a worker killed
between its final append and this one). An id may come several times; its readers (the API's
webhook consumers, ``api/background/webhooks/consumer.py``, and conversations' settlers,
``api/background/conversations.py``, a consumer group each) read the task's record, which is the
truth, and act idempotently.
"""

from collections.abc import Iterable

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from lmsp_core.store import keys

# entries kept (approximately): far more than tasks end while every reader is away
CAP = 100_000


def add(pipe: Pipeline, task_ids: Iterable[str]) -> None:
    """Add an entry per task id, on a pipeline the caller executes."""
    for task_id in task_ids:
        pipe.xadd(keys.finished(), {"task": task_id}, maxlen=CAP, approximate=True)


async def announce(redis: Redis, task_ids: Iterable[str]) -> None:
    """Add the ids in one round trip."""
    async with redis.pipeline(transaction=False) as pipe:
        add(pipe, task_ids)
        if len(pipe):
            await pipe.execute()
