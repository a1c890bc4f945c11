"""Wrapped code is unwrapped (``service.normalize``: ``tag_wrapper``, ``json_wrapper``, ``indent``), valid code is not.

The issue's inputs: ``<code>\\nprint('hi')\\n</code>`` (a SyntaxError at line 1 before) and ``{"code": "print('hi')"}``
(a dict expression that did nothing before) both print ``hi``; then the kind (tags of any name, text around them, JSON
objects with other keys and a tool call's envelope, a script indented as a whole), what is never touched, hostile
input, and two jobs through ``POST /execute``.
"""

from __future__ import annotations

import json
import textwrap
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.normalize import compiles, normalize
from tests.bfcl_corruption import bytecode
from tests.unit.test_normalize import PROPERTY, run, valid_scripts


def kinds(script: str) -> list[str]:
    return [r.kind for r in normalize(script).repairs]


@pytest.mark.parametrize(
    ("script", "kind"), [("<code>\nprint('hi')\n</code>", "tag_wrapper"), ('{"code": "print(\'hi\')"}', "json_wrapper")]
)
def test_the_issue_inputs_run_the_code_inside(script: str, kind: str) -> None:
    result = normalize(script)
    assert [r.kind for r in result.repairs] == [kind], result
    assert run(result.script) == "hi\n"
    assert result.original == script and all(r.detail for r in result.repairs)


@pytest.mark.parametrize(
    ("script", "expected_kinds", "printed"),
    [
        ("<python>print('hi')</python>", ["tag_wrapper"], "hi\n"),
        ("<execute>\nx = 2\nprint(x * 3)\n</execute>\n", ["tag_wrapper"], "6\n"),
        ('<code lang="python">\nprint(1 < 2 > 0)\n</code>', ["tag_wrapper"], "True\n"),
        ("<tool_call><code>print('nested')</code></tool_call>", ["tag_wrapper"], "nested\n"),
        ("<CODE>\nprint('case')\n</code>", ["tag_wrapper"], "case\n"),
        ("<code>print(3 &amp; 1, 1 &lt; 2)</code>", ["tag_wrapper"], "1 True\n"),
        ("<code>\nprint('</code>')\n</code>", ["tag_wrapper"], "</code>\n"),
        ("Here is the code:\n<code>\nprint('hi')\n</code>\nThis prints hi", ["tag_wrapper"], "hi\n"),
        ("Sure! Running it now: <execute>print('inline')</execute> Done.", ["tag_wrapper"], "inline\n"),
        ("<code>\n```python\nprint('fenced')\n```\n</code>", ["fence"], "fenced\n"),  # the tags are text around it
        ("```xml\n<code>print('tagged')</code>\n```", ["tag_wrapper"], "tagged\n"),  # the fences are text around
        # one repair that keeps the program beats two that change it (a string's "\\n" is not a line break)
        ('  x = "\\\\n"\n  print(repr(x))', ["indent"], "'\\\\n'\n"),
        ("<code>import sys\\nprint(sys.version_info > (3,))</code>", ["tag_wrapper", "literal_escapes"], "True\n"),
        ("<execute>\n    for i in range(2):\n        print(i)\n</execute>", ["tag_wrapper", "indent"], "0\n1\n"),
        ('{"script": "print(\'hi\')"}', ["json_wrapper"], "hi\n"),
        ('{"python": "x = 1\\nprint(x + 1)"}', ["json_wrapper"], "2\n"),
        ("{'code': 'print(\"single quotes\")'}", ["json_wrapper"], "single quotes\n"),
        ('{"language": "python", "code": "print(\'hi\')", "timeout": 30}', ["json_wrapper"], "hi\n"),
        ('{"code": "print(\'\\u00e9\\ud83d\\ude00\\/\')"}', ["json_wrapper"], "é😀/\n"),
        ('{"name": "execute_python", "arguments": {"code": "print(\'call\')"}}', ["json_wrapper"], "call\n"),
        ('{"name": "run", "arguments": "{\\"code\\": \\"print(7)\\"}"}', ["json_wrapper"], "7\n"),
        ('{"type": "tool_use", "id": "t1", "input": {"script": "print(8)"}}', ["json_wrapper"], "8\n"),
        ('I will call the tool:\n{"code": "print(\'hi\')"}\nThat prints hi.', ["json_wrapper"], "hi\n"),
        ('```json\n{"code": "print(\'hi\')"}\n```', ["fence", "json_wrapper"], "hi\n"),
        ('{"code": "```python\\nprint(\'hi\')\\n```"}', ["json_wrapper", "fence"], "hi\n"),
        (" print('one space')", ["indent"], "one space\n"),
        ("\tprint('one tab')", ["indent"], "one tab\n"),
        ("    x = 1\n    if x:\n        print(x)\n", ["indent"], "1\n"),
        ('  s = """a\n  b"""\n  print(repr(s))', ["indent"], "'a\\nb'\n"),  # the string was indented with it
        ("  # a comment at its own depth\n    print(3)\n", ["indent"], "3\n"),
    ],
)
def test_wrapped_code_runs(script: str, expected_kinds: list[str], printed: str) -> None:
    result = normalize(script)
    assert [r.kind for r in result.repairs] == expected_kinds, result
    assert compiles(result.script) and run(result.script) == printed


