"""The docs against the code: README.md and docs/*.md.

- Every command in a fenced ```bash block (or a `$ ` line of a ```console block) that runs one of our entry points
  (`[project.scripts]` in pyproject.toml, with or without `uv run`; `torchrun ... -m prime_rl.<module>` too) parses
  against the real CLI: the entry point's own `main(argv + ["--dry-run"])`, in this process (the config loader
  parses, validates, prints the resolved TOML and exits 0 before anything starts). A console transcript must print
  what the doc shows. Commands with placeholders are listed in NOT_CHECKABLE with the reason.
- Every relative link points to an existing file, and an anchor to a heading of that file.
- The code map in docs/architecture.md ("Where the code is") names only paths that exist, and names every module
  under src/prime_rl/ (a .py file, or its package folder as `folder/`).
"""

from __future__ import annotations

import importlib
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "prime_rl"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]  # name -> "module:function"

# Doc commands that cannot be parsed as written, keyed by the command as written (continuations joined, comment and
# surrounding space removed), with the reason. An entry no doc holds any more fails the test (delete it).
NOT_CHECKABLE = {
    "uv run rl --trainer @ t.toml --orchestrator @ o.toml --inference @ i.toml --max-steps 20": "t.toml, o.toml "
    "and i.toml stand for your section files (configs/{trainer,orchestrator,inference}/tiny.toml are separate "
    "processes' configs and do not combine into one run: checkpoints on in one only, the server's URL spelled twice)",
    "uv run rl @ runs.toml": "runs.toml is the example TOML shown just above it",
    "uv run --no-group cpu --group gpu inference ...": "the GPU flags of uv, with any inference arguments",
    "uv run inference @ i.toml --headless --data-parallel-start-rank R ...": "vLLM's multi-node flags, values per node",
    "uv run inference @ my.toml": "the transcript's my.toml exists only in its comment (`[server] prot = 1`)",
    "uv run orchestrator @ run_c.toml --output-dir outputs/reverse-text/lora/run_c --adapter.name c "
    "--client.base-url '[\"http://127.0.0.1:8000/v1\"]'": "run_c.toml stands for the new run's own orchestrator config",
}
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|\s\[--")  # <name>, ..., [--optional flags]


@dataclass
class Block:
    doc: Path
    line: int  # of the opening fence
    lang: str
    lines: list[tuple[int, str]]


def blocks(doc: Path) -> list[Block]:
    """The fenced code blocks of a markdown file (fences may be indented, as inside a list item)."""
    found, current = [], None
    for n, raw in enumerate(doc.read_text().splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            if current is None:
                current = Block(doc, n, stripped[3:].strip(), [])
            else:
                found.append(current)
                current = None
        elif current is not None:
            current.lines.append((n, stripped))
    assert current is None, f"{doc.name}:{current.line}: unclosed code fence"
    return found


def prose(doc: Path, keep_code: bool = False) -> str:
    """The markdown outside fenced code blocks (as blank lines), and without inline code spans unless `keep_code`
    (links inside code are not links)."""
    text, out, fenced = doc.read_text(), [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else line if keep_code else re.sub(r"`[^`]*`", "``", line))
    return "\n".join(out)


@dataclass
class Command:
    where: str  # README.md:12
    text: str  # as written, continuations joined, comment removed
    argv: list[str]  # from the entry point's name on
    expected: str | None = None  # a console transcript's output


def logical_lines(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Join `\\`-continued lines; each result keeps the number of its first line."""
    out, start, buf = [], None, ""
    for n, text in lines:
        start = n if not buf else start
        if text.endswith("\\"):
            buf += text[:-1].rstrip() + " "
            continue
        out.append((start, buf + text))
        buf = ""
    return out


def entry_argv(tokens: list[str]) -> list[str] | None:
    """The tokens from our entry point's name on (a torchrun or `python -m` module counts as its entry point's
    name), or None if the command runs something else."""
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):  # VAR=value prefixes
        tokens = tokens[1:]
    if tokens[:2] == ["uv", "run"]:
        tokens = tokens[2:]
        while tokens and tokens[0].startswith("-"):  # uv's own flags: --no-sync, --no-group cpu, --group gpu
            tokens = tokens[2:] if tokens[0] in ("--group", "--no-group", "--with") else tokens[1:]
    if not tokens:
        return None
    if tokens[0] in SCRIPTS:
        return tokens
    if tokens[0] in ("torchrun", "python") and "-m" in tokens:
        i = tokens.index("-m")
        module = tokens[i + 1] if i + 1 < len(tokens) else ""
        names = [name for name, target in SCRIPTS.items() if target.split(":")[0] == module]
        if names:
            return [names[0], *tokens[i + 2 :]]
    return None


def strip_comment(text: str) -> str:
    """The command without its trailing `# comment` (a `#` inside quotes, or inside a word, stays)."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].strip()
    return text.strip()


def commands() -> list[Command]:
    found = []
    for doc in DOCS:
        for block in blocks(doc):
            name = doc.relative_to(ROOT)
            if block.lang in ("bash", "sh", "shell"):
                for n, text in logical_lines(block.lines):
                    text = strip_comment(text)
                    if text and (argv := entry_argv(shlex.split(text))) is not None:
                        found.append(Command(f"{name}:{n}", text, argv))
            elif block.lang == "console":
                lines = block.lines
                for i, (n, text) in enumerate(lines):
                    if not text.startswith("$ "):
                        continue
                    output = []
                    for _, out in lines[i + 1 :]:
                        if out.startswith("$ "):
                            break
                        output.append(out)
                    text = strip_comment(text[2:])
                    if (argv := entry_argv(shlex.split(text))) is not None:
                        found.append(Command(f"{name}:{n}", text, argv, "\n".join(output)))
    return found


def table_commands() -> list[Command]:
    """Tables whose header has a column "flags on top of `some.toml`" (docs/algorithms.md's comparison): each row's
    flags over that `rl` config."""
    found = []
    for doc in DOCS:
        base = None
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
            if cells is None:
                base = None
            elif m := re.search(r"flags on top of `([^`]+\.toml)`", line):
                base, column = m.group(1), next(i for i, c in enumerate(cells) if "flags on top of" in c)
            elif base and not set(line) <= set("|-: ") and (flags := cells[column].strip("`")):
                text = f"rl @ {base} {flags}"
                found.append(Command(f"{doc.relative_to(ROOT)}:{n}", text, shlex.split(text)))
    return found


def inline_commands() -> list[Command]:
    """`uv run <entry point> ...` in inline code outside fenced blocks (e.g. the README's demo table)."""
    found = []
    for doc in DOCS:
        for n, line in enumerate(prose(doc, keep_code=True).splitlines(), 1):
            for text in re.findall(r"`(uv run [^`]+)`", line):
                if (argv := entry_argv(shlex.split(text))) is not None:
                    found.append(Command(f"{doc.relative_to(ROOT)}:{n}", text, argv))
    return found


COMMANDS = commands() + table_commands() + inline_commands()


def test_the_docs_have_commands_and_unlabelled_blocks_hold_none():
    assert len(COMMANDS) > 20, [c.where for c in COMMANDS]
    for doc in DOCS:
        for block in blocks(doc):
            if block.lang == "":
                bad = [n for n, text in block.lines if text.startswith(("uv run ", "$ "))]
                assert not bad, f"{doc.name}:{bad[0]}: a command in an unlabelled block: label it ```bash or ```console"


def test_not_checkable_entries_are_still_in_the_docs():
    texts = {c.text for c in COMMANDS}
    assert not set(NOT_CHECKABLE) - texts, "NOT_CHECKABLE lists commands no doc holds: remove them"


@pytest.fixture
def repo_cwd(monkeypatch):
    """Commands run as from the repository root, with no PRIME_* (or seed) variables of this shell leaking in."""
    import os

    monkeypatch.chdir(ROOT)
    for name in list(os.environ):
        if name.startswith("PRIME_") or name in ("OUTPUT_DIR", "INFERENCE_SERVER_IP", "INFERENCE_SERVER_API_KEY"):
            monkeypatch.delenv(name)


def run_entry_point(argv: list[str], capsys) -> tuple[int, str]:
    """`main(argv)` of the named entry point, in this process; its exit code and what it printed."""
    module, function = SCRIPTS[argv[0]].split(":")
    main = getattr(importlib.import_module(module), function)
    capsys.readouterr()
    try:
        main(argv[1:])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out = capsys.readouterr()
    return code, (out.out + out.err).strip()


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_doc_command_parses(command: Command, repo_cwd, capsys):
    if command.text in NOT_CHECKABLE:
        pytest.skip(NOT_CHECKABLE[command.text])
    assert not PLACEHOLDER.search(command.text), (
        f"{command.where}: `{command.text}` has a placeholder: write it concretely or add it to NOT_CHECKABLE"
    )
    name, args = command.argv[0], command.argv[1:]
    if name == "report":  # no config and no --dry-run: one run directory, which exists only after a run
        assert len(args) == 1 and not args[0].startswith("-"), f"{command.where}: report takes one output_dir"
        return
    code, printed = run_entry_point([name, *args, "--dry-run"], capsys)
    if command.expected is not None:  # a transcript: the doc shows what it prints
        assert printed == command.expected.strip(), f"{command.where}: prints\n{printed}"
        assert code != 0 if "error" in command.expected else code == 0
        return
    assert code == 0, f"{command.where}: `{command.text}` does not parse:\n{printed[-2000:]}"


# ---------------------------------------------------------------------------------------------
# Links
# ---------------------------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lowercased, punctuation but `-` and `_` dropped, spaces to `-`."""
    fenced, names = False, set()
    for line in doc.read_text().splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*)", line)):
            names.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return names


def test_relative_links_point_to_existing_files_and_headings():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(prose(doc)):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


# ---------------------------------------------------------------------------------------------
# The code map
# ---------------------------------------------------------------------------------------------


def code_map_paths() -> list[str]:
    """The paths named in architecture.md's "Where the code is" table: code spans that look like a path."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Where the code is", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    spans = [s for row in rows for s in re.findall(r"`([^`]+)`", row.split("|")[2])]
    return [s for s in spans if re.fullmatch(r"[\w./-]+", s) and (s.endswith((".py", "/")))]


def test_code_map_names_existing_paths():
    paths = code_map_paths()
    assert paths
    missing = [p for p in paths if not (SRC / p).exists() and not (ROOT / p).exists()]
    assert not missing, f"docs/architecture.md's code map names paths that do not exist: {missing}"


def test_code_map_names_every_module():
    """Each .py file under src/prime_rl/ is named by its path or its folder's (`eval/`); `__init__.py` files only
    where a package has no other module."""
    named = {p.rstrip("/") for p in code_map_paths()}
    unnamed = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        if path.name == "__init__.py" and (rel.parent == Path(".") or len(list(path.parent.glob("*.py"))) > 1):
            continue
        module = rel.parent.as_posix() if path.name == "__init__.py" else rel.as_posix()
        if module not in named and rel.parent.as_posix() not in named:
            unnamed.append(module)
    assert not unnamed, f"modules under src/prime_rl/ that docs/architecture.md's code map does not name: {unnamed}"
