"""The docs point at what exists: every relative link in README.md, docs/ and benchmarks/RESULTS.md
resolves (files, images, #anchors), every repository path they name exists (and every
`tests/x.py::test_name` names a test there), every `fivefold.x.y` name and `from fivefold... import`
line resolves, every `python -m fivefold ...` / `fivefold ...` / `python benchmarks/...` command they
show answers -h with exit 0 (and the pure ones — validate, layout, schedule, estimate — run as shown), and no
file in the repository names a path of a development machine."""
from __future__ import annotations

import importlib
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "benchmarks" / "RESULTS.md"]

FENCED = re.compile(r"^(```|~~~)[^\n]*\n.*?^\1[ \t]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)
REPO_PATH = re.compile(r"(?<![\w./-])((?:fivefold|tests|docs|examples|benchmarks)/[\w./-]*\w\.(?:py|md|yaml|txt|csv|png|json))"
                       r"(?:::(\w+))?")
COMMAND = re.compile(r"python -m fivefold\b[^\n`#|]*|python benchmarks/[\w/.-]+\.py[^\n`#|]*"
                     rf"|(?:(?<=`)|^)fivefold (?:{'|'.join(COMMANDS)})\b[^\n`#|]*", re.M)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str) -> str:
    """The text outside code: fenced blocks and `inline code` removed (a link there is not a link)."""
    return INLINE_CODE.sub("", FENCED.sub("", text))


