"""Load a script of the repository (a benchmark, a data builder) as a module, for tests of its pure parts."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(relative: str) -> ModuleType:
    """The script at `relative` (from the repository root), executed as a module named after its file; registered in
    `sys.modules` first, where dataclasses look their module up."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
