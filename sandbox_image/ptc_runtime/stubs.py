"""What the generated ``tools`` package is built on: the ``tool`` decorator.

The generator in the service writes one typed, documented function per tool
(its body is only the docstring) and decorates it with ``Toolbox.tool``. The
decorator replaces it with a stub that binds the call's arguments against
that signature, maps safe Python spellings back to the tool's original
parameter names, and sends the call to the broker. A name in the signature
always means that signature's parameter; a tool's original parameter name is
accepted as a keyword too when it is no name of the signature (``from`` for
``from_``). A call with one positional dict and no keywords, to a tool whose
first parameter cannot take an object (the generator's
``first_takes_object``), binds the dict's keys as the arguments, as if passed
by keyword, and says so to the broker (``"repair": "positional_dict"``, which
the call's record lists); else the dict is the first parameter's value, like
any positional argument. Only the arguments the
script actually passed are sent: defaults shown in the signature are the
tool's own and are applied by the tool, never invented by the stub. Missing
or unexpected arguments are not refused here but by the broker, so that every
attempted call has a record.

The synchronous stub lives where the function is defined (``tools.<name>``);
its awaitable twin is registered under the same path in ``tools.aio``.

``Toolbox.script_globals`` gives the names the runtime puts in the script's
global namespace (docs/tools-and-manifests.md, "Scripts and stubs"): each top-level tool as a
``GlobalStub``, which blocks and returns the result when called outside a
running event loop (``web_search(query=...)``) and returns a coroutine to
await when called in the thread of a running loop (``await web_search(...)``,
``asyncio.gather``), and each dotted namespace (``math.factorial``) as a
``Namespace`` of such stubs.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from ptc_runtime.client import ToolError, client

__all__ = ["CallableNamespace", "GlobalStub", "Namespace", "ToolError", "Toolbox"]

SIGNATURE_CAP = 600  # characters of the signature appended to an invalid_arguments ToolError


class Namespace:
    """An attribute container: ``tools.aio`` and its dotted sub-namespaces.

    A namespace that is also a tool (``auth`` beside ``auth.login``) holds that
    tool's stub as ``__call__`` in its instance dict, and calling it calls that.
    """

    def __init__(self, path: str) -> None:
        self.__path = path

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        own = vars(self).get("__call__")
        if own is None:
            raise TypeError(f"tools namespace {self.__path or 'aio'!r} is not a tool")
        return own(*args, **kwargs)

    def __repr__(self) -> str:
        names = sorted(k for k in vars(self) if not k.startswith("_"))
        return f"<tools namespace {self.__path or 'aio'}: {', '.join(names)}>"


class _Binder:
    """Turns ``(*args, **kwargs)`` into the tool's argument object (original names)."""

    def __init__(
        self, tool: str, fn: Callable[..., Any], renames: Dict[str, str], first_takes_object: bool = False
    ) -> None:
        self.tool = tool
        self.path = fn.__qualname__
        self.signature = inspect.signature(fn)
        self.renames = renames
        self.safe_for_original = {original: safe for safe, original in renames.items()}
        self.first_takes_object = first_takes_object

    def request(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """The broker request of a call: ``{"tool": name, "args": {...}}``, plus ``"repair": "positional_dict"``
        when a lone positional dict was bound as the arguments (see the module's docstring)."""
        if (
            len(args) == 1
            and not kwargs
            and isinstance(args[0], dict)
            and not self.first_takes_object
            and all(isinstance(key, str) for key in args[0])
        ):
            return {"tool": self.tool, "args": self.bind((), dict(args[0])), "repair": "positional_dict"}
        return {"tool": self.tool, "args": self.bind(args, kwargs)}

    def bind(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Dict[str, Any]:
        """The arguments object of ``(*args, **kwargs)``, with original names; a keyword that is neither a name of
        the signature nor an original name is forwarded as it is (the broker refuses it, with a record).

        Raises:
            TypeError: too many positional arguments, or one parameter given twice.
        """
        params = self.signature.parameters
        named: Dict[str, Any] = {}
        unknown: Dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in params:  # the signature's own name wins over an original name it happens to spell
                safe = key
            elif key in self.safe_for_original:
                safe = self.safe_for_original[key]
            else:
                unknown[key] = value
                continue
            if safe in named:
                raise TypeError(f"{self.tool}() got argument {key!r} twice")
            named[safe] = value
        bound = self.signature.bind_partial(*args, **named)
        result = {self.renames.get(k, k): v for k, v in bound.arguments.items()}
        result.update(unknown)  # forwarded so that the broker refuses them, with a record
        return result

    def explain(self, error: ToolError) -> ToolError:
        """``error`` with the stub's signature appended when the broker refused the arguments."""
        if error.type != "invalid_arguments":
            return error
        return ToolError(error.type, f"{error.message}; the stub is {self.signature_text()}", error.tool)

    def signature_text(self) -> str:
        """``tools.<path>(name: type = default, ...)``, as the generated module declares it (capped)."""
        parts = []
        for param in self.signature.parameters.values():
            text = param.name
            if param.annotation is not inspect.Parameter.empty:
                annotation = param.annotation
                text += ": " + (annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "Any"))
            if param.default is not inspect.Parameter.empty:
                text += " = " + repr(param.default)
            parts.append(text)
        text = "tools.%s(%s)" % (self.path, ", ".join(parts))
        return text if len(text) <= SIGNATURE_CAP else text[: SIGNATURE_CAP - 4] + "...)"


class _Stub:
    def __init__(self, binder: _Binder, fn: Callable[..., Any]) -> None:
        self._binder = binder
        self.__name__ = fn.__name__
        self.__qualname__ = fn.__qualname__
        self.__doc__ = fn.__doc__
        self.__signature__ = binder.signature
        self.__wrapped__ = fn

    def __repr__(self) -> str:
        return f"<tool {self._binder.tool}{self._binder.signature}>"


class SyncStub(_Stub):
    """``tools.<name>(...)``: blocks until the result; safe to call from many threads."""

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:  # self positional-only: a parameter may be named self
        binder = self._binder
        try:
            return client().request(binder.request(args, kwargs))
        except ToolError as exc:
            raise binder.explain(exc) from None


class AsyncStub(_Stub):
    """``await tools.aio.<name>(...)``: many may be in flight at once (``asyncio.gather``)."""

    async def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        binder = self._binder
        try:
            return await client().arequest(binder.request(args, kwargs))
        except ToolError as exc:
            raise binder.explain(exc) from None


class GlobalStub(_Stub):
    """A tool in the script's global namespace: ``web_search(...)`` and ``await web_search(...)`` alike.

    Called outside a running event loop (plain code, a thread of its own) it
    blocks and returns the result, like ``tools.<name>``; called in the thread
    of a running event loop (inside ``async def``, or at the top level of a
    script that uses top-level ``await``) it returns a coroutine, like
    ``tools.aio.<name>``, to await or pass to ``asyncio.gather`` /
    ``asyncio.create_task``. Such a coroutine sends nothing until it is awaited
    (Python warns "coroutine '<name>' was never awaited" otherwise); there,
    ``tools.<name>(...)`` is the blocking call.
    """

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        asyncio = sys.modules.get("asyncio")  # not imported: no loop can be running (and importing it costs ~20 ms)
        try:
            if asyncio is None:
                raise RuntimeError("no running event loop")
            asyncio.get_running_loop()
        except RuntimeError:  # no loop running in this thread: the blocking call
            binder = self._binder
            try:
                return client().request(binder.request(args, kwargs))
            except ToolError as exc:
                raise binder.explain(exc) from None
        coroutine: Any = self._call(args, kwargs)
        coroutine.__qualname__ = coroutine.__name__ = self._binder.path  # what "never awaited" names
        return coroutine

    async def _call(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        binder = self._binder
        try:
            return await client().arequest(binder.request(args, kwargs))
        except ToolError as exc:
            raise binder.explain(exc) from None


class CallableNamespace(type):
    """Metaclass of a generated namespace class that is also a tool: calling the class calls its ``__call__`` stub."""

    def __call__(cls, /, *args: Any, **kwargs: Any) -> Any:
        return cls.__dict__["__call__"](*args, **kwargs)


class Toolbox:
    """Registry behind one generated ``tools`` package."""

    CallableNamespace = CallableNamespace

    def __init__(self) -> None:
        self.aio = Namespace("")
        self._stubs: List[Tuple[_Binder, Callable[..., Any]]] = []  # every tool, in definition order

    def script_globals(self) -> Dict[str, Any]:
        """The tools as the script's global namespace offers them: Python name -> ``GlobalStub``, or a
        ``Namespace`` of them for a dotted tool name (``math`` for ``math.factorial``; a tool that is also a
        namespace is its ``__call__``). The runtime leaves out the names of builtins; the script's own
        assignments replace the rest."""
        found: Dict[str, Any] = {}
        for binder, fn in self._stubs:
            *parents, leaf = binder.path.split(".")
            stub = GlobalStub(binder, fn)
            if not parents:
                found[leaf] = stub
                continue
            node = found.get(parents[0])
            if not isinstance(node, Namespace):
                node = found[parents[0]] = Namespace(parents[0])
            for depth, part in enumerate(parents[1:], 2):
                child = vars(node).get(part)
                if not isinstance(child, Namespace):
                    child = Namespace(".".join(parents[:depth]))
                    setattr(node, part, child)
                node = child
            setattr(node, leaf, stub)  # "__call__" for the tool named like its namespace
        return found

    def tool_paths(self) -> Dict[str, str]:
        """Every name a script might use for a tool -> the Python path it has (``tools.<path>``): the path, its
        last part, and the tool's original name (for a ``NameError``'s hint)."""
        paths: Dict[str, str] = {}
        for binder, _ in self._stubs:
            path = binder.path.replace(".__call__", "")
            for name in (binder.tool, path.rsplit(".", 1)[-1], path):
                paths.setdefault(name, path)
        return paths

    def tool(
        self, name: str, renames: Optional[Dict[str, str]] = None, first_takes_object: bool = False
    ) -> Callable[[Callable[..., Any]], SyncStub]:
        """Decorator: make the decorated signature a stub of tool ``name``.

        Args:
            name: the tool's original name, as the broker knows it.
            renames: safe Python parameter spelling -> original parameter name,
                for parameters whose names are not Python identifiers.
            first_takes_object: the tool's first parameter can take an object,
                so a lone positional dict is its value (never the arguments).
        """

        def decorate(fn: Callable[..., Any]) -> SyncStub:
            binder = _Binder(name, fn, dict(renames or {}), first_takes_object)
            node = self.aio
            *parents, leaf = fn.__qualname__.split(".")
            for part in parents:
                child = getattr(node, part, None)
                if not isinstance(child, Namespace):
                    child = Namespace(f"{node._Namespace__path}.{part}".lstrip("."))  # type: ignore[attr-defined]
                    setattr(node, part, child)
                node = child
            setattr(node, leaf, AsyncStub(binder, fn))
            self._stubs.append((binder, fn))
            return SyncStub(binder, fn)

        return decorate
