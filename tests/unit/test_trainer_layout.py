"""The trainer package's import rules, read from the source with `ast` (nothing is imported): no module of
`prime_rl.trainer` imports the orchestrator, the inference server or eval (anywhere, also inside a function), and
the imports among `prime_rl.trainer.*` modules have no cycle: not at module level, and not through an import deferred
into a function either (the way `train` once imported `train_lora`, which imported `train`)."""

import ast
from pathlib import Path

import prime_rl

SRC = Path(prime_rl.__file__).parent.parent
TRAINER = SRC / "prime_rl" / "trainer"
FORBIDDEN = ("prime_rl.orchestrator", "prime_rl.inference", "prime_rl.eval")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(TRAINER.rglob("*.py"))}


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The absolute module names an import statement names: `from a.b import c` names `a.b.c` when that is a
    trainer module, else `a.b`."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:  # relative: resolved against this module's package
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module
    names = [f"{base}.{alias.name}" for alias in node.names]
    return [name if name in MODULES else base for name in names]


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def module_level_imports(body: list[ast.stmt]):
    """Import statements run when the module is imported: top level, and inside top-level `if`/`try` blocks
    (not `if TYPE_CHECKING:`), but not inside functions or classes."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not is_type_checking(node):
                yield from module_level_imports(node.body)
            yield from module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from module_level_imports(block)


def parse(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))


def all_imports(body: list[ast.stmt]):
    """Every import statement, also those inside functions and `if TYPE_CHECKING:`."""
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def import_graph(which=module_level_imports) -> dict[str, set[str]]:
    """Trainer module -> the trainer modules its `which` imports import (a module imports its packages too)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in which(parse(module).body):
            for name in imported(node, module, is_package):
                parts = name.split(".")
                targets |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & MODULES.keys()
        graph[module] = targets - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path `[a, b, ..., a]`, or None."""
    done: set[str] = set()
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in stack:
            return stack[stack.index(node) :] + [node]
        if node in done:
            return None
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            cycle = visit(target)
            if cycle:
                return cycle
        stack.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle:
            return cycle
    return None


def test_the_trainer_imports_no_orchestrator_inference_or_eval():
    found = []
    for module in MODULES:
        is_package = MODULES[module].name == "__init__.py"
        for node in all_imports(parse(module).body):
            for name in imported(node, module, is_package):
                if any(name == f or name.startswith(f + ".") for f in FORBIDDEN):
                    found.append(f"{MODULES[module].relative_to(SRC)}:{node.lineno} imports {name}")
    assert not found, "\n".join(found)


def test_trainer_modules_import_each_other_without_a_cycle():
    graph = import_graph()
    # The walk sees the real package: the RL entry point imports the LoRA loop, and both loops stand on the scaffold.
    assert "prime_rl.trainer.rl.train_lora" in graph["prime_rl.trainer.rl.train"]
    assert "prime_rl.trainer.scaffold" in graph["prime_rl.trainer.sft.train"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_deferred_into_a_function_hides_a_cycle():
    cycle = find_cycle(import_graph(all_imports))
    assert cycle is None, "import cycle (counting imports inside functions): " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
