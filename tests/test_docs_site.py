"""The documentation site (docs/, mkdocs.yml): its examples run, it builds strictly, its
reference covers the public API, and in Chromium every page opens offline with no error,
no picture missing and no dead link.

How a page's code blocks run (the rules docs/index.md's contributors follow):

- Every ```` ```python ```` (or ``py``/``pycon``) block of a page runs, top to bottom, in one
  namespace per page, in a fresh temporary working directory. Blocks in other languages
  (``bash``, ``console``, ``text``) are shown, never run.
- A block whose first line starts with ``>>>`` is a doctest: its outputs are checked, with
  the README's option flags (NORMALIZE_WHITESPACE, ELLIPSIS, NUMBER).
- Any other block is executed as a script. markdown-exec blocks
  (```` ```python exec="on" session="PAGE" source="above" ````) run when the site is built
  (their output goes into the page; the build is strict, so one that raises fails it, naming
  the page). They must run in the docs install (``make docs``: NumPy, matplotlib,
  safetensors, tokenizers, gguf, jinja2, MiniLM, SmolLM2; never torch), as the build runs
  them. A page made only of such blocks is checked by the build alone; on a page that mixes
  them with other Python blocks, they run here again, in order, to give the others their
  names.
- A page whose blocks need more than the docs install says so in its front matter,
  ``needs: [torch, transformers]`` (import names), and in its text; the page is skipped,
  naming what is missing, where those packages are not installed.
- A block that truly cannot run here (a ``torchrun`` launch) carries the class ``no-run``:
  ```` ```python {.no-run} ````. Keep these rare.
"""

from __future__ import annotations

import doctest
import functools
import html
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
import zlib
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from _pytest import doctest as _pytest_doctest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))

# What every page may use: the docs install (make docs).
DOCS_INSTALL = ("mkdocs", "material", "mkdocstrings", "markdown_exec", "matplotlib",
                "safetensors", "tokenizers", "gguf", "jinja2")
# The modules whose __all__ the reference covers.
REFERENCE_MODULES = ("attnlab", "attnlab.models", "attnlab.inspect", "attnlab.nn", "attnlab.sweep")
# The README's doctest flags (pyproject.toml); NUMBER and its output checker are pytest's.
DOCTEST_FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS | _pytest_doctest._get_number_flag()

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")


# ---- a page's code blocks ---------------------------------------------------------------------
def front_matter(text: str) -> dict:
    """The page's YAML front matter (between the first two ``---`` lines), or {}."""
    m = re.match(r"---\n(.*?)\n---\n", text, re.S)
    if not m:
        return {}
    import yaml

    return yaml.safe_load(m.group(1)) or {}


def code_blocks(text: str) -> list[dict]:
    """The fenced blocks of a Markdown page: language, attributes, classes, the fence's line
    (from 1) and the source."""
    blocks = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group("indent"), m.group("fence"), m.group("info").strip()
        start = i + 1
        j = start
        while j < len(lines) and not re.match(rf"^{re.escape(indent)}{fence[0]}{{{len(fence)},}}\s*$", lines[j]):
            j += 1
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip()
                         for line in lines[start:j])
        braces = re.search(r"\{(.*)\}", info)
        classes = re.findall(r"\.([\w-]+)", braces.group(1)) if braces else []
        attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', info))
        lang = re.sub(r"\{.*\}", "", info).split()[0] if re.sub(r"\{.*\}", "", info).split() else ""
        if not lang and classes:
            lang = classes.pop(0)
        blocks.append({"lang": lang.lower(), "attrs": attrs, "classes": classes, "line": start,
                       "source": body})
        i = j + 1
    return blocks


def runnable(block: dict) -> bool:
    return block["lang"] in ("python", "py", "pycon") and "no-run" not in block["classes"]


def missing_for(page: str) -> list[str]:
    needs = list(DOCS_INSTALL) + list(front_matter((DOCS / page).read_text(encoding="utf-8")).get("needs", []))
    return [m for m in needs if importlib.util.find_spec(m) is None]


