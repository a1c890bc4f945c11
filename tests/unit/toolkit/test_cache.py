"""Manifest compiles: on threads of their own, one per key at a time, round-robin between keys, CPU-bounded.

Issue 11 review, fault 3: compiles shared the default executor, so eight large manifests of one key delayed
another key's ``/execute`` from 0.9 s to 39 s.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from service.errors import ManifestError
from service.toolkit import cache
from service.toolkit.cache import ManifestCache, compile_manifest
from service.toolkit.manifest import parse_tool
from service.toolkit.schema_checks import schema_problem

ECHO = {"kind": "echo"}


def _tool(name: str, description: str = "") -> dict[str, Any]:
    return {"name": name, "description": description, "parameters": {"type": "object"}, "endpoint": ECHO}


async def test_one_compile_per_key_at_a_time_and_other_keys_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    release, began = threading.Event(), threading.Event()
    started: list[str] = []
    running: dict[str, int] = {}
    most: dict[str, int] = {}
    lock = threading.Lock()

    def slow(entries: list[dict[str, Any]], toolset_id: str | None = None) -> Any:
        owner = entries[0]["name"].split("_")[0]
        with lock:
            started.append(entries[0]["name"])
            began.set()
            running[owner] = running.get(owner, 0) + 1
            most[owner] = max(most.get(owner, 0), running[owner])
        if owner == "alice":
            release.wait(30)
        with lock:
            running[owner] -= 1
        return compile_manifest(entries, toolset_id)

    monkeypatch.setattr(cache, "compile_manifest", slow)
    manifests = ManifestCache(b"k" * 32, threads=2, budget_s=60.0)
    try:
        alice = [asyncio.create_task(manifests.compile([_tool(f"alice_{i}")], "alice")) for i in range(4)]
        assert await asyncio.to_thread(began.wait, 20)
        bob = await asyncio.wait_for(manifests.compile([_tool("bob_0")], "bob"), 20)  # generous: it runs at once
        assert set(bob.tools) == {"bob_0"}
        assert started == ["alice_0", "bob_0"]  # alice's other three wait for her first; bob waits for none
        release.set()
        done = await asyncio.wait_for(asyncio.gather(*alice), 20)
        assert [set(m.tools) for m in done] == [{f"alice_{i}"} for i in range(4)]
        assert most == {"alice": 1, "bob": 1}
    finally:
        release.set()
        manifests.close()


async def test_keys_are_served_round_robin(monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    gate, began = threading.Event(), threading.Event()

    def record(entries: list[dict[str, Any]], toolset_id: str | None = None) -> Any:
        order.append(entries[0]["name"])
        began.set()
        gate.wait(30)
        return compile_manifest(entries, toolset_id)

    monkeypatch.setattr(cache, "compile_manifest", record)
    manifests = ManifestCache(b"k" * 32, threads=1, budget_s=60.0)
    try:
        first = asyncio.create_task(manifests.compile([_tool("alice_0")], "alice"))
        assert await asyncio.to_thread(began.wait, 20)
        rest = [asyncio.create_task(manifests.compile([_tool(f"alice_{i}")], "alice")) for i in (1, 2)]
        await asyncio.sleep(0)
        rest.append(asyncio.create_task(manifests.compile([_tool("carol_0")], "carol")))
        await asyncio.sleep(0.05)
        gate.set()
        await asyncio.wait_for(asyncio.gather(first, *rest), 20)
        # carol joins the line behind alice (served, then back of the line): one more of alice's, then carol
        assert order == ["alice_0", "alice_1", "carol_0", "alice_2"]
    finally:
        gate.set()
        manifests.close()


async def test_a_compile_past_its_cpu_budget_is_a_manifest_error() -> None:
    tools = [  # distinct property schemas: each is checked against the metaschema (about 1 ms each)
        {
            "name": f"t{i}",
            "parameters": {
                "type": "object",
                "properties": {f"p{j}": {"type": "string", "pattern": f"^{i}-{j}$"} for j in range(25)},
            },
            "endpoint": ECHO,
        }
        for i in range(200)
    ]
    manifests = ManifestCache(b"k" * 32, threads=1, budget_s=0.05)
    try:
        with pytest.raises(ManifestError, match="CPU time") as caught:
            await manifests.compile(tools, "alice")
        assert caught.value.loc == ("body", "tools")
        small = await manifests.compile([_tool("ok")], "alice")  # the thread is usable after a refusal
        assert set(small.tools) == {"ok"}
    finally:
        manifests.close()


def test_a_property_schema_is_checked_once_and_its_problem_located() -> None:
    assert schema_problem({"type": "object", "properties": {"a": {"type": "string"}}}) is None
    assert schema_problem({"type": "object", "properties": {"a": {"type": 5}}}) == (
        "properties/a/type",
        schema_problem({"type": 5})[1],  # type: ignore[index]
    )
    with pytest.raises(ManifestError, match="at properties/a/minLength"):
        parse_tool(
            {"name": "t", "parameters": {"properties": {"a": {"minLength": -1}}}, "endpoint": ECHO}, ("tools", 0)
        )
    with pytest.raises(ManifestError, match="at minProperties"):  # the object around the properties
        parse_tool({"name": "t", "parameters": {"minProperties": "x"}, "endpoint": ECHO}, ("tools", 0))
