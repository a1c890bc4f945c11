"""Script normalization (``service.normalize``): properties, each repair, refusals and hints; then via /execute."""

from __future__ import annotations

import contextlib
import io
import shlex
import time
import typing
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.normalize import KINDS, NORMALIZATIONS, compiles, normalize, with_hint
from service.schemas.job_models import ScriptRepair
from tests.bfcl_corruption import bytecode

_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)


_RAW_SAFE = st.text(st.sampled_from(list("ab \\dnt{}'\"é")), max_size=8).filter(
    lambda s: not s.endswith("\\") and "'" not in s.replace("\\'", "") and "\\'" not in s
)


@st.composite
def _literal(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["repr", "raw", "fstring", "bytes", "triple", "number", "escapes"]))
    if kind == "repr":
        return repr(draw(_TEXT))
    if kind == "raw":
        return "r'" + draw(_RAW_SAFE) + "'"
    if kind == "fstring":
        text = repr(draw(_TEXT)).replace("{", "{{").replace("}", "}}")
        return "f" + text[:-1] + "{x!r:>3}" + text[-1]
    if kind == "bytes":
        return repr(draw(_TEXT).encode())
    if kind == "triple":  # a multi-line string with real line breaks (its \n escapes, if any, give the same value)
        body = draw(st.lists(st.text(st.sampled_from(list("ab c'\"\t")), max_size=6), min_size=1, max_size=3))
        return '"""' + "\n".join(body).replace('"', "'") + 'x"""'
    if kind == "escapes":
        return draw(st.sampled_from(['"a\\nb"', "'tab\\there'", '"q\\"uote"', "'back\\\\'", '"\\\\n"', "'\\r\\n'"]))
    return str(draw(st.integers(-(10**6), 10**6)))


@st.composite
def _statement(draw: st.DrawFn, depth: int = 0) -> list[str]:
    kind = draw(st.sampled_from(["assign", "print", "if", "def", "for", "comment"] if depth < 2 else ["assign"]))
    if kind == "assign":
        return [f"x = {draw(_literal())}"]
    if kind == "print":
        return [f"print({draw(_literal())}, {draw(_literal())}, sep={draw(_literal())})"]
    if kind == "comment":
        text = draw(st.text(st.sampled_from(list("ab '\"#é:")), max_size=10))
        return [f"# {text}", f"y = {draw(_literal())}  # {text}"]
    head = {"if": "if x:", "def": "def f(a=1):", "for": "for i in range(2):"}[kind]
    body = [line for _ in range(draw(st.integers(1, 2))) for line in draw(_statement(depth + 1))]
    return [head] + ["    " + line for line in body] + (["    return a"] if kind == "def" else [])


@st.composite
def valid_scripts(draw: st.DrawFn) -> str:
    """Valid scripts without backslash continuations, of statements made of every kind of string literal.

    The first line is no comment: a one-line script starting with one is a comment as a whole, which compiles
    (and is then left alone, as every compiling script is). Raw triple-quoted strings are not generated: in one
    written on one line, ``\\n`` is taken for a line break (docs/normalization.md).
    """
    lines = ["x = 0"]
    for _ in range(draw(st.integers(1, 5))):
        lines += draw(_statement())
    return "\n".join(lines) + ("\n" if draw(st.booleans()) else "")


def escaped(script: str) -> str:
    """The research's corruption: every real line break written as the two characters ``\\n``."""
    return script.replace("\n", "\\n")


def fenced(script: str) -> str:
    return f"Here is the script:\n\n```python\n{script.rstrip()}\n```\n\nIt prints the values."


def shell_single(script: str) -> str:
    return f"python3 -c {shlex.quote(script)}"


def shell_double(script: str) -> str:
    quoted = "".join("\\" + c if c in '\\"$`' else c for c in script)
    return f'python -c "{quoted}"'


def heredoc(script: str) -> str:
    return f"python3 - <<'EOF'\n{script.rstrip()}\nEOF\n"


