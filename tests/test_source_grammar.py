"""Every .py file in the repository parses under the oldest Python infhip supports: pyproject's
`requires-python`, which the README states too (both checked here).

`ast.parse(src, feature_version=(3, 11))` rejects newer syntax on the interpreter running the test,
except PEP 701's f-strings (Python 3.12): from 3.12 on the parser accepts them whatever
`feature_version` says. So on 3.12+ the f-strings are also checked token by token for what 3.11 cannot
read: a quote of an enclosing f-string reused inside a replacement field, a backslash or a comment in
one, a line break in a single-quoted one.
"""
import ast
import io
import re
import sys
import tokenize
import tomllib
from pathlib import Path

import pytest

from tests._repo_files import repo_files

ROOT = Path(__file__).resolve().parent.parent
_REQUIRES = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]  # ">=3.11"
OLDEST = tuple(int(x) for x in re.fullmatch(r">=\s*(\d+)\.(\d+)", _REQUIRES).groups())


def test_the_readme_states_the_oldest_python_pyproject_requires():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"Python {OLDEST[0]}.{OLDEST[1]}+" in readme, f"README should say Python {OLDEST[0]}.{OLDEST[1]}+ ({_REQUIRES})"


def _quote(token: str) -> str:
    """The opening delimiter of a string token: `"`, `'`, `\"\"\"` or `'''` (prefix letters dropped)."""
    body = token.lstrip("rRbBuUfF")
    return body[:3] if body[:3] in ('"""', "'''") else body[:1]


def fstring_problems(src: str) -> list[str]:
    """What Python 3.11 cannot read in the f-strings of `src` (needs Python 3.12's tokenizer).

    Returns one line per problem, "LINE: what". Tokens between FSTRING_START and FSTRING_END that are
    not FSTRING_MIDDLE are the replacement fields' expressions.
    """
    problems, enclosing = [], []  # enclosing: opening quotes of the f-strings we are inside
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        kind, line = tok.type, tok.start[0]
        if kind == tokenize.FSTRING_END:
            enclosing.pop()
            continue
        if enclosing and kind != tokenize.FSTRING_MIDDLE:
            if kind in (tokenize.STRING, tokenize.FSTRING_START):
                quote = _quote(tok.string)
                if any(quote.startswith(q) for q in enclosing):
                    problems.append(f"{line}: quote {quote} of an enclosing f-string reused inside it")
                if "\\" in tok.string:
                    problems.append(f"{line}: backslash inside an f-string's replacement field")
            elif kind == tokenize.COMMENT:
                problems.append(f"{line}: comment inside an f-string's replacement field")
            elif kind == tokenize.NL and len(enclosing[-1]) == 1:
                problems.append(f"{line}: line break inside a single-quoted f-string")
        if kind == tokenize.FSTRING_START:
            enclosing.append(_quote(tok.string))
    return problems


def grammar_problems(path: Path) -> list[str]:
    src = path.read_text(encoding="utf-8")
    try:
        ast.parse(src, str(path), feature_version=OLDEST)
    except SyntaxError as e:
        return [f"{e.lineno}: {e.msg}"]
    return fstring_problems(src) if sys.version_info >= (3, 12) else []


def test_every_python_file_parses_under_the_oldest_supported_python():
    files = [ROOT / p for p in repo_files(".py")]
    assert len(files) > 100, f"found only {len(files)} .py files: is git there?"
    bad = {str(p.relative_to(ROOT)): probs for p in files if (probs := grammar_problems(p))}
    assert not bad, f"not Python {OLDEST[0]}.{OLDEST[1]} syntax:\n" + "\n".join(
        f"  {f}:{p}" for f, probs in bad.items() for p in probs)


@pytest.mark.parametrize("src, ok", [
    ('x = f"{d[\'k\']:>{w}}"\n', True),
    ('x = f"""{d["k"]}"""\n', True),
    ('x = f"{f\'{y}\'}"\n', True),
    ('x = f"{d["k"]}"\n', False),           # quote reuse (PEP 701)
    ('x = f"{\'\\n\'.join(v)}"\n', False),  # backslash in the expression
    ('x = f"{y # why\n}"\n', False),        # comment in the expression
])
def test_the_check_catches_312_only_fstrings(tmp_path, src, ok):
    path = tmp_path / "case.py"
    path.write_text(src)
    assert (not grammar_problems(path)) == ok, grammar_problems(path)
