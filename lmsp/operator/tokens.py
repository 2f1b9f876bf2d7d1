"""``lmsp token create | list | revoke``: manage the API's bearer tokens in Redis.

``create`` prints the new token once, on standard output alone (so that scripts can capture it);
Redis keeps only its SHA-256 hash. ``revoke`` takes effect on the next request of every API process.
"""

import argparse
import sys
import time

from lmsp.operator.redisaccess import add_redis_arguments, run_command, warn_unless_replicated
from lmsp_core.settings import Settings


def add_parser(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    token = commands.add_parser("token", help="manage bearer tokens (stored hashed in Redis)")
    actions = token.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create a token and print it once")
    create.add_argument("--principal", required=True, help="the tenant that owns what the token creates")
    create.add_argument("--scopes", required=True, help="comma-separated, of: models:read, responses:write, "
                        "responses:read, tasks:write, tasks:read, webhooks:manage")
    listing = actions.add_parser("list", help="list tokens (ids, principals, scopes; never the tokens)")
    revoke = actions.add_parser("revoke", help="revoke a token by id")
    revoke.add_argument("token_id", metavar="ID")
    for action in (create, listing, revoke):
        add_redis_arguments(action)


def run(args: argparse.Namespace, settings: Settings) -> int:
    return run_command("token", _run(args, settings))


async def _run(args: argparse.Namespace, settings: Settings) -> int:
    from lmsp_core.store import connections, keys
    from lmsp_core.store.tenants import credentials

    redis = connections.connect(settings)
    try:
        if args.action == "create":
            token, record = await credentials.create(redis, args.principal, args.scopes)
            await warn_unless_replicated(redis, settings, "token", keys.credential_index())
            print(token)
            print(f"created {record.id} for principal {record.principal} ({','.join(record.scopes)}); "
                  "the token is shown only now", file=sys.stderr)
        elif args.action == "list":
            for record in await credentials.list_tokens(redis):
                created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.created_at))
                print(f"{record.id}\t{record.principal}\t{','.join(record.scopes)}\t{created}")
        elif not await credentials.revoke(redis, args.token_id):
            print(f"lmsp token: no token {args.token_id}", file=sys.stderr)
            return 1
        else:
            await warn_unless_replicated(redis, settings, "token", keys.credential_index())
            print(f"revoked {args.token_id}", file=sys.stderr)
        return 0
    finally:
        await connections.close(redis)
