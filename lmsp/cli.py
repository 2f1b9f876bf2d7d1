"""``lmsp``: run the service (``up``, ``api``, ``worker``), manage its tokens, principals and webhooks
(``token``, ``principal``, ``webhook``: operator commands on its Redis, ``lmsp/operator/``) and use it
(``run``, ``chat``, ``tasks``, ``batch``, ``models``: client commands over HTTP, ``lmsp/clientcommands/``)."""

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from lmsp.operator import principals, redisaccess, tokens, webhooks
from lmsp_core import logs
from lmsp_core.settings import Settings, load_settings

if TYPE_CHECKING:
    from lmsp.client import Client

CLIENT_COMMANDS = ("run", "chat", "tasks", "batch", "models")
SERVICE_COMMANDS = ("up", "api", "worker")


def _model_flags() -> argparse.ArgumentParser:
    """The models a service command runs (``lmsp_core.requests.modelpaths``)."""
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--model", action="append", dest="models", metavar="ID|PATH|hf:ORG/NAME[@REV]",
                       help="a catalog id, a Hugging Face model directory, a .gguf file or a model in the "
                            "Hugging Face cache (downloaded unless HF_HUB_OFFLINE=1); repeatable")
    flags.add_argument("--model-id", "--served-model-name", dest="model_id", metavar="ID",
                       help="the id requests name the model by (default: the directory's name, the file's "
                            "name without .gguf, ORG/NAME of hf:ORG/NAME)")
    flags.add_argument("--context-window", type=int, metavar="TOKENS",
                       help="default: the model's (config.json, GGUF metadata)")
    flags.add_argument("--max-batch-size", type=int, metavar="N", help="sequences that run at once (KV slots)")
    flags.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    flags.add_argument("--chat-template", metavar="FILE", help="replaces the model's chat template")
    return flags


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmsp", description="LMSP generation service")
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", parents=[_model_flags()],
                             help="API and one worker in the foreground (and a local redis-server when no "
                                  "--redis-url, --redis-sentinels or --redis-cluster is given, or a local Redis "
                                  "Cluster with --local-cluster)")
    up.add_argument("--host")
    up.add_argument("--port", type=int)
    redisaccess.add_redis_arguments(up)
    up.add_argument("--local-cluster", type=int, default=0, metavar="N",
                    help="start a local Redis Cluster of N primaries (3 or more), one replica each, instead of "
                         "one redis-server; it starts empty every time")

    api = commands.add_parser("api", parents=[_model_flags()],
                              help="the HTTP API alone (--model: models its workers are given by path, with "
                                   "the same flags)")
    api.add_argument("--host")
    api.add_argument("--port", type=int)
    redisaccess.add_redis_arguments(api)

    worker = commands.add_parser("worker", parents=[_model_flags()], help="a generation worker alone")
    redisaccess.add_redis_arguments(worker)
    worker.add_argument("--gpus", metavar="all|ID,ID...",
                        help="one worker process per GPU (all visible ones, or these CUDA device ids), each "
                             "pinned to its GPU, all on the same queues")

    tokens.add_parser(commands)
    principals.add_parser(commands)
    webhooks.add_parser(commands)
    _client_parsers(commands)
    return parser


