"""The torch APIs the trainer's code names, and whether a given torch has them.

GPU machines here have torch 2.11; the project's environment has a newer one. An API added after 2.11 works in
CI and fails only in a GPU window, which is minutes long and rare. So `scripts/gpu/run.sh` records, with the GPU
machine's torch, which of the names our code uses exist there (`dump`), and a CI test (`check`) compares the
code of today against that record:

    python scripts/gpu/torch_api.py dump  --out scripts/gpu/torch-2.11-api.json   # there, with torch 2.11
    python scripts/gpu/torch_api.py check --api scripts/gpu/torch-2.11-api.json  # here: exit 1 names what is new

What is checked: every dotted name rooted at a torch import (`torch.x.y`, `dist.x` after
`import torch.distributed as dist`, `from torch.x import y`), and every attribute name our code reads off any
object that is a method or attribute of `torch.Tensor` / `torch.nn.Module` here but not in the record (a tensor
method added after 2.11). A name the record cannot answer (a module it did not list) fails too, with the way to
refresh the record; the GPU run itself remains the final word.
"""

import argparse
import ast
import importlib
import json
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = ("trainer", "sft")
"""The console scripts whose import closure is 'the trainer' (read from pyproject.toml, so moves follow)."""
EXTRA_FILES = ("tests/gpu", "benchmarks/bench_logprobs.py", "benchmarks/bench_trainer_overhead.py")
"""Code that runs on the GPU machine besides the trainer's modules."""


def trainer_files() -> list[Path]:
    """Our source files the trainer and sft entry points import, plus the GPU tests and benchmarks."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name in ENTRY_POINTS:
        importlib.import_module(scripts[name].split(":")[0])
    files = {Path(m.__file__) for n, m in list(sys.modules.items()) if n.startswith("prime_rl") and m.__file__}
    for extra in EXTRA_FILES:
        path = ROOT / extra
        files |= set(path.rglob("*.py")) if path.is_dir() else {path}
    return sorted(files)


def _dotted(node: ast.AST) -> list[str] | None:
    """`a.b.c` as ['a', 'b', 'c']; None if the chain has anything but names and attributes (a call, a subscript)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def scan(source: str) -> tuple[set[str], set[str]]:
    """(dotted torch names the code uses, every attribute name it reads off anything)."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    refs: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    aliases[a.asname or "torch"] = a.name if a.asname else "torch"
                    refs.add(a.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            if node.level == 0:
                for a in node.names:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    refs.add(f"{node.module}.{a.name}")
    attributes: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            attributes.add(node.attr)
            parts = _dotted(node)
            if parts and parts[0] in aliases:
                refs.add(".".join([aliases[parts[0]], *parts[1:]]))
    return refs, attributes


def resolve(dotted: str) -> bool:
    """Whether `dotted` names something in the installed torch: the longest importable module, then attributes."""
    parts = dotted.split(".")
    obj, i = None, len(parts)
    while i > 0:
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            i -= 1
    if obj is None:
        return False
    for name in parts[i:]:
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def parent(dotted: str) -> str:
    return dotted.rpartition(".")[0]


def used() -> tuple[set[str], set[str]]:
    refs, attributes = set(), set()
    for path in trainer_files():
        r, a = scan(path.read_text())
        refs |= r
        attributes |= a
    return refs, attributes


def dump(out: Path) -> None:
    import torch

    refs, _ = used()
    modules = {parent(r) for r in refs if parent(r)} | {r for r in refs if not parent(r)}
    module_dirs = {}
    for name in sorted(modules):
        try:
            module_dirs[name] = sorted(dir(importlib.import_module(name)))
        except ImportError:
            pass  # a class or function path (`torch.Tensor.foo`): its parent is not a module
    found = {r: resolve(r) for r in refs}
    record = {
        "torch": torch.__version__,
        "present": sorted(r for r, ok in found.items() if ok),
        "missing": sorted(r for r, ok in found.items() if not ok),
        "module_dirs": module_dirs,
        "tensor": sorted(dir(torch.Tensor)),
        "module": sorted(dir(torch.nn.Module)),
    }
    out.write_text(json.dumps(record, indent=0) + "\n")
    print(f"torch {torch.__version__}: {len(record['present'])} names present, missing: {record['missing'] or 'none'}")


def problems(record: dict) -> list[str]:
    """What the code uses that the recorded torch lacks or cannot vouch for."""
    import torch

    refs, attributes = used()
    present, missing, dirs = set(record["present"]), set(record["missing"]), record["module_dirs"]
    found = []
    for ref in sorted(refs):
        if ref in present:
            continue
        if ref in missing:
            found.append(f"{ref}: not in torch {record['torch']}")
        elif parent(ref) in dirs:
            if ref.rpartition(".")[2] not in dirs[parent(ref)]:
                found.append(f"{ref}: not in torch {record['torch']}")
        else:
            found.append(f"{ref}: torch {record['torch']} was not asked about it; refresh the record on a GPU run")
    for kind, ours, theirs in (
        ("torch.Tensor", set(dir(torch.Tensor)), set(record["tensor"])),
        ("torch.nn.Module", set(dir(torch.nn.Module)), set(record["module"])),
    ):
        for name in sorted((ours - theirs) & attributes):
            found.append(f"{kind}.{name}: used as an attribute, and new after torch {record['torch']}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["dump", "check"])
    parser.add_argument("--out", type=Path, help="dump: where to write the record")
    parser.add_argument("--api", type=Path, default=ROOT / "scripts/gpu/torch-2.11-api.json", help="check: the record")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    if args.mode == "dump":
        dump(args.out)
        return
    found = problems(json.loads(args.api.read_text()))
    for line in found:
        print(line)
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