CORRUPTIONS = [escaped, fenced, shell_single, shell_double, heredoc]


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(valid_scripts())
def test_a_compiling_script_is_returned_byte_for_byte(script: str) -> None:
    result = normalize(script)
    assert result.script is script and not result.repairs and result.hint is None


@PROPERTY
@given(st.text(st.sampled_from(list("ab1 =()\n\t\\'\"#:`~r\ufeff\r")), max_size=40))
def test_any_text_that_compiles_is_untouched_and_any_repair_compiles(text: str) -> None:
    result = normalize(text)
    if compiles(text):
        assert result.script is text and not result.repairs
    else:
        assert compiles(result.script) if result.repairs else result.script is text


@PROPERTY
@given(valid_scripts(), st.sampled_from(CORRUPTIONS))
def test_corrupted_forms_normalize_to_the_same_bytecode(script: str, corruption: Any) -> None:
    damaged = corruption(script)
    result = normalize(damaged)
    assert bytecode(result.script) == bytecode(script), (damaged, result)
    if damaged != script and not compiles(damaged):
        assert result.repairs


LITERALS = r'''import json
x = 41
print("a\nb", 'tab\there', "q\"uote", 'it\'s')
print("ends with a backslash\\")
print('C:\\new\\table\\')
print(r"raw \n stays \t two chars", r'\d+\s*')
print(f"{x + 1:>5}\t|{'inner'!r}|\n--")
print(rb"\x00", b"\x00\n")
print("""multi
line
string""")
print(json.dumps({"k": "v\n"}))
'''


def run(script: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(script, "<script>", "exec", dont_inherit=True), {"__name__": "__main__"})
    return out.getvalue()


@pytest.mark.parametrize("corruption", [*CORRUPTIONS, lambda s: fenced(escaped(s)), lambda s: "\ufeff" + s])
def test_string_literals_survive_every_repair(corruption: Any) -> None:
    result = normalize(corruption(LITERALS))
    assert result.repairs
    assert run(result.script) == run(LITERALS)


def test_a_twice_escaped_script_is_decoded_as_one_string() -> None:
    damaged = LITERALS.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    result = normalize(damaged)
    assert [r.kind for r in result.repairs] == ["literal_escapes"]
    assert run(result.script) == run(LITERALS)


@pytest.mark.parametrize(
    ("damaged", "kinds", "expected"),
    [
        ("\ufeffprint(1)\n", ["bom"], "print(1)\n"),
        ("```python\r\nprint(1)\r\n```\r\n", ["crlf", "fence"], "print(1)\n"),
        ("~~~\nprint(1)\n~~~\n", ["fence"], "print(1)\n"),
        ("1. Run:\n   ```python\n   if 1:\n       print(1)\n   ```\n", ["fence"], "if 1:\n    print(1)\n"),
        ("```python\nprint(1)\n", ["fence"], "print(1)\n"),  # no closing fence
        ("```python\\nimport sys\\nprint(1)\\n```", ["fence", "literal_escapes"], "import sys\nprint(1)"),
        ("$ python3 -c 'print(1)'", ["shell_wrapper"], "print(1)"),
        ("python3 -c $'print(1)\\nprint(\\'a\\\\nb\\')'", ["shell_wrapper"], "print(1)\nprint('a\\nb')"),
        ("python3 -c 'import sys\\nprint(1)'", ["shell_wrapper", "literal_escapes"], "import sys\nprint(1)"),
        ('execute(command="python3 -c \'print("hi")\'")', ["shell_wrapper"], 'print("hi")'),
        ("python3 - <<EOF\nprint('\\$x', \"a\\nb\")\nEOF\n", ["shell_wrapper"], "print('$x', \"a\\nb\")\n"),
        ("cat <<'PY' | python3 -\nprint(1)\nPY\n", ["shell_wrapper"], "print(1)\n"),
        (
            "python3 - <<'EOF'\\nimport sys\\nprint(1)\\nEOF",
            ["shell_wrapper", "literal_escapes"],
            "import sys\nprint(1)",
        ),
        ("if 1:\n\tx = 1\n        y = 2\n", ["tabs"], "if 1:\n        x = 1\n        y = 2\n"),
        ("def f():\\n\\treturn 1\\nprint(f())", ["literal_escapes"], "def f():\n\treturn 1\nprint(f())"),
        ("x = 1 + \\\\n2\\nprint(x)", ["literal_escapes"], "x = 1 + \\\n2\nprint(x)"),
        ("s = '''a\\nb'''\\nprint(s)", ["literal_escapes"], "s = '''a\nb'''\nprint(s)"),
    ],
)
def test_each_repair(damaged: str, kinds: list[str], expected: str) -> None:
    result = normalize(damaged)
    assert [r.kind for r in result.repairs] == kinds, result
    assert result.script == expected
    assert all(r.detail for r in result.repairs)


