"""``lmsp principal set | list | show``: a principal's (a tenant's) weight and quotas, in Redis.

They apply to each model's queue on its own: the weight is the principal's share of each model's
queue (weight 2 gets twice the share of weight 1 while both wait), ``max_running`` and ``max_queued``
count its tasks per model (at ``max_running`` its next task waits while others' run; beyond
``max_queued`` a submission gets 429 ``queue_quota_exceeded``). Workers see a change within a second,
API processes on the next submission; with ``LMSP_FAIR_SHARE=false`` none of it applies (docs/queue.md,
"Fair share between principals").

``set`` changes only the fields it is given (``none`` lifts a quota) and prints the result; setting
the defaults again (weight 1, no quota) forgets the principal. ``list`` shows the principals with
settings of their own, ``show`` one principal (the defaults for one nobody set).
"""

import argparse
from typing import TYPE_CHECKING, Any

import msgspec

from lmsp.operator.redisaccess import add_redis_arguments, run_command, warn_unless_replicated
from lmsp_core.settings import Settings
from lmsp_core.wire.errors import InvalidRequest

if TYPE_CHECKING:  # the service's packages (extra "api"): imported when the command runs
    from lmsp_core.store.tenants.principals import PrincipalSettings

FIELDS = ("weight", "max_running", "max_queued")


def add_parser(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    principal = commands.add_parser("principal", help="a principal's weight and quotas in each model's queue")
    actions = principal.add_subparsers(dest="action", required=True)
    change = actions.add_parser("set", help="change the settings given, print the result")
    change.add_argument("name", metavar="NAME")
    # strings: checked against PrincipalSettings, so that a bad value is one line like the others
    change.add_argument("--weight", metavar="W", help="its share of each model's queue (0 < W <= 1000; default 1)")
    change.add_argument("--max-running", metavar="N|none", help="its running tasks per model at most")
    change.add_argument("--max-queued", metavar="N|none",
                        help="its waiting tasks per model at most (more: 429 queue_quota_exceeded)")
    listing = actions.add_parser("list", help="the principals with settings of their own")
    show = actions.add_parser("show", help="a principal's settings")
    show.add_argument("name", metavar="NAME")
    for action in (change, listing, show):
        add_redis_arguments(action)


def run(args: argparse.Namespace, settings: Settings) -> int:
    return run_command("principal", _run(args, settings))


async def _run(args: argparse.Namespace, settings: Settings) -> int:
    from lmsp_core.store import connections, keys
    from lmsp_core.store.tenants import principals
    from lmsp_core.store.tenants.credentials import check_principal

    if args.action != "list":
        check_principal(args.name)
    redis = connections.connect(settings)
    try:
        if args.action == "list":
            for name, entry in sorted((await principals.load(redis)).items()):
                print(line(name, entry))
        elif args.action == "show":
            print(line(args.name, await principals.get(redis, args.name)))
        else:
            entry = changed(await principals.get(redis, args.name), args)
            await principals.store(redis, args.name, entry)
            await warn_unless_replicated(redis, settings, "principal", keys.principals())
            print(line(args.name, entry))
        return 0
    finally:
        await connections.close(redis)


def changed(current: "PrincipalSettings", args: argparse.Namespace) -> "PrincipalSettings":
    """``current`` with the fields the command line gives, checked as ``PrincipalSettings`` checks them."""
    from lmsp_core.store.tenants.principals import PrincipalSettings

    given: dict[str, Any] = {field: getattr(args, field) for field in FIELDS if getattr(args, field) is not None}
    if not given:
        raise InvalidRequest("nothing to set: give --weight, --max-running or --max-queued")
    values = {field: None if value.lower() == "none" else value for field, value in given.items()}
    try:  # the fields given alone (the others keep their defaults here), strings read as numbers
        checked = msgspec.convert(values, PrincipalSettings, strict=False)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(_problem(str(exc), given)) from None
    return msgspec.structs.replace(current, **{field: getattr(checked, field) for field in values})


def _problem(message: str, given: dict[str, str]) -> str:
    """msgspec's "Expected `int` >= 1 - at `$.max_running`" as "--max-running '0': expected `int` >= 1"."""
    text, _, path = message.rpartition(" - at `$.")
    field = path.rstrip("`")
    if not text or field not in given:
        return f"invalid settings: {message}"
    return f"--{field.replace('_', '-')} {given[field]!r}: {text[:1].lower()}{text[1:]}"


def line(name: str, entry: "PrincipalSettings") -> str:
    """``NAME<TAB>weight=W<TAB>max_running=N|-<TAB>max_queued=N|-`` (``-``: no quota)."""
    def quota(value: int | None) -> str:
        return "-" if value is None else str(value)

    weight = repr(entry.weight).removesuffix(".0")
    return f"{name}\tweight={weight}\tmax_running={quota(entry.max_running)}\tmax_queued={quota(entry.max_queued)}"
