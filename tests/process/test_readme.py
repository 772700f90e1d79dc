"""The README and docs/ as written: their Python examples run, their `kvtier` commands parse,
every path they name exists, and the README stays short — so none of it can rot."""

from __future__ import annotations

import re
import shlex
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [
    README,
    ROOT / "RELIABILITY.md",
    ROOT / "SECURITY.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
README_MAX_LINES = 250
# A path in backquotes that names a file or directory of the repository.
REPO_PATH = re.compile(r"`((?:src|tests|bench|docs|requirements|dashboards|\.ci)/[\w./-]*[\w/])`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move detail to docs/"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_and_link_a_page_names_exists(doc: Path) -> None:
    text = doc.read_text()
    named = [m.group(1) for m in REPO_PATH.finditer(text)]
    missing = [p for p in named if not (ROOT / p).exists()]
    links = [m.group(1) for m in LINK.finditer(text) if not m.group(1).startswith("http")]
    missing += [p for p in links if not (doc.parent / p).exists()]
    assert not missing, f"{doc.name} names paths that are not in the repository: {missing}"


def _kvtier_commands(text: str) -> list[str]:
    """Every ``kvtier ...`` command line of the page's bash blocks (continuations joined,
    comments and what follows ``&&`` / ``|`` dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in re.split(r"&&|\|\||;|\|", line.split(" #")[0]):
                part = part.strip()
                if part.startswith("kvtier "):
                    commands.append(part)
    return commands


def _subparser(parser, words: list[str]):
    """The parser of the subcommand ``words`` start with (``bench copy``), and the rest."""
    import argparse

    while words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or words[0] not in subs[0].choices:
            break
        parser, words = subs[0].choices[words[0]], words[1:]
    return parser


def test_every_option_the_docs_name_exists() -> None:
    """Every `--option` in a `kvtier ...` mention (tables and prose too) is one its command
    takes: a renamed or removed option fails here, not in a reader's terminal."""
    from kvtier.ops.cli import _bench_parser, build_parser

    unknown = []
    for doc in DOCS:
        for span in re.findall(r"`(kvtier [^`]+)`", doc.read_text()):
            words = re.findall(r"[a-z][\w-]*", span.split("--")[0])[1:]
            if words[:1] == ["bench"] and len(words) > 1:  # a benchmark's own options
                parser = _bench_parser(words[1])
            else:
                parser = _subparser(build_parser(), words)
            known = set(parser._option_string_actions)
            unknown += [
                (doc.name, span, f) for f in re.findall(r"--[a-z][\w-]*", span) if f not in known
            ]
    assert not unknown, unknown


def test_every_kvtier_command_in_the_docs_parses() -> None:
    from kvtier.ops.cli import build_parser

    commands = [c for doc in DOCS for c in _kvtier_commands(doc.read_text())]
    assert commands, "no kvtier command found in the docs"
    for command in commands:
        argv = shlex.split(command)[1:]
        try:
            args, extra = build_parser().parse_known_args(argv)
        except SystemExit as e:
            raise AssertionError(f"{command!r} does not parse (exit {e.code})") from None
        # as `kvtier` itself: options it does not know are an error (serve passes some on)
        assert not extra or getattr(args, "takes_extra", False), (command, extra)


def test_readme_python_examples_run() -> None:
    blocks = [
        block for doc in DOCS for block in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)
    ]
    assert blocks, "the docs have no python example"
    for code in blocks:
        if "not run by tests/process/test_readme.py" in code:
            continue
        # A unique instance id, so a parallel run or a live engine never collides with the example.
        unique = uuid.uuid4().hex[:8]
        code = code.replace("kvtier-myengine-", f"kvtier-readme{unique}-")
        code = code.replace('"readme-tp"', f'"readme{unique}"')
        exec(compile(code, str(README), "exec"), {})


def test_ci_runs_the_readmes_test_command() -> None:
    """Command 2 of the README is what .ci/run runs (quiet flags aside): both stay true."""
    text = README.read_text()
    command = next(
        line
        for line in text.splitlines()
        if line.startswith("pip install torch") and "pytest" in line
    )
    ci = (README.parent / ".ci" / "run").read_text()
    ran = next(
        line for line in ci.splitlines() if line.startswith("pip install") and "pytest" in line
    )
    assert ran.replace(" -q", "") == command
