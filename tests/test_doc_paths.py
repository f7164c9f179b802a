"""Every repository path the docs and the code's comments name exists, so a pointer cannot go stale.

What counts as a path (anywhere in a .md file, in code blocks too; in a .py file only in comments and
docstrings, since code strings also build paths that do not exist yet):
  - text starting with a tracked top-level folder and a slash (`runtime/llm.py`, `docs/design/`),
    with `:LINE` dropped; `<name>` and an all-capitals word (`SUITE.sh`) are wildcards, `{a,b}`
    lists every form; `plugins/rope.apply_rope` is a module and a name that must occur in it;
  - a dotted infhip module (`infhip.runtime.llm`, `python -m infhip.builder.compile_matrix`),
    resolved through pyproject's package-dir, its first attribute looked up in its file;
  - a relative Markdown link, against the linking file's folder, with its `#anchor` (GitHub's slugs
    of the target's headings).
Not checked: a path right after `COMMIT:` (`git show ca16603:benchmarks/x.py` names an old tree),
`engines/...` (built engines, user-named output folders; only engines/README.md is
tracked), and the files under docs/results/ as sources: raw outputs and the history pages quote the
tree of their day (their dated paths are read, not kept current). Paths *into* docs/results/ are
checked like any other.
"""
import io
import re
import tokenize
import tomllib
from functools import cache
from pathlib import Path

from tests._repo_files import repo_files

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("docs", "runtime", "plugins", "builder", "infhip", "eval", "benchmarks", "tests", "examples", ".ci")
EXEMPT_SOURCES = ("docs/results/",)

PATH = re.compile(r"(?<![\w./:-])(?:%s)/(?:[\w.*-]|<[\w-]+>|\{[^{}\n]*\})*" % "|".join(map(re.escape, TOPS)))
DOTTED = re.compile(r"(?<![\w./-])infhip(?:\.[A-Za-z_]\w*)+")
LINK = re.compile(r"\]\(([^()\s]+)\)")
PLACEHOLDER = re.compile(r"(?<![\w.])(?!README\b)[A-Z][A-Z0-9_]+(?![\w])")


def expand(token: str) -> list[str]:
    """`a/{b, c}.py` -> `a/b.py`, `a/c.py` (every brace list, in turn)."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [f for item in m.group(1).split(",") for f in expand(token[:m.start()] + item.strip() + token[m.end():])]


def _glob(pattern: str) -> bool:
    return any(ROOT.glob(pattern)) if "*" in pattern else (ROOT / pattern).exists()


def path_exists(path: str) -> bool:
    path = re.sub(r"<[\w-]+>", "*", path)
    if _glob(path):
        return True
    module = re.fullmatch(r"(.+?)\.([A-Za-z_]\w*)(?:\.\w+)*", path)  # plugins/rope.apply_rope
    if module and (ROOT / f"{module.group(1)}.py").is_file():
        return _names(ROOT / f"{module.group(1)}.py", module.group(2))
    wild = PLACEHOLDER.sub("*", path)
    return wild != path and _glob(wild)


def _names(file: Path, name: str) -> bool:
    """Whether the module's code (not its comments or docstrings, which may be what names it) has `name`."""
    return re.search(rf"\b{re.escape(name)}\b", _code(file)) is not None


@cache
def _code(file: Path) -> str:
    text = re.sub(r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'', "", file.read_text(encoding="utf-8"))
    return re.sub(r"#[^\n]*", "", text)


@cache
def package_dirs() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def module_file(module: str) -> Path | None:
    """The file of an infhip module or package (`__init__.py`), or None."""
    package = max((p for p in package_dirs() if module == p or module.startswith(p + ".")), key=len, default=None)
    if package is None:
        return None
    base = ROOT / package_dirs()[package] / module[len(package):].lstrip(".").replace(".", "/")
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file() and f != ROOT / package_dirs()[package] / ".py":
            return f
    return None


@cache
def logger_names() -> set[str]:
    """`infhip.access` and the like name a logger, not a module: those the code creates."""
    found = (re.findall(r'getLogger\("(infhip\.[\w.]+)"\)', (ROOT / p).read_text(encoding="utf-8"))
             for p in repo_files(".py"))
    return {name for names in found for name in names}


def module_exists(dotted: str) -> bool:
    if dotted in logger_names():
        return True
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if (f := module_file(".".join(parts[:i]))) is not None:
            return i == len(parts) or _names(f, parts[i])
    return False