def run_block(block: dict, namespace: dict, page: str) -> None:
    """Run one block in ``namespace``; a failure names the page and the block's line."""
    where = f"docs/{page}, the block at line {block['line']}"
    source = block["source"]
    if source.lstrip().startswith(">>>"):
        if block["attrs"].get("exec") == "on":  # markdown-exec's pycon: run the prompts' code
            code = "\n".join(line[4:] for line in source.split("\n") if line[:4] in (">>> ", "... "))
            exec(compile(code, where, "exec"), namespace)
            return
        test = doctest.DocTestParser().get_doctest(source, namespace, where, f"docs/{page}", block["line"])
        test.globs = namespace  # DocTest copies its globals; the page's blocks share one namespace
        out: list[str] = []
        runner = doctest.DocTestRunner(checker=_pytest_doctest._get_checker(), optionflags=DOCTEST_FLAGS)
        runner.run(test, out=out.append, clear_globs=False)
        if runner.failures:
            pytest.fail(f"{where}: a doctest failed\n" + "".join(out), pytrace=False)
        return
    exec(compile(source, where, "exec"), namespace)


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run(page, tmp_path, monkeypatch, request):
    """Every Python block of the page runs, top to bottom, in one namespace. A page whose
    blocks are all markdown-exec blocks ran them in the site's build (the ``site`` fixture,
    strict: a block that raises fails it), so they are not run a second time."""
    missing = missing_for(page)
    if missing:
        pytest.skip(f"docs/{page}'s examples need {', '.join(missing)}")
    blocks = [b for b in code_blocks((DOCS / page).read_text(encoding="utf-8")) if runnable(b)]
    if blocks and all(b["attrs"].get("exec") == "on" for b in blocks):
        request.getfixturevalue("site")
        return
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace: dict = {"__name__": "docs_" + re.sub(r"\W", "_", page)}
    for block in blocks:
        run_block(block, namespace, page)
    try:  # the pictures a page drew stay out of the next page's way
        import matplotlib.pyplot as plt

        plt.close("all")
    except ImportError:
        pass


def test_code_blocks_are_read_as_written():
    """The block reader finds markdown-exec blocks, doctests, shell blocks and no-run blocks."""
    text = "\n".join([
        "---", "needs: [torch]", "---", "# A page", "",
        '```python exec="on" session="p" source="above"', "x = 1", "```", "",
        "```bash", "make docs", "```", "",
        "```python {.no-run}", "launch()", "```", "",
        "- a list item:", "", "    ```pycon", "    >>> x + 1", "    2", "    ```",
    ])
    blocks = code_blocks(text)
    assert [(b["lang"], b["line"]) for b in blocks] == [("python", 6), ("bash", 10), ("python", 14), ("pycon", 20)]
    assert blocks[0]["attrs"] == {"exec": "on", "session": "p", "source": "above"}
    assert [runnable(b) for b in blocks] == [True, False, False, True]
    assert blocks[3]["source"] == ">>> x + 1\n2"
    namespace: dict = {}
    run_block(blocks[0], namespace, "a.md")
    run_block(blocks[3], namespace, "a.md")
    assert namespace["x"] == 1
    with pytest.raises(pytest.fail.Exception, match=r"docs/a.md, the block at line 20"):
        run_block({**blocks[3], "source": ">>> x + 1\n3"}, namespace, "a.md")


# ---- the build -------------------------------------------------------------------------------
def _mkdocs_or_skip():
    tools = ("mkdocs", "material", "mkdocstrings", "markdown_exec")
    missing = [m for m in tools if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the site's build needs {', '.join(missing)} (pip install -e '.[docs]')")


def mkdocs_build(config: Path, site: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "MPLBACKEND": "Agg"}
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else src
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)


BUILD: dict = {}