def _anchors(md: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to '-', repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for title in HEADING.findall(FENCED.sub("", md.read_text())):
        slug = re.sub(r"[^\w\- ]", "", re.sub(r"[`*_]|\[|\]|\(.*?\)", "", title).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_relative_links_resolve(doc):
    broken = []
    for target in LINK.findall(_prose(doc.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target} (no file {dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {_rel(dest)})")
    assert not broken, f"{_rel(doc)}: broken links: " + "; ".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_repository_paths_named_exist(doc):
    missing = []
    for path, test in REPO_PATH.findall(doc.read_text()):
        if not (ROOT / path).exists():
            missing.append(path)
        elif test and not re.search(rf"^\s*def {test}\(", (ROOT / path).read_text(), re.M):
            missing.append(f"{path}::{test}")
    assert not missing, f"{_rel(doc)} names what is not in the repository: {', '.join(sorted(set(missing)))}"


DOTTED = re.compile(r"`(fivefold(?:\.\w+)+)")
IMPORT = re.compile(r"^\s*from (fivefold[\w.]*) import ([\w, ]+)", re.M)


def _resolve(dotted: str) -> bool:
    """Whether `fivefold.a.b.c` is a module, or an attribute chain under the longest importable module."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=_rel)
def test_python_names_shown_exist(doc):
    """`fivefold.x.y` names in the text and `from fivefold.x import a, b` lines in its snippets."""
    text = doc.read_text()
    names = {n for n in DOTTED.findall(text) if not (ROOT / "examples" / n).exists()}  # `fivefold.yaml`: a file
    names |= {f"{module}.{name.strip()}" for module, names_ in IMPORT.findall(text) for name in names_.split(",")
              if name.strip()}
    missing = sorted(n for n in names if not _resolve(n))
    assert not missing, f"{_rel(doc)} names Python objects that do not exist: {', '.join(missing)}"


def _shown_commands() -> dict[tuple[str, ...], str]:
    """argv (after `python`) of every command the docs show (`fivefold X` as `python -m fivefold X`)
    -> where it is shown. A synopsis is cut at
    its first placeholder (`CONFIG`, `N`, `[...]`): what comes before it is the command."""
    out = {}
    for doc in DOCS:
        for match in COMMAND.finditer(doc.read_text().replace("\\\n", " ")):
            words = shlex.split(match.group(0))
            words = ["-m", *words] if words[0] == "fivefold" else words[1:]  # the `fivefold` script = python -m fivefold
            cut = next((i for i, w in enumerate(words) if w.startswith("[") or re.fullmatch(r"[A-Z][A-Z_]*", w)),
                       len(words))
            out.setdefault(tuple(words[:cut]), _rel(doc))
    return out


PURE_COMMANDS = ("validate", "layout", "schedule", "estimate")
"""Commands that start no process and take milliseconds: the docs' examples of them are run as shown
(without the options that write files), not only with -h."""
WRITES = ("--png", "--csv", "--plot")


def _runnable(argv: tuple[str, ...]) -> bool:
    return argv[:2] == ("-m", "fivefold") and len(argv) > 3 and argv[2] in PURE_COMMANDS \
        and not any(w.split("=")[0] in WRITES for w in argv)


# One interpreter runs every command in turn (torch and the benchmarks' imports are paid once):
# `-m fivefold ...` through runpy.run_module, `benchmarks/x.py ...` through runpy.run_path.
_DRIVER = r"""
import contextlib, io, json, os, runpy, sys
results = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    sys.argv = ["fivefold"] + argv[2:] if argv[0] == "-m" else argv[:]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if argv[0] == "-m":
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:  # as `python script.py` does: the script's folder first on sys.path (sibling imports)
                sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
                runpy.run_path(argv[0], run_name="__main__")
                sys.path.pop(0)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:
        code, _ = 1, out.write(f"{type(e).__name__}: {e}")
    text = out.getvalue()
    results.append([code, text.startswith("usage:"), text[-1500:]])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def command_results():
    """{(argv, with -h): (exit code, printed usage first, output tail)}, from one subprocess."""
    shown = _shown_commands()
    jobs = [(a, True) for a in shown] + [(a, False) for a in shown if _runnable(a)]
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps([list(a) + ["-h"] * h for a, h in jobs])],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return shown, dict(zip(jobs, json.loads(proc.stdout.strip().splitlines()[-1])))


def test_every_command_shown_answers_help(command_results):
    shown, results = command_results
    assert len(shown) > 20 and any(a[0] == "-m" for a in shown) and any(a[0].startswith("benchmarks/") for a in shown)
    failed = [f"python {' '.join(argv)} -h (shown in {shown[argv]}): exit {code}, help printed: {usage}\n{out}"
              for (argv, helped), (code, usage, out) in results.items() if helped and (code != 0 or not usage)]
    assert not failed, "\n\n".join(failed)


def test_pure_commands_shown_run_as_shown(command_results):
    shown, results = command_results
    ran = {argv: r for (argv, helped), r in results.items() if not helped}
    assert {a[2] for a in ran} == set(PURE_COMMANDS)
    failed = [f"python {' '.join(argv)} (shown in {shown[argv]}): exit {code}\n{out}"
              for argv, (code, _, out) in ran.items() if code != 0]
    assert not failed, "\n\n".join(failed)


DEV_PATH = re.compile("/" + "(?:work|tmp|root|home|Users)" + "/")
"""A path of a development machine (built from parts so that this file does not match itself)."""


def _repository_files() -> list[Path]:
    """The files git tracks; without git (an unpacked archive), every file but build and run outputs."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        return [ROOT / p for p in listed.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", "runs", "__pycache__", ".pytest_cache", ".hypothesis", ".venv", "venv"}
        return [p for p in ROOT.rglob("*") if p.is_file() and not skip & set(p.relative_to(ROOT).parts)
                and not any(part.endswith(".egg-info") for part in p.parts)]


def test_no_file_names_a_development_machine_path():
    offenders = []
    for path in _repository_files():
        if path == Path(__file__).resolve() or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary (images)
            continue
        for i, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if DEV_PATH.search(line):
                offenders.append(f"{_rel(path)}:{i}: {line.strip()[:120]}")
    assert not offenders, ("paths of a development machine (cite a repository-relative path, e.g. "
                           "docs/derivations/...):\n" + "\n".join(offenders))