def slugs(md: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file (code blocks skipped)."""
    out, fenced = set(), False
    for line in md.read_text(encoding="utf-8").splitlines():
        fenced ^= line.lstrip().startswith("```")
        if not fenced and (h := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            base = re.sub(r"[^\w\- ]", "", h.group(1).lower()).replace(" ", "-")
            slug, n = base, 0
            while slug in out:
                n += 1
                slug = f"{base}-{n}"
            out.add(slug)
    return out


def link_problem(source: Path, target: str) -> str | None:
    if re.match(r"[a-z]+:", target):  # https:, mailto:
        return None
    file, _, anchor = target.partition("#")
    dest = (source.parent / file).resolve() if file else source
    if not dest.is_relative_to(ROOT):
        return f"link {target} points outside the repository"
    if not dest.exists():
        return f"link {target}: no such file"
    if anchor and dest.suffix == ".md" and anchor not in slugs(dest):
        return f"link {target}: no heading with that anchor in {dest.relative_to(ROOT)}"
    return None


def text_problems(text: str) -> list[str]:
    """Stale paths and modules named in one piece of prose."""
    bad = [p for m in PATH.finditer(text) for p in expand(m.group(0).rstrip(".-")) if not path_exists(p)]
    return bad + [m.group(0) for m in DOTTED.finditer(text) if not module_exists(m.group(0))]


def markdown_problems(source: Path, text: str) -> list[str]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        out += [f"{n}: {p}" for p in text_problems(line)]
        prose = re.sub(r"`[^`]*`", "", line)  # `kernel[grid](...)` is code, not a link
        out += [f"{n}: {p}" for m in LINK.finditer(prose) if (p := link_problem(source, m.group(1)))]
    return out


def python_problems(src: str) -> list[str]:
    """Stale paths in comments and docstrings (a string that is a statement of its own)."""
    if not (PATH.search(src) or DOTTED.search(src)):
        return []
    out, prev = [], None  # prev: the last token other than a comment or a blank line's end
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        is_doc = tok.type == tokenize.STRING and prev in (None, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
        if tok.type == tokenize.COMMENT or is_doc:
            for k, line in enumerate(tok.string.splitlines()):
                out += [f"{tok.start[0] + k}: {p}" for p in text_problems(line)]
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            prev = tok.type
    return out


def test_every_path_named_in_docs_and_comments_exists():
    bad = []
    for rel in repo_files():
        if rel.startswith(EXEMPT_SOURCES):
            continue
        if rel.endswith(".md"):
            bad += [f"{rel}:{p}" for p in markdown_problems(ROOT / rel, (ROOT / rel).read_text(encoding="utf-8"))]
        elif rel.endswith(".py"):
            bad += [f"{rel}:{p}" for p in python_problems((ROOT / rel).read_text(encoding="utf-8"))]
    assert not bad, "stale pointers (path, module or link that does not exist):\n  " + "\n  ".join(bad)


def test_the_check_reads_what_it_should():
    assert text_problems("see `runtime/llm.py:12`, plugins/rope.py and docs/design/.") == []
    assert text_problems("runtime/{llm, engine_core}.py and tests/test_<x>_*.py, benchmarks/gpu/suites/SUITE.sh") == []
    assert text_problems("`runtime/no_such_file.py`, runtime/{llm, no_such}.py") == ["runtime/no_such_file.py", "runtime/no_such.py"]
    assert text_problems("plugins/paged_kv.no_such_name; infhip.runtime.no_such; infhip.methods.method.no_such") == [
        "plugins/paged_kv.no_such_name", "infhip.runtime.no_such", "infhip.methods.method.no_such"]
    assert text_problems("python -m infhip.builder.compile_matrix; infhip.methods.method.register; infhip.access") == []
    assert text_problems("git show ca16603:benchmarks/gone.py") == []
    doc = ROOT / "docs" / "design" / "adding.md"
    assert link_problem(doc, "../knobs.md#infinitehip-knobs") is None
    assert "anchor" in link_problem(doc, "../knobs.md#no-such-heading")
    assert "outside" in link_problem(doc, "../../../shared/SPEC.md")
    src = '"""Doc: runtime/gone.py."""\nx = "runtime/also_gone.py"  # runtime/gone_too.py, infhip.errors.gone\n'
    assert python_problems(src) == ["1: runtime/gone.py", "2: runtime/gone_too.py", "2: infhip.errors.gone"]