def _client_parsers(commands: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    service = argparse.ArgumentParser(add_help=False)
    service.add_argument("--url", help="the service (default: $LMSP_URL or http://127.0.0.1:8000)")
    service.add_argument("--token", help="bearer token (default: $LMSP_TOKEN)")
    generation = argparse.ArgumentParser(add_help=False)
    generation.add_argument("--model", "-m", help="default: $LMSP_DEFAULT_MODEL or " + Settings().default_model)
    generation.add_argument("--max-output-tokens", type=int)
    generation.add_argument("--temperature", type=float)

    run = commands.add_parser("run", parents=[service, generation], help="stream an answer to a prompt")
    run.add_argument("prompt", nargs="*", help="the prompt (default or '-': standard input)")
    run.add_argument("--task", action="store_true", help="run it as a resumable task")

    chat = commands.add_parser("chat", parents=[service, generation], help="an interactive conversation")
    chat.add_argument("--system", help="a system message")

    tasks = commands.add_parser("tasks", help="your tasks").add_subparsers(dest="action", required=True)
    listing = tasks.add_parser("list", parents=[service], help="newest first")
    listing.add_argument("--limit", type=int, default=20)
    listing.add_argument("--all", action="store_true", help="every page")
    for action, text in (("show", "a task as JSON"), ("cancel", "cancel a task"), ("follow", "stream its text")):
        sub = tasks.add_parser(action, parents=[service], help=text)
        sub.add_argument("task_id")
        if action == "follow":
            sub.add_argument("--after", type=int, default=0, help="resume after this event id")

    _batch_parsers(commands, service)
    commands.add_parser("models", parents=[service], help="models and their workers")


def _batch_parsers(commands: "argparse._SubParsersAction[argparse.ArgumentParser]",
                   service: argparse.ArgumentParser) -> None:
    batch = commands.add_parser("batch", help="OpenAI batches: many requests from a JSONL file")
    actions = batch.add_subparsers(dest="action", required=True)
    files = argparse.ArgumentParser(add_help=False)
    files.add_argument("--output", type=Path, metavar="PATH", help="where to save the output file")
    files.add_argument("--errors", type=Path, metavar="PATH", help="where to save the error file, if any")
    create = actions.add_parser("create", parents=[service, files],
                                help="upload a JSONL file of requests, run it and save what it wrote (default: "
                                     "FILE.output.jsonl and FILE.errors.jsonl next to it)")
    create.add_argument("file", type=Path, metavar="FILE",
                        help='one request a line: {"custom_id", "method": "POST", "url": ENDPOINT, "body"}')
    create.add_argument("--endpoint", required=True, metavar="/v1/chat/completions|/v1/responses")
    create.add_argument("--window", default="24h", help="completion window: 24h or shorter (1h, 30m, 90s)")
    create.add_argument("--no-wait", dest="wait", action="store_false",
                        help="print the batch id and return; the batch runs on")
    wait = actions.add_parser("wait", parents=[service, files],
                              help="wait for a batch and save its files (default: ID.output.jsonl, ID.errors.jsonl)")
    wait.add_argument("batch_id")
    listing = actions.add_parser("list", parents=[service], help="your batches, newest first")
    listing.add_argument("--limit", type=int, default=20)
    listing.add_argument("--all", action="store_true", help="every page")
    for action, text in (("show", "a batch, one line a field"), ("cancel", "cancel a batch")):
        actions.add_parser(action, parents=[service], help=text).add_argument("batch_id")


def _client_main(args: argparse.Namespace) -> int:
    from lmsp.client import Client
    from lmsp.clientcommands import chat, models, run, tasks

    with Client(args.url, token=args.token) as client:
        if args.command == "models":
            return models.models(client)
        if args.command == "batch":
            return _batch_main(client, args)
        if args.command == "tasks":
            if args.action == "list":
                return tasks.list_tasks(client, args.limit, args.all)
            handler = {"show": tasks.show, "cancel": tasks.cancel}.get(args.action)
            if handler is not None:
                return handler(client, args.task_id)
            return tasks.follow(client, args.task_id, args.after)
        model = args.model or os.environ.get("LMSP_DEFAULT_MODEL") or Settings().default_model
        options = {"max_output_tokens": args.max_output_tokens, "temperature": args.temperature}
        if args.command == "chat":
            return chat.chat(client, model, args.system, **options)
        return run.run(client, model, run.prompt_text(args.prompt), task=args.task, **options)


def _batch_main(client: "Client", args: argparse.Namespace) -> int:
    from lmsp.clientcommands import batches

    if args.action == "create":
        paths = batches.Paths.beside(args.file, args.output, args.errors)
        return batches.create(client, args.file, args.endpoint, args.window, paths, args.wait)
    if args.action == "wait":
        return batches.follow(client, args.batch_id, batches.Paths.beside(Path(args.batch_id), args.output,
                                                                          args.errors))
    if args.action == "list":
        return batches.list_batches(client, args.limit, args.all)
    return batches.show(client, args.batch_id) if args.action == "show" else batches.cancel(client, args.batch_id)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in CLIENT_COMMANDS:
        return _client_main(args)
    try:
        return _service_main(args)
    except ModuleNotFoundError as exc:  # a client-only install: the service's packages are extras
        extra = {"worker": "worker", "up": "api,worker"}.get(args.command, "api")
        print(f"lmsp {args.command}: {exc.name} is not installed; this command runs the service: "
              f"pip install 'lmsp-service[{extra}]'", file=sys.stderr)
        return 2


def _service_main(args: argparse.Namespace) -> int:
    overrides = {name: getattr(args, name, None)
                 for name in ("host", "port", "redis_url", "redis_sentinels", "redis_master", "redis_cluster")}
    try:
        settings = load_settings(**overrides)
    except msgspec.ValidationError as exc:  # a setting that cannot work: said at start, in one line
        print(f"lmsp {args.command}: {exc}", file=sys.stderr)
        return 2
    models: list[str] = []
    if args.command in SERVICE_COMMANDS:
        from lmsp_core.requests.modelpaths import ModelRefError

        try:
            settings, models = _named_models(args, settings)
        except (ModelRefError, ValueError) as exc:  # ValueError: a catalog setting that cannot work
            print(f"lmsp {args.command}: {exc}", file=sys.stderr)
            return 2
    if args.command == "api":
        from api.server import run

        run(settings)
    elif args.command == "worker" and args.gpus:
        from workers.supervisor import supervise

        logs.configure(settings.log_level, settings.log_json)
        return supervise(args.gpus, models, {**os.environ, **settings.redis_env(), **settings.models_env()})
    elif args.command == "worker":
        from workers.main import run as run_worker

        run_worker(settings, models)
    elif args.command == "token":
        return tokens.run(args, settings)
    elif args.command == "principal":
        return principals.run(args, settings)
    elif args.command == "webhook":
        return webhooks.run(args, settings)
    elif args.command == "up":
        from lmsp.up import up

        return up(settings, models, args.local_cluster)
    return 0


def _named_models(args: argparse.Namespace, settings: Settings) -> tuple[Settings, list[str]]:
    """The models the command line names (``--model``; the default model for a worker), added to the
    catalog of ``settings``, and their ids. An API reads only their tokenizers: no weights needed."""
    from lmsp_core.requests import modelpaths
    from lmsp_core.requests.catalog import Catalog

    references = args.models or ([] if args.command == "api" else [settings.default_model])
    overrides = modelpaths.Overrides(id=args.model_id, context_window=args.context_window,
                                     max_batch_size=args.max_batch_size, dtype=args.dtype,
                                     chat_template=modelpaths.read_template(args.chat_template))
    catalog = Catalog.from_settings(settings)
    specs = modelpaths.resolve_all(references, catalog, overrides, Path(settings.model_cache),
                                   weights=args.command != "api")
    ids = [spec.id for spec in specs]
    settings = modelpaths.with_specs(settings, catalog, specs)
    if args.command != "worker":  # the API lists the models it is given, while their worker starts too
        settings = settings.replace(listed_models=",".join(filter(None, [settings.listed_models, *ids])))
    return settings, ids


if __name__ == "__main__":
    sys.exit(main())
