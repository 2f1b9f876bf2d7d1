"""``lmsp webhook create | list | delete | deliveries``: principals' webhook endpoints, in Redis.

The operator's side of ``/lmsp/v1/webhooks`` (docs/protocol.md, "Webhooks"). ``create`` prints the
endpoint's signing secret once, on standard output alone (so that scripts can capture it). The URL's
form is checked here; its address is checked by the API at every attempt
(``LMSP_WEBHOOK_ALLOW_PRIVATE``), so an endpoint created here for a private address records refused
attempts on a service that does not allow them.
"""

import argparse
import sys
import time

from lmsp.operator.redisaccess import add_redis_arguments, run_command, warn_unless_replicated
from lmsp_core.settings import Settings
from lmsp_core.wire.webhooks import WebhookDelivery

PAGE = 20


def add_parser(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    webhook = commands.add_parser("webhook", help="principals' webhook endpoints and their deliveries")
    actions = webhook.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="create an endpoint and print its signing secret once")
    create.add_argument("--principal", required=True, help="whose events it receives")
    create.add_argument("--url", required=True, help="an http or https URL the events are POSTed to")
    create.add_argument("--events", required=True, metavar="TYPE,...",
                        help="comma-separated event types, e.g. response.completed,task.failed,batch.completed")
    listing = actions.add_parser("list", help="endpoints (ids, principals, URLs, events; never the secrets)")
    listing.add_argument("--principal", help="only this principal's")
    delete = actions.add_parser("delete", help="delete an endpoint and its deliveries")
    delete.add_argument("webhook_id", metavar="ID")
    deliveries = actions.add_parser("deliveries", help="an endpoint's recent deliveries and their attempts")
    deliveries.add_argument("webhook_id", metavar="ID")
    deliveries.add_argument("--limit", type=int, default=PAGE, help=f"newest first (default {PAGE})")
    for action in (create, listing, delete, deliveries):
        add_redis_arguments(action)


def run(args: argparse.Namespace, settings: Settings) -> int:
    return run_command("webhook", _run(args, settings))


async def _run(args: argparse.Namespace, settings: Settings) -> int:
    from lmsp_core.requests import webhooks as checks
    from lmsp_core.store import connections, keys
    from lmsp_core.store.objects import webhooks
    from lmsp_core.store.tenants.credentials import check_principal

    if args.action == "create" or getattr(args, "principal", None):
        check_principal(args.principal)
    redis = connections.connect(settings)
    try:
        if args.action == "create":
            url = checks.check_url(args.url)
            events = checks.check_events([event.strip() for event in args.events.split(",") if event.strip()])
            record = await webhooks.create_endpoint(redis, args.principal, url, events)
            await warn_unless_replicated(redis, settings, "webhook", keys.all_webhooks())
            print(record.secret)
            print(f"created {record.id} for principal {record.owner}; the secret is shown only now",
                  file=sys.stderr)
        elif args.action == "list":
            for record in await webhooks.list_endpoints(redis, args.principal):
                print(f"{record.id}\t{record.owner}\t{record.url}\t{','.join(record.events)}\t"
                      f"{_when(record.created_at)}")
        elif args.action == "delete":
            if not await webhooks.delete_endpoint(redis, args.webhook_id):
                print(f"lmsp webhook: no endpoint {args.webhook_id}", file=sys.stderr)
                return 1
            await warn_unless_replicated(redis, settings, "webhook", keys.all_webhooks())
            print(f"deleted {args.webhook_id}", file=sys.stderr)
        else:
            if await webhooks.get_endpoint(redis, args.webhook_id) is None:
                print(f"lmsp webhook: no endpoint {args.webhook_id}", file=sys.stderr)
                return 1
            found, _ = await webhooks.list_deliveries(redis, args.webhook_id, max(1, args.limit))
            for delivery in found:
                print(delivery_line(delivery.to_wire()))
        return 0
    finally:
        await connections.close(redis)


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def delivery_line(delivery: WebhookDelivery) -> str:
    """``ID<TAB>event type<TAB>event id<TAB>status<TAB>created<TAB>attempts`` with each attempt as
    ``time=status|error``."""
    attempts = "; ".join(f"{_when(attempt.attempted_at)}={attempt.status_code or attempt.error}"
                         for attempt in delivery.attempts)
    return (f"{delivery.id}\t{delivery.event_type}\t{delivery.event_id}\t{delivery.status}\t"
            f"{_when(delivery.created_at)}\t{attempts or '-'}")
