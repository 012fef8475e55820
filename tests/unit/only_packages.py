"""Run a module as `python -m` would, in an interpreter where only some installed packages can be imported.

    python tests/unit/only_packages.py ALLOWED_TOP_LEVEL_NAMES(comma-separated) -m module [args...]
    python tests/unit/only_packages.py ALLOWED_TOP_LEVEL_NAMES(comma-separated) -c code

Every other package looks uninstalled (its finder answers None, as on a machine without it), so both a plain
import and a probe such as `importlib.util.find_spec` see what a GPU machine with only torch, transformers and
our carried wheels would see (`test_trainer_packages.py`). The standard library is always allowed.
"""

import runpy
import sys


def hide_all_but(allowed: set[str]) -> None:
    def visible(name: str) -> bool:
        top = name.partition(".")[0]
        # _sysconfigdata_* is the interpreter's own build data, imported by sysconfig; not a package
        return top in sys.stdlib_module_names or top in allowed or top.startswith("_sysconfigdata")

    class Hide:
        def __init__(self, finder):
            self.finder = finder

        def find_spec(self, name, path=None, target=None):
            return self.finder.find_spec(name, path, target) if visible(name) else None

        def __getattr__(self, attr):
            return getattr(self.finder, attr)

    sys.meta_path[:] = [Hide(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]


if __name__ == "__main__":
    allowed, flag, target, *args = sys.argv[1:]
    hide_all_but(set(allowed.split(",")))
    sys.argv = [target, *args]
    if flag == "-c":
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
    else:
        assert flag == "-m", "usage: only_packages.py NAMES (-m module [args...] | -c code)"
        runpy.run_module(target, run_name="__main__", alter_sys=True)
