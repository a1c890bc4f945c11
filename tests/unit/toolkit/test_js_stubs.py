"""The ``tools.mjs`` module of a JavaScript or TypeScript script (``service.toolkit.js_stubs``): its exports, its
literals, and the byte-bounded cache of modules."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from service.toolkit import js_stubs
from service.toolkit.js_stubs import MAKE_TOOLS, exported_names, javascript_module
from tests.conftest import missing


def test_exports_are_identifiers_that_are_neither_reserved_nor_broken_paths() -> None:
    names = ["get_weather", "get-user", "math.factorial", "math.gcd", "class", "then", "a..b", ".c", MAKE_TOOLS, "$x"]
    assert exported_names(names) == ["get_weather", "math", "$x"]


def test_every_name_is_a_json_string_literal_and_the_module_loads(tmp_path: Path) -> None:
    names = ['q"uote', "back\\slash", "line\u2028sep", "lone\ud800", "</script>", "makeTools", "then"]
    module = javascript_module(names)
    assert json.dumps(names, ensure_ascii=True)[1:-1] in module
    if shutil.which("node") is None:
        missing("no node on this host (deploy/local.sh test installs Debian's nodejs)")
    runtime = Path(__file__).resolve().parents[3] / "sandbox_image" / "ptc_runtime" / "js" / "tools.mjs"
    (tmp_path / "tools.mjs").write_text(module.replace(js_stubs.RUNTIME_MODULE, str(runtime)), encoding="utf-8")
    probe = "const m = await import('./tools.mjs'); console.log(JSON.stringify(Object.keys(m.default)))"
    ran = subprocess.run(["node", "--input-type=module", "-e", probe], cwd=tmp_path, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert set(json.loads(ran.stdout)) == {n for n in names if n != "then"}


def test_the_cache_keeps_modules_within_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(js_stubs, "CACHED_MODULES_CHARS", 2000)
    monkeypatch.setattr(js_stubs, "_modules", type(js_stubs._modules)())
    monkeypatch.setattr(js_stubs, "_modules_chars", 0)
    first = javascript_module([f"tool_{i}" for i in range(10)])
    assert javascript_module([f"tool_{i}" for i in range(10)]) is first  # kept
    for round_ in range(20):
        javascript_module([f"other_{round_}_{i}" for i in range(10)])
    assert js_stubs._modules_chars <= 2000 and sum(map(len, js_stubs._modules.values())) == js_stubs._modules_chars
    huge = javascript_module([f"t{i}" for i in range(500)])
    assert len(huge) > 2000 and tuple(f"t{i}" for i in range(500)) not in js_stubs._modules
