"""The house rules of docs/codemap.md, read from the code's own imports: who may import whom, and no
circles between modules."""

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "bench", "lmsp", "lmsp_core", "tests", "workers")
# the engine and the model: a library that takes token ids and gives tokens
LIBRARY = ("workers.engine", "workers.model")
QUEUE_AND_STORE = ("arq", "redis", "lmsp_core.store")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def imports(path: Path, top_level_only: bool) -> Iterator[str]:
    """The modules ``path`` imports (``from a.b import c``: ``a.b.c`` where that is a module, else
    ``a.b``); with ``top_level_only``, not those inside functions (a deferred import is a choice, not
    a dependency of the module)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    for node in nodes:
        yield from _names(node)


def _names(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
        for alias in node.names:
            submodule = f"{node.module}.{alias.name}"
            yield submodule if is_module(submodule) else node.module


def is_module(name: str) -> bool:
    path = ROOT / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports, deferred imports too (a circle cut by importing
    inside a function is still a circle)."""
    known = modules()
    # a package's own modules run its ``__init__`` anyway: importing it from inside is no tie
    return {name: {target for target in imports(path, top_level_only=False)
                   if target in known and not within(name, (target,))} for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == package or name.startswith(f"{package}.") for package in packages)


def offenders(importers: tuple[str, ...], forbidden: tuple[str, ...], top_level_only: bool) -> list[str]:
    """``importer imports target`` for each module of ``importers`` that imports one of ``forbidden``."""
    return sorted({f"{name} imports {target}" for name, path in modules().items() if within(name, importers)
                   for target in imports(path, top_level_only) if within(target, forbidden)})


def test_no_module_imports_itself_back() -> None:
    assert circles(graph()) == []


def test_the_engine_and_the_model_know_nothing_of_the_queue_or_the_store() -> None:
    assert offenders(LIBRARY, QUEUE_AND_STORE, top_level_only=False) == []
    assert offenders(LIBRARY, ("workers.output", "workers.main", "workers.service", "workers.taskrun",
                               "workers.writer"), top_level_only=False) == []


def test_the_model_does_not_import_the_engine() -> None:
    assert offenders(("workers.model",), ("workers.engine",), top_level_only=False) == []


def test_http_and_generation_stay_apart() -> None:
    assert offenders(("api",), ("torch", "transformers", "workers"), top_level_only=False) == []
    assert offenders(("workers",), ("litestar", "api"), top_level_only=False) == []
    assert offenders(("lmsp_core",), ("api", "workers", "lmsp", "torch", "litestar"), top_level_only=False) == []


def test_the_api_rooms_import_downward() -> None:
    """HTTP on top; following, submission and the background loops under it; the process's shared
    parts and the OpenAI adapter under them (docs/codemap.md)."""
    rooms = ("api.http", "api.follow", "api.submission", "api.background")
    shared = ("api.process", "api.eventhub", "api.limits", "api.metrics", "api.modeltext", "api.openai")
    below_http = (*rooms[1:], *shared, "api.storedresponses")
    assert offenders(below_http, ("api.http", "api.server"), top_level_only=False) == []
    assert offenders(("api.submission", *shared), ("api.follow", "api.background"), top_level_only=False) == []
    assert offenders(shared, ("api.submission", "api.storedresponses"), top_level_only=False) == []


def test_the_api_and_the_store_keep_their_modules_in_rooms() -> None:
    """At most ten modules at the top of each; the rest in rooms whose names say what is there."""
    for package in ("api", "lmsp_core/store"):
        assert len(list((ROOT / package).glob("*.py"))) <= 10, package


def test_routes_leave_redis_to_the_stores() -> None:
    assert offenders(("api.http.routes",), ("lmsp_core.store.connections", "lmsp_core.store.keys"),
                     top_level_only=False) == []


def test_the_wire_types_import_no_store_and_no_request_checks() -> None:
    assert offenders(("lmsp_core.wire",), ("lmsp_core.store", "lmsp_core.requests"), top_level_only=False) == []


def test_the_client_package_does_not_pull_in_the_server() -> None:
    assert offenders(("lmsp",), ("api", "workers", "torch", "litestar"), top_level_only=True) == []


def test_tests_share_helpers_through_support_modules_not_through_each_other() -> None:
    assert sorted(f"{name} imports {target}" for name, edges in graph().items() for target in edges
                  if target.rpartition(".")[2].startswith("test_")) == []


def test_the_rules_see_a_circle_and_a_forbidden_import() -> None:
    """The checks above would fail: a circle of three is found, and so is this module's own import."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "ast" in set(imports(Path(__file__), top_level_only=True))
