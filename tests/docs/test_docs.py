"""The README and the documentation pages stay true: the site builds strictly, every Python
example runs on the bundled models (or, where it needs a download, still parses and names real
decoders and imports), every `mmgen` command line of the pages parses, and the benchmark tables
equal what their JSON gives."""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: The README and every page of the site: written for users, their examples run in the suite.
PAGES = [ROOT / "README.md"] + sorted(p for p in DOCS.glob("*.md"))
FENCE = re.compile(r"(?:<!-- skip: (?P<skip>.+?) -->\n)?```(?P<lang>[\w-]*)\n(?P<code>.*?)^```", re.S | re.M)


def blocks(page: Path, lang: str) -> list[tuple[int, str, str | None]]:
    """(line, code, skip reason or None) of each fenced block of `lang` in `page`."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start("code")) + 1, m["code"], m["skip"])
            for m in FENCE.finditer(text) if m["lang"] == lang]


def page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def test_fence_reader_sees_skips_and_languages():
    page = "<!-- skip: needs org/model -->\n```python\nx = 1\n```\ntext\n```bash\nmmgen --version\n```\n"
    found = [(m["lang"], m["code"], m["skip"]) for m in FENCE.finditer(page)]
    assert found == [("python", "x = 1\n", "needs org/model"), ("bash", "mmgen --version\n", None)]


def test_readme_is_a_short_start():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert "python -m pytest -q" in text
    for name in ("emoji64", "emoji-vlm", "speech-tts", "emoji-motion", "openai"):
        assert name in text, f"the README's quick start lacks {name}"
    for python in blocks(ROOT / "README.md", "python"):
        assert len(python[1].strip().splitlines()) <= 10, f"README.md:{python[0]}: a quick start is at most ten lines"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_user_pages_have_no_issue_numbers(page):
    text = page.read_text()
    found = re.findall(r"\bissues? \d+|\(#\d+\)|\bsession\b", text, re.I)
    assert not found, f"{page_id(page)} speaks of {found}: user docs speak to users"


@functools.lru_cache(maxsize=None)
def loaded(name, device=None, dtype=None):
    """`mmgen.load_pipeline`, once per model for all pages: the pages load the same bundled
    models, and their examples do not change a pipeline."""
    import mmgen.loading

    return mmgen.loading.load_pipeline(name, device, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if any(skip is None for _, _, skip in blocks(p, "python"))], ids=page_id)
def test_python_examples_run(page, tmp_path, monkeypatch):
    """Each page's unmarked Python blocks, in order, in one namespace, in an empty folder."""
    import mmgen

    runnable = [(line, code) for line, code, skip in blocks(page, "python") if skip is None]
    if any("speech-tts" in code for _, code in runnable) and shutil.which("espeak-ng") is None:
        pytest.skip("the bundled speech model reads phonemes through espeak-ng (apt-get install espeak-ng)")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(mmgen, "load_pipeline", loaded)
    namespace: dict = {"__name__": "__docs__"}
    for line, code in runnable:
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(code, f"{page_id(page)}:{line}", "exec"), namespace)
        except Exception as error:  # the page and line make the failure findable
            pytest.fail(f"{page_id(page)}:{line}: {type(error).__name__}: {error}")


def decoder_names() -> set[str]:
    from mmgen.decoding import FAMILY_DECODERS

    return {name for registry in FAMILY_DECODERS.values() for name in registry}


def check_skipped(page: Path, line: int, code: str, reason: str) -> None:
    """A block that cannot run here: it parses, its mmgen imports exist, its decoding specs name
    real decoders with well-formed options, and the model it needs appears in it."""
    from mmgen.decoding import parse_decoding

    where = f"{page_id(page)}:{line}"
    tree = ast.parse(code, where)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mmgen":
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{where}: {node.module} has no {alias.name}"
        if isinstance(node, ast.Call):
            specs = [k.value for k in node.keywords if k.arg == "decoding"]
            if getattr(node.func, "id", getattr(node.func, "attr", None)) == "make_decoder" and node.args:
                specs.append(node.args[0])
            for spec in specs:
                if isinstance(spec, ast.Constant) and isinstance(spec.value, str):
                    name, _ = parse_decoding(spec.value)
                    assert name in decoder_names(), f"{where}: unknown decoding {spec.value!r}"
    needed = re.fullmatch(r"needs (\S+)", reason)
    if needed:
        assert needed[1] in code, f"{where}: the block is marked as needing {needed[1]}, which it does not name"


SKIPPED = [(page, line, code, skip) for page in PAGES for line, code, skip in blocks(page, "python") if skip]


@pytest.mark.parametrize("page,line,code,reason", SKIPPED, ids=[f"{page_id(p)}:{n}" for p, n, _, _ in SKIPPED])
def test_skipped_examples_still_parse(page, line, code, reason):
    check_skipped(page, line, code, reason)


def test_skipped_check_catches_a_renamed_decoder():
    with pytest.raises(AssertionError, match="unknown decoding"):
        check_skipped(ROOT / "README.md", 1, 'pipe("x", decoding="jacobi:window=8")\n', "needs org/model")
    with pytest.raises(AssertionError, match="has no"):
        check_skipped(ROOT / "README.md", 1, "from mmgen.decoding import NoSuchDecoder\n", "needs org/model")


def command_lines(page: Path) -> list[tuple[int, list[str]]]:
    """The `mmgen ...` commands of a page's bash blocks, continuation lines joined, as argv."""
    found = []
    for line, code, _ in blocks(page, "bash"):
        for offset, command in enumerate(code.replace("\\\n", " ").splitlines()):
            argv = shlex.split(command, comments=True)
            while argv and "=" in argv[0] and not argv[0].startswith("-"):
                argv = argv[1:]  # VAR=value prefixes
            if argv and argv[0] == "mmgen":
                found.append((line + offset, argv[1:]))
    return found


COMMANDS = [(page, line, argv) for page in PAGES for line, argv in command_lines(page)]


@pytest.mark.parametrize("page,line,argv", COMMANDS, ids=[f"{page_id(p)}:{n}" for p, n, _ in COMMANDS])
def test_command_lines_parse(page, line, argv):
    from mmgen.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as stop:
        assert stop.code == 0, f"{page_id(page)}:{line}: mmgen {shlex.join(argv)}: {err.getvalue().strip()}"


def test_version_flag_prints_the_installed_version(capsys):
    from mmgen.cli import build_parser

    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"mmgen {metadata.version('mmgen')}"


def make_tables():
    spec = importlib.util.spec_from_file_location("make_tables", DOCS / "make_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_tables_equal_their_json():
    tables = make_tables()
    page = (DOCS / "benchmarks.md").read_text()
    assert set(re.findall(r"<!-- table: ([\w-]+) -->", page)) == set(tables.TABLES), "every generated table is on the page"
    assert tables.stale(page) == [], "run python docs/make_tables.py"
    assert len(page.splitlines()) <= 400


def test_table_check_catches_an_edited_figure():
    tables = make_tables()
    page = tables.render((DOCS / "benchmarks.md").read_text())
    edited = page.replace("| emoji64 | `ar` | 1.00 |", "| emoji64 | `ar` | 1.01 |", 1)
    assert edited != page and tables.stale(edited) == ["image-emoji64"]


def test_site_builds_strictly(tmp_path):
    """Broken links, missing API references and pages outside the nav fail the build."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip('mkdocs is not installed (pip install -e ".[docs]")')
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
