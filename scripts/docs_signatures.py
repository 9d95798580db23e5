"""The optimizers' signatures in docs/optimizers.md, taken from the classes, not retyped.

Each bold code span ``**`fastoptim.<Optimizer>(...)`**`` (or ``**`fastoptim.<Optimizer>`**``) of the
page is replaced by the class's ``inspect.signature``, without annotations, its floats written
shortly (``1e-3``, not ``0.001``) and wrapped to the page's width. Three uses:

- ``.venv/bin/python scripts/docs_signatures.py`` rewrites the page's signatures in place (after an
  optimizer's signature changed); ``--check`` only says whether they are current (exit status 1 if not).
- tests/test_docs_signatures.py fails when the page's signatures differ from the classes'.
- mkdocs.yml names this file as a hook: the built page shows the classes' signatures whatever the
  source says, and a stale source is a warning (so ``make docs``, which is strict, fails).
"""
import inspect
import logging
import re
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent / "docs" / "optimizers.md"
OPTIMIZERS = ("Adan", "AdamW", "AdamWSN", "RMSPropSN", "Lion", "Muon")
WIDTH = 105  # the page's longest prose lines
SPAN = re.compile(r"\*\*`fastoptim\.(" + "|".join(OPTIMIZERS) + r")(\([^`]*\))?`\*\*")
_SPAN_AND_PROSE = re.compile(SPAN.pattern + r"(?P<rest>[ \t]+(?=\S))?")  # rest: spaces before prose on its line


def _number(value):
    """A float as the docs write it: 1e-3, 1e-8, 0.95, 0.0 (the shortest text that is the same float)."""
    if value == 0 or 1e-2 <= abs(value) < 1e4:
        return repr(value)
    for digits in range(17):
        text = f"{value:.{digits}e}"
        if float(text) == value:
            mantissa, exponent = text.split("e")
            return f"{mantissa}e{int(exponent)}"
    return repr(value)


def _value(value):
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, tuple):
        inner = ", ".join(_value(item) for item in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(_value(item) for item in value) + "]"
    return repr(value)


def parameters(cls):
    """The constructor's parameters as the docs write them: ``name=default``, ``*``, ``**options``."""
    out, keyword_only = [], False
    for param in inspect.signature(cls).parameters.values():
        if param.kind is param.KEYWORD_ONLY and not keyword_only:
            out.append("*")
            keyword_only = True
        if param.kind is param.VAR_POSITIONAL:
            out.append("*" + param.name)
            keyword_only = True
        elif param.kind is param.VAR_KEYWORD:
            out.append("**" + param.name)
        elif param.default is param.empty:
            out.append(param.name)
        else:
            out.append(f"{param.name}={_value(param.default)}")
    return out


def signature(name, column=0, indent=2):
    """``fastoptim.<name>(...)``, wrapped so that no line passes ``WIDTH`` when its first line starts at
    ``column`` and the next ones at ``indent``."""
    import fastoptim

    pieces = parameters(getattr(fastoptim, name))
    lines, line = [], f"fastoptim.{name}("
    for i, piece in enumerate(pieces):
        piece += ")" if i == len(pieces) - 1 else ","
        start = column if not lines else indent
        if line.strip() and start + len(line) + 1 + len(piece) + 3 > WIDTH and not line.endswith("("):
            lines.append(line)
            line = " " * indent + piece
        else:
            line += ("" if line.endswith("(") else " ") + piece
    return "\n".join(lines + [line])


def _indent(text, position):
    """The indent of the line holding ``position``, that of a list item's text where it starts one."""
    line = text[text.rfind("\n", 0, position) + 1:]
    stripped = line.lstrip()
    return len(line) - len(stripped) + (2 if stripped.startswith(("- ", "* ")) else 0)


def render(text):
    """``text`` with every optimizer's bold signature span made the class's signature; prose that
    followed a span on its line goes to the next line, so the span's last line keeps the width."""
    def replace(match):
        column = match.start() - (text.rfind("\n", 0, match.start()) + 1) + len("**`")
        indent = _indent(text, match.start())
        span = f"**`{signature(match.group(1), column, indent)}`**"
        return span + ("\n" + " " * indent if match.group("rest") else "")

    return _SPAN_AND_PROSE.sub(replace, text)


def stale(text):
    """The optimizers whose signature span in ``text`` is not the class's, and those with none."""
    found = {match.group(1): match.group(0) for match in SPAN.finditer(text)}
    rendered = {match.group(1): match.group(0) for match in SPAN.finditer(render(text))}
    return sorted(name for name in OPTIMIZERS if name not in found or found[name] != rendered[name])


def on_page_markdown(markdown, page, config, files):
    """mkdocs hook: the optimizers page shows the classes' signatures; a stale source is a warning."""
    if page.file.src_uri != "optimizers.md":
        return markdown
    wrong = stale(markdown)
    if wrong:
        logging.getLogger("mkdocs.plugins.docs_signatures").warning(
            "docs/optimizers.md: the signatures of %s differ from the classes'; "
            "run .venv/bin/python scripts/docs_signatures.py", ", ".join(wrong))
    return render(markdown)


def main(argv):
    text = PAGE.read_text()
    wrong = stale(text)
    if "--check" in argv:
        print("current" if not wrong else "stale: " + ", ".join(wrong))
        return 1 if wrong else 0
    missing = [name for name in OPTIMIZERS if not re.search(rf"\*\*`fastoptim\.{name}[(`]", text)]
    if missing:
        print("no signature span for " + ", ".join(missing) + " in " + str(PAGE), file=sys.stderr)
    if wrong:
        PAGE.write_text(render(text))
    print("rewrote " + ", ".join(wrong) if wrong else "current")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