def test_the_repair_says_what_was_removed() -> None:
    (tag,) = normalize("Here it is:\n<execute lang='py'><code>\nprint(1)\n</code></execute>\nDone.").repairs
    assert tag.detail == (
        "ran the content of the tags <execute lang='py'><code>...</code></execute>; "
        "2 line(s) of text around them dropped"
    )
    (call,) = normalize('{"name": "python", "arguments": {"code": "print(1)"}}').repairs
    assert call.detail == (
        "ran the string field 'arguments' -> 'code' of the JSON object sent as the script; its other fields dropped: "
        "'name'"
    )
    (indent,) = normalize("   print(1)").repairs
    assert indent.detail == "removed the indentation common to every line (3 space(s))"


@PROPERTY
@given(
    valid_scripts(),
    st.sampled_from(
        [
            lambda s: f"<code>\n{s}\n</code>",
            lambda s: f"Here is the code:\n<execute>\n{s}</execute>\nIt prints the values.",
            lambda s: json.dumps({"code": s}),
            lambda s: json.dumps({"name": "execute", "arguments": json.dumps({"script": s})}),
            lambda s: textwrap.indent(s, "  "),
        ]
    ),
)
def test_wrapped_valid_scripts_run_their_exact_program(script: str, wrap: Any) -> None:
    wrapped = wrap(script)
    result = normalize(wrapped)
    assert result.repairs, wrapped
    assert bytecode(result.script) == bytecode(script), (wrapped, result)


@pytest.mark.parametrize(
    "script",
    [
        'd = {"code": "print(1)"}',  # a dict assigned to a name
        'print({"code": "print(1)"})',
        '{"code": "print(1)"}\nprint(2)',  # more than the dict
        '{"code": "print(1)"}; print(2)',
        '{"a": 1, "b": "print(1)"}',  # no code-like field
        '{"code": "this does not compile"}',  # the field does not compile
        '{"code": "pwd"}',  # a lone name: not a script
        '{"code": 1}',
        '{"code": "print(1)", "script": "print(2)"}',  # two code-like fields: which one is a guess
        '{"code": "print(1)", "tests": ["assert True"]}',  # another field that is not a plain value
        '{"name": "a", "arguments": {"code": "print(1)"}, "input": {"code": "print(2)"}}',
        's = "```python\\nprint(1)\\n```"',  # a string that contains a fence
        'html = "<code>print(1)</code>"\nprint(html)',
        "y = 0\nprint(1 <y> 2)",  # comparisons, not tags
        "if True:\n    print(1)\n",
        "# a comment\nprint(1)\n",
    ],
)
def test_valid_python_that_does_something_is_never_touched(script: str) -> None:
    assert compiles(script)
    result = normalize(script)
    assert result.script is script and not result.repairs


@pytest.mark.parametrize(
    "script",
    [
        "<code>print(1)</code>\nand then\n<code>print(2)</code>",  # two tagged blocks
        "x = compute()\n<code>print(1)</code>",  # code outside the tags
        "<code>print(1)</code>\nprint(2)",
        "<code>\nthis does not compile\n</code>",
        "<code>print(1)",  # no closing tag
        'Here:\n{"code": "print(1)"}\nprint(2)',  # code after the JSON object
        '{"code": "print(1)"',  # not closed
        'print("<b>x</b>)',  # a broken string holding tags: their content is a lone name, no script
        "<code>42</code>",
    ],
)
def test_what_is_not_only_a_wrapper_is_not_guessed(script: str) -> None:
    assert not compiles(script)
    result = normalize(script)
    assert result.script is script and not result.repairs


@PROPERTY
@given(
    st.lists(st.sampled_from([*"ab1 =()<>/{}:,\n\"'", "code", "print(1)", "<code>", "</code>"]), max_size=30).map(
        "".join
    )
)
def test_compiling_text_is_untouched_unless_a_bare_code_dict_and_any_repair_compiles(text: str) -> None:
    result = normalize(text)
    if result.repairs:
        assert compiles(result.script)
        assert not compiles(text) or result.repairs[0].kind == "json_wrapper", result
    else:
        assert result.script is text


@pytest.mark.parametrize(
    "script", ["<code>\nthis does not compile\n</code>", "<code>print(1)</code>\nand then\n<code>print(2)</code>"]
)
def test_tags_that_are_not_unwrapped_get_a_hint(script: str) -> None:
    result = normalize(script)
    assert not result.repairs and result.hint is not None and "wrapped in <code> tags" in result.hint


NESTED = "<a>" * 7000 + "print(1)" + "</a>" * 7000  # 56 KB, under the 64 KiB examined


@pytest.mark.parametrize(
    "text",
    [
        "<a>" * 17000 + "print(1)" + "</a>" * 17000,  # 100+ KB: over the limit, run as sent
        NESTED,
        "<a>" * 16000 + "x",
        "<a " * 20000,
        "<" + "a" * 60000,
        "<a>" * 8000 + "</b>" * 8000,
        "<a>\n" * 12000 + "</a>",
        "x\n" * 100 + "<a>" + "y " * 20000 + "</a>",
        "{" * 30000,
        '{"code": ' * 7000 + '"print(1)"' + "}" * 7000,
        '{"arguments": ' * 6000 + "1" + "}" * 6000,
        "\n{" * 30000,
        " " * 60000 + "print(1)",
        ("  x = (\n" * 5000)[:60000],
    ],
)
def test_hostile_wrappers_are_handled_in_linear_time(text: str) -> None:
    started = time.perf_counter()
    normalize(text)
    elapsed = time.perf_counter() - started
    assert elapsed < 2.0, elapsed  # generous (noisy shared machine): each takes a few ms to ~100 ms here


def test_deeply_nested_tags_under_the_limit_are_peeled() -> None:
    result = normalize(NESTED)
    assert result.script == "print(1)" and kinds(NESTED) == ["tag_wrapper"]
