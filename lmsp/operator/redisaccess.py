"""What the operator commands (``lmsp token``, ``lmsp principal``, ``lmsp webhook``) share: where
the service's Redis is, how a command runs against it, and the warning when no replica confirmed
its write."""

import argparse
import asyncio
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from lmsp_core.settings import Settings
from lmsp_core.wire.errors import InvalidRequest

if TYPE_CHECKING:  # the service's packages (extra "api"): imported when the command runs
    from redis.asyncio import Redis


def add_redis_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the service's Redis is (flags over ``LMSP_REDIS_*``)."""
    parser.add_argument("--redis-url")
    parser.add_argument("--redis-sentinels", metavar="HOST:PORT,...",
                        help="ask these Redis Sentinels for the primary (the URL then gives database and credentials)")
    parser.add_argument("--redis-master", metavar="NAME", help="the primary's name at the sentinels")
    parser.add_argument("--redis-cluster", metavar="HOST:PORT,...",
                        help="some nodes of a Redis Cluster (the URL then gives credentials and TLS)")


def run_command(command: str, work: Coroutine[Any, Any, int]) -> int:
    """Run an operator command (``lmsp token``, ``lmsp principal``): a bad argument it finds
    (``InvalidRequest``) is one line on standard error and exit status 2."""
    try:
        return asyncio.run(work)
    except InvalidRequest as exc:
        print(f"lmsp {command}: {exc.detail}", file=sys.stderr)
        return 2


async def warn_unless_replicated(redis: "Redis", settings: Settings, command: str, key: str) -> None:
    """After an operator's write of ``key``: say so when no replica confirmed it (a revocation that a
    failover loses would let the token in again, a quota would be lifted again)."""
    from lmsp_core.store import connections

    if not await connections.replicated(redis, connections.ReplicaWatch(settings), key):
        print(f"lmsp {command}: warning: no replica confirmed the change within {settings.redis_wait_timeout} s; "
              "a failover before it reaches one would undo it", file=sys.stderr)