@pytest.mark.parametrize(
    ("damaged", "hint"),
    [
        ("```python\nprint(1)\n```\nand\n```python\nprint(2)\n```\n", "2 Markdown fenced code blocks"),
        ("```python\\nprint(1)\\n```\\n```\\nprint(2)\\n```", "2 Markdown fenced code blocks"),
        ("x = compute()\n```python\nprint(1)\n```\n", "code outside it too"),
        ("Here is the script that does it:\nprint(1)\n", "starts with text, not Python"),
        ("python3 - <<EOF\nprint('$HOME')\nEOF\n", "heredoc"),
        ('python -c "print(`date`)"', "shell command"),
        ("import sys\\nprint(sys.argv[)", "two characters \\n"),
        ("print('abc)\n", "unbalanced quotes"),
        ("print('a\\nb'\nx = 1\n", None),  # a \n inside a string is no literal line break
        ("if x:\n    if y:\n        a = 1\n\tb = 2\n", "tabs and spaces"),  # tab 8: inner block; 4: outer
    ],
)
def test_what_is_not_guessed_gets_a_hint(damaged: str, hint: str | None) -> None:
    result = normalize(damaged)
    assert result.script is damaged and not result.repairs
    assert result.hint == hint if hint is None else result.hint is not None and hint in result.hint, result.hint


def test_the_hint_goes_only_to_a_syntax_error() -> None:
    result = normalize("```\nprint(1)\n```\n```\nprint(2)\n```\n")
    syntax = {"type": "SyntaxError", "message": "invalid syntax", "line": 1}
    assert with_hint(syntax, result) == {**syntax, "hint": result.hint}
    assert with_hint({"type": "NameError", "message": "x"}, result) == {"type": "NameError", "message": "x"}
    assert with_hint(syntax, None) == syntax


def test_kinds_are_the_schema_kinds_and_repairs_are_counted() -> None:
    assert set(KINDS) == set(typing.get_args(ScriptRepair.model_fields["kind"].annotation))
    before = NORMALIZATIONS.labels(kind="fence")._value.get()
    from service.normalize import count

    count(normalize("```\nprint(1)\n```"))
    assert NORMALIZATIONS.labels(kind="fence")._value.get() == before + 1


@pytest.mark.parametrize(
    "text",
    ["```" + "a" * 20000 + " b" * 5000 + "`", "A" + ", ," * 10000 + "#", "x = 1\\n" * 9000, "```\\n" * 10000],
)
def test_long_hostile_input_is_handled_in_linear_time(text: str) -> None:
    started = time.perf_counter()
    normalize(text)
    assert time.perf_counter() - started < 2.0  # the first two took 23 s and more with backtracking regexes


def test_a_script_over_the_size_limit_is_not_examined() -> None:
    script = "```python\nprint(1)\n```\n" + "#" * (64 * 1024)
    assert normalize(script).script is script and normalize(script).hint is None