def build_site(tmp_path_factory) -> Path:
    """The site, built with ``mkdocs build --strict`` (once per run: the ``site`` fixture of
    conftest.py calls this)."""
    _mkdocs_or_skip()
    out = tmp_path_factory.mktemp("site") / "site"
    start = time.perf_counter()
    done = mkdocs_build(ROOT / "mkdocs.yml", out, ROOT)
    BUILD["seconds"] = time.perf_counter() - start
    if done.returncode != 0:
        problems = [line for line in done.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
        pytest.fail("the documentation site does not build:\n" + "\n".join(problems or done.stderr.splitlines()[-30:]),
                    pytrace=False)
    return out


def test_site_builds(site):
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html") if p.name != "404.html")
    print(f"\nsite: {len(pages)} pages built in {BUILD['seconds']:.1f} s")
    assert pages == sorted(p[:-3] + ".html" for p in PAGES)
    assert (site / "search" / "search_index.json").stat().st_size > 10_000


def test_a_broken_page_fails_the_build_and_is_named(tmp_path):
    """A failing example, a missing picture, a dead link and a dead anchor each fail the
    build (with mkdocs.yml's own validation settings and hooks), and the output names the page."""
    _mkdocs_or_skip()
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[the other page](other.md)\n")
    (docs / "other.md").write_text("# Other\n\n## A section\n")
    broken = {
        "failing-example.md": '# Failing\n\n```python exec="on"\nraise ValueError("boom")\n```\n',
        "missing-picture.md": "# Picture\n\n![a picture](images/not-there.png)\n",
        "dead-link.md": "# Link\n\n[gone](not-there.md)\n",
        "dead-anchor.md": "# Anchor\n\n[gone](other.md#no-such-section)\n",
    }
    for name, text in broken.items():
        (docs / name).write_text(text)
    config.update(docs_dir=str(docs), nav=["index.md", "other.md", *broken],
                  hooks=[str(ROOT / h) for h in config["hooks"]],
                  plugins=[p for p in config["plugins"] if p in ("search", "markdown-exec")])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site", tmp_path)
    assert done.returncode != 0
    warnings = [line for line in done.stderr.splitlines() if line.startswith("WARNING")]
    for name in broken:
        assert any(f"'{name}'" in line for line in warnings), (name, warnings)
    assert not any(f"Doc file '{good}'" in line for line in warnings for good in ("index.md", "other.md")), warnings


# ---- the reference -----------------------------------------------------------------------------
def inventory(site: Path) -> dict[str, str]:
    """objects.inv (Sphinx's format, version 2): name -> (role, page#anchor) of the Python objects."""
    data = (site / "objects.inv").read_bytes()
    header_end = 0
    for _ in range(4):
        header_end = data.index(b"\n", header_end) + 1
    entries = {}
    for line in zlib.decompress(data[header_end:]).decode().splitlines():
        m = re.match(r"(\S+)\s+(py:\w+)\s+-?\d+\s+(\S+)\s+(.*)", line)
        if m:
            uri = m.group(3)
            entries[m.group(1)] = (m.group(2), uri[:-1] + m.group(1) if uri.endswith("$") else uri)
    return entries


def role(obj) -> str:
    """The inventory role an object's entry must have (a function documented as a module of
    the same name is the wrong entry)."""
    import inspect
    import types

    if isinstance(obj, types.ModuleType):
        return "py:module"
    if inspect.isclass(obj):
        return "py:class"
    if callable(obj):
        return "py:function"
    return "py:data"


def resolve(path: str):
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


def description(site: Path, uri: str) -> str:
    """The text of the entry at ``uri`` (page#anchor): its docstring as the site shows it."""
    page, anchor = uri.split("#")
    text = _page_html(site / page)
    start = text.index(f'id="{anchor}"')
    contents = text.index('class="doc doc-contents', start)
    end = text.find('class="doc doc-heading"', contents)
    body = text[contents:end if end != -1 else None]
    return html.unescape(re.sub(r"<[^>]+>", " ", " ".join(re.findall(r"<p>(.*?)</p>", body, re.S)))).strip()


@functools.cache
def _page_html(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_reference_covers_the_public_api(site):
    """Every name of attnlab's, attnlab.models', attnlab.inspect's and attnlab.nn's __all__
    has a reference entry (an object of objects.inv that is the same Python object) with a
    description, and the reference's examples show as code."""
    entries = inventory(site)
    documented: dict[tuple[int, str], str] = {}  # (id of the object, role) -> page#anchor
    for name, (kind, uri) in entries.items():
        if uri.startswith("reference/"):
            try:
                documented.setdefault((id(resolve(name)), kind), uri)
            except (ImportError, AttributeError):
                pass
    missing, empty = [], []
    for module_name in REFERENCE_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            uri = documented.get((id(obj), role(obj)))
            if uri is None:
                missing.append(f"{module_name}.{name}")
            elif len(description(site, uri)) < 20:
                empty.append(f"{module_name}.{name} ({uri})")
    assert not missing, f"no reference entry for {missing}"
    assert not empty, f"no description for {empty}"
    functional = _page_html(site / "reference" / "functional.html")
    assert '<span class="gp">&gt;&gt;&gt; </span>' in functional  # doctests shown as pycon code
    assert "<blockquote>" not in functional


def test_cli_reference_is_the_parser(site):
    """reference/cli.html holds every subcommand's --help, as the parser writes it now."""
    from attnlab.cli import COMMANDS, build_parser

    page = html.unescape(re.sub(r"<[^>]+>", "", _page_html(site / "reference" / "cli.html")))
    assert build_parser().format_usage().split()[1] == "attnlab"
    for name in COMMANDS:
        assert f"usage: attnlab {name}" in page, name


# ---- the site in Chromium ----------------------------------------------------------------------
class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def served(site):
    """The built site on http://127.0.0.1:PORT/."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def _ids(path: Path) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', _page_html(path)))


def test_every_page_in_chromium(site, served, tmp_path):
    """Every page opens with no console error, no request off 127.0.0.1, every picture
    loaded and every internal link (and anchor) resolving; a search finds the course's
    rotary embeddings. Screenshots of three pages go to tmp_path (or $ATTNLAB_DOCS_SCREENS)."""
    from browser import launch, sync_api_or_skip

    sync_api = sync_api_or_skip()
    host = urlsplit(served).netloc
    pages = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html") if p.name != "404.html")
    shots = Path(os.environ.get("ATTNLAB_DOCS_SCREENS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    figures = {"pages": 0, "requests": 0, "images": 0, "links": 0}
    outside, errors, broken_images, dead_links = [], [], [], []
    checked_links: set[str] = set()

    def route(r):
        figures["requests"] += 1
        if urlsplit(r.request.url).netloc == host:
            r.continue_()
        else:
            outside.append(r.request.url)
            r.abort()

    with sync_api.sync_playwright() as p:
        browser = launch(p)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        context.route("**/*", route)
        page = context.new_page()
        current = {"url": ""}
        page.on("console", lambda m: m.type == "error" and errors.append(f"{current['url']}: {m.text}"))
        page.on("pageerror", lambda e: errors.append(f"{current['url']}: {e}"))
        for name in pages:
            current["url"] = name
            page.goto(served + name, wait_until="load")
            figures["pages"] += 1
            images = page.eval_on_selector_all("img", "els => els.map(e => [e.src, e.complete, e.naturalWidth])")
            figures["images"] += len(images)
            broken_images += [f"{name}: {src}" for src, complete, width in images if not (complete and width > 0)]
            for href in page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)"):
                url = urlsplit(href)
                if url.scheme not in ("http", "https") or url.netloc != host:
                    continue
                target_key = url.path + "#" + url.fragment
                if target_key in checked_links:
                    continue
                checked_links.add(target_key)
                figures["links"] += 1
                target = site / unquote(url.path).lstrip("/")
                if target.is_dir():
                    target = target / "index.html"
                if not target.is_file():
                    dead_links.append(f"{name}: {href}")
                elif url.fragment and target.suffix == ".html" and unquote(url.fragment) not in _ids(target):
                    dead_links.append(f"{name}: {href} (no such anchor)")
        for name in ("index.html", "course/modern-decoder.html", "reference/functional.html"):
            page.goto(served + name, wait_until="load")
            page.screenshot(path=str(shots / (name.replace("/", "-")[:-5] + ".png")))

        # Search with Material's own box and index.
        current["url"] = "search"
        page.goto(served + "index.html", wait_until="load")
        page.click("input.md-search__input")           # the header's search box (wide screens)
        page.keyboard.type("rotary")
        page.wait_for_selector(".md-search-result__item a", timeout=20_000)
        found = page.eval_on_selector_all(".md-search-result__item a", "els => els.map(e => e.href)")
        browser.close()

    print(f"\nbrowser: {figures['pages']} pages opened, {figures['requests']} requests, "
          f"{figures['images']} images, {figures['links']} internal links checked; "
          f"search 'rotary': {len(found)} results")
    assert figures["pages"] == len(PAGES)
    assert not outside, f"requests that leave the machine: {outside[:10]}"
    assert not errors, errors[:10]
    assert not broken_images, broken_images
    assert not dead_links, dead_links[:20]
    assert figures["images"] > 0 and figures["links"] > 100
    assert any(urlsplit(u).path.endswith("/course/modern-decoder.html") for u in found), found
