"""``lmsp``: run the service (``up``, ``api``, ``worker``) and manage its tokens (``token``)."""

import argparse
import sys
from collections.abc import Sequence

from lmsp import tokens
from lmsp_core.settings import load_settings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmsp", description="LMSP generation service")
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="API and one worker in the foreground (and a local redis-server "
                                        "when no --redis-url is given)")
    up.add_argument("--host")
    up.add_argument("--port", type=int)
    up.add_argument("--redis-url")
    up.add_argument("--model", action="append", dest="models", metavar="ID")

    api = commands.add_parser("api", help="the HTTP API alone")
    api.add_argument("--host")
    api.add_argument("--port", type=int)
    api.add_argument("--redis-url")

    worker = commands.add_parser("worker", help="a generation worker alone")
    worker.add_argument("--model", action="append", dest="models", metavar="ID")
    worker.add_argument("--redis-url")

    tokens.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    overrides = {name: getattr(args, name, None) for name in ("host", "port", "redis_url")}
    settings = load_settings(**overrides)
    if args.command == "api":
        from api.server import run

        run(settings)
    elif args.command == "worker":
        from workers.main import run as run_worker

        run_worker(settings, args.models or [settings.default_model])
    elif args.command == "token":
        return tokens.run(args, settings)
    elif args.command == "up":
        from lmsp.up import up

        return up(settings, args.models or [settings.default_model])
    return 0


if __name__ == "__main__":
    sys.exit(main())
