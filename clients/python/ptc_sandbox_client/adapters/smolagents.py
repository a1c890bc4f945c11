"""A smolagents executor that runs ``CodeAgent``'s code in the service (docs/adapters/smolagents.md).

``PtcExecutor(client)`` is a ``smolagents.PythonExecutor``: pass it as ``CodeAgent(..., executor=PtcExecutor(client))``
and each step's code runs as one script in a service session (opened at the first step, deleted by ``cleanup()``,
which ``CodeAgent.cleanup()`` and ``with CodeAgent(...)`` call). The agent's tools (smolagents ``Tool`` objects and
managed agents) become client-executed tools of the manifest (``inputs`` as JSON Schema): the script calls them as
globals, the broker records each call, and this process answers it by calling the tool. ``final_answer(x)`` ends the
run with ``x`` (the agent's own ``final_answer`` tool is then applied to it here, so a custom one still checks it).

What a step sees of the earlier ones: a session keeps files, not processes, so the step program keeps the state in
the sandbox itself (``/tmp/.ptc_smolagents``): after each step it pickles the globals that pickle, notes the modules
imported, and keeps the source of the functions and classes the steps defined; the next step restores them first.
Nothing of that state leaves the sandbox. What crosses to this process is the step's print output (``logs``), and the
value (the last expression's, or ``final_answer``'s argument) as JSON in smolagents' own tagged format
(``SafeSerializer``: ``str``, ``int``, ``float``, ``bool``, ``None``, ``list``, ``dict`` as they are; ``tuple``,
``set``, ``frozenset``, ``bytes``, ``complex``, non-string-keyed ``dict``, ``datetime``/``date``/``time``/
``timedelta``, ``Decimal``, ``Path`` and numpy arrays and scalars rebuilt with their type; a dataclass as a dict);
any other value comes back as its ``str()``. Variables sent by the agent (``additional_args``) go in the other
direction by ``SafeSerializer`` too (no pickle: one that does not serialize raises ``SerializationError``).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from smolagents.local_python_executor import CodeOutput, PythonExecutor
from smolagents.serialization import SafeSerializer

from ..client import Client, Session
from ..models import JobView

RESULT_PATH = "outputs/ptc-smolagents-result.json"
"""Where the step program leaves the step's outcome (it comes back with the job: docs/files.md)."""

_SCHEMA_TYPES = {"string", "boolean", "integer", "number", "array", "object", "null"}


class SandboxExecutionError(RuntimeError):
    """A step's code raised in the sandbox, or the step's job did not end normally (stopped, timed out, killed);
    the message is the exception line (or the job's status and error) and ``view`` the job's view."""

    def __init__(self, message: str, view: JobView) -> None:
        super().__init__(message)
        self.view = view


def input_schema(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON Schema (an object) of a smolagents tool's ``inputs`` (``{name: {"type", "description", "nullable",
    ...}}``): ``type`` kept when JSON Schema knows it (a list of types too), dropped for ``any``, ``image`` and
    ``audio``; ``nullable`` adds ``null`` to the types and makes the input optional, the others are required."""
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, spec in inputs.items():
        prop = {k: v for k, v in dict(spec).items() if k not in ("type", "nullable")}
        kinds = spec.get("type")
        kind_list = [kinds] if isinstance(kinds, str) else list(kinds or [])
        known = [k for k in kind_list if k in _SCHEMA_TYPES]
        nullable = bool(spec.get("nullable"))
        if known and len(known) == len(kind_list):
            if nullable and "null" not in known:
                known.append("null")
            prop["type"] = known[0] if len(known) == 1 else known
        properties[name] = prop
        if not nullable:
            required.append(name)
    return {"type": "object", "properties": properties, "required": required}


def _tool_function(tool: Any) -> Callable[..., Any]:
    """The callable answering ``tool``'s calls: only with the names of its ``inputs`` (others raise ``TypeError``,
    the script's ``tools.ToolError``): extra keys would reach ``Tool.__call__``'s own options
    (``sanitize_inputs_outputs``) or a managed agent's ``run`` (``max_steps``, ``reset``, ``stream``), which are the
    application's to set, not the script's. The service's broker refuses them already (the schema sets no
    ``additionalProperties``); this holds in the agent process whatever reaches it."""
    inputs = set(getattr(tool, "inputs", None) or {})

    def call(**kwargs: Any) -> Any:
        extra = sorted(set(kwargs) - inputs)
        if extra:
            raise TypeError(f"{tool.name}: unexpected argument(s) {', '.join(extra)}")
        return _jsonable(tool(**kwargs))

    call.__doc__ = str(getattr(tool, "description", "") or tool.name)
    return call


def _jsonable(value: Any) -> Any:
    """``value`` if JSON can carry it (a tool's result goes back to the script as JSON), else its ``str()``."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


class PtcExecutor(PythonExecutor):  # type: ignore[misc]  # smolagents ships no type information
    """Runs each ``CodeAgent`` step as a script in one service session (see the module's docstring).

    ``client`` is a :class:`~ptc_sandbox_client.Client`; ``session`` takes the session's fields (``limits``,
    ``image``, ``idle_timeout_s``, ``metadata``, ...); ``timeout_s`` bounds each step's script (the service's default
    when ``None``); ``wait_s`` is how long one request waits for the job. Raises :class:`SandboxExecutionError` for a
    step whose code raised (smolagents shows its message to the model) and ``ProblemError`` for a refused request.
    """

    def __init__(
        self,
        client: Client,
        *,
        session: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
        wait_s: float = 30.0,
    ) -> None:
        self.client = client
        self.session_body = dict(session or {})
        self.timeout_s = timeout_s
        self.wait_s = wait_s
        self.session: Session | None = None
        self.tools: dict[str, Any] = {}
        self.final_answer_tool: Any = None
        self.pending_variables: str | None = None
        self.state: dict[str, Any] = {"_print_outputs": ""}  # CodeAgent shows this when a step raised
        self.views: list[JobView] = []  # every step's final job view, in order

    def send_tools(self, tools: dict[str, Any]) -> None:
        """Takes the agent's tools (and managed agents): ``final_answer`` is kept here, the others become the
        manifest of every later step."""
        self.final_answer_tool = tools.get("final_answer")
        self.tools = {name: tool for name, tool in tools.items() if name != "final_answer"}

    def send_variables(self, variables: dict[str, Any]) -> None:
        """Takes the agent's variables: the next step restores them into its globals first (``SafeSerializer``,
        no pickle; raises its ``SerializationError`` for a value it cannot carry)."""
        if variables:
            self.pending_variables = SafeSerializer.dumps(variables, allow_pickle=False)

    def manifest_schemas(self) -> dict[str, dict[str, Any]]:
        """Each tool's parameter schema (``input_schema`` of its ``inputs``), by name."""
        return {name: input_schema(getattr(tool, "inputs", {}) or {}) for name, tool in self.tools.items()}

    def __call__(self, code_action: str) -> CodeOutput:
        """Runs one step's code in the session: ``CodeOutput(output, logs, is_final_answer)``."""
        if self.session is None:
            self.session = self.client.session(**self.session_body)
        body: dict[str, Any] = {"session_id": self.session.session_id, "wait_s": self.wait_s}
        if self.timeout_s is not None:
            body["timeout_s"] = self.timeout_s
        view = self.client.run_with_tools(
            step_script(code_action, self.pending_variables),
            {name: _tool_function(tool) for name, tool in self.tools.items()},
            schemas=self.manifest_schemas(),
            **body,
        )
        self.pending_variables = None
        self.views.append(view)
        self.state["_print_outputs"] = view.stdout
        outcome = self._outcome(view)
        if "error" in outcome:
            raise SandboxExecutionError(str(outcome["error"]), view)
        try:
            value = from_json_safe(outcome.get("value"))
        except (ArithmeticError, LookupError, TypeError, ValueError, RecursionError) as error:
            raise SandboxExecutionError(f"the step's value could not be read: {error!r}"[:500], view) from error
        final = bool(outcome.get("final"))
        if final and self.final_answer_tool is not None:
            inputs = list(getattr(self.final_answer_tool, "inputs", None) or {"answer": None})
            value = self.final_answer_tool(**{inputs[0]: value})
        return CodeOutput(output=value, logs=view.stdout, is_final_answer=final)

    def _outcome(self, view: JobView) -> dict[str, Any]:
        if any(f.path == RESULT_PATH for f in view.files):
            outcome = json.loads(self.client.job_file(view.job_id, RESULT_PATH))
            if isinstance(outcome, dict):
                return outcome
        detail = (view.error or {}).get("message") or "".join(view.stderr.strip().splitlines()[-1:])
        raise SandboxExecutionError(f"the step's script ended {view.status}: {detail}", view)

    def cleanup(self) -> None:
        """Deletes the session (idempotent)."""
        if self.session is not None:
            self.session.close()
            self.session = None


# The tags whose value is one leaf (SafeSerializer builds it from strings and numbers only).
_LEAF_TAGS = frozenset({"bytes", "complex", "datetime", "date", "time", "timedelta", "Decimal", "Path"})
# numpy dtypes an array may come back as: fixed-size numbers (never a string, void or sub-array dtype, whose size the
# sandbox would choose: ``"U1000000000"`` is 4 GB per element).
NUMPY_DTYPES = frozenset(
    {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"}
    | {"float16", "float32", "float64", "complex64", "complex128"}
)


def from_json_safe(obj: Any) -> Any:
    """A step's value from the sandbox (``SafeSerializer``'s tagged JSON, as ``_ptc_encode`` writes it): the types
    the module's docstring lists and nothing else. The sandbox is hostile, so unlike ``SafeSerializer.from_json_safe``
    a ``PIL.Image`` tag is not opened (no image decoder runs on the sandbox's bytes) and an ``ndarray`` is built only
    with a dtype of ``NUMPY_DTYPES`` (any other: the list of its items); an unknown tag stays a dict.

    Raises:
        ValueError, TypeError, LookupError, ArithmeticError: a malformed tagged value (a bad date, an unhashable set
            member, a missing field, a timedelta out of range).
    """
    if isinstance(obj, list):
        return [from_json_safe(item) for item in obj]
    if not isinstance(obj, dict):
        return obj
    kind = obj.get("__type__")
    if kind in _LEAF_TAGS:
        return SafeSerializer.from_json_safe(obj)
    if kind in ("tuple", "set", "frozenset"):
        items = [from_json_safe(item) for item in obj["data"]]
        return tuple(items) if kind == "tuple" else set(items) if kind == "set" else frozenset(items)
    if kind == "dict_with_complex_keys":
        return {from_json_safe(k): from_json_safe(v) for k, v in obj["data"]}
    if kind == "dataclass":
        fields = {k: from_json_safe(v) for k, v in dict(obj["data"]).items()}
        return {"__dataclass__": str(obj["class_name"]), "__module__": str(obj["module"]), **fields}
    if kind == "ndarray":
        items = from_json_safe(obj["data"])
        if obj.get("dtype") not in NUMPY_DTYPES:
            return items
        try:
            numpy = importlib.import_module("numpy")
        except ImportError:
            return items
        return numpy.array(items, dtype=obj["dtype"])
    return {k: from_json_safe(v) for k, v in obj.items()}


def step_script(code: str, variables: str | None = None) -> str:
    """The script of one step: the step program with ``code`` (and the agent's serialized ``variables``)."""
    deserializer = SafeSerializer.get_deserializer_code(False) if variables else ""
    return (
        f"_ptc_code = {code!r}\n_ptc_variables = {variables!r}\n"
        f"def _ptc_load_variables():\n{_indent(deserializer or 'pass')}\n"
        f"    return _deserialize(_ptc_variables) if _ptc_variables else {{}}\n"
        f"{_STEP_PROGRAM}"
    )


def _indent(text: str) -> str:
    return "\n".join("    " + line if line.strip() else "" for line in text.splitlines())


# The step program: standard library only, it runs in the sandbox as the script's top level (``__main__``).
_STEP_PROGRAM = r'''
def _ptc_step():
    import ast, base64, builtins, importlib, json, linecache, os, pickle, sys, traceback, types

    g = sys.modules["__main__"].__dict__
    state_dir = "/tmp/.ptc_smolagents"
    state_path = state_dir + "/state.pkl"

    class FinalAnswer(BaseException):
        def __init__(self, value):
            super().__init__()
            self.value = value

    def final_answer(answer=None, *args, **kwargs):
        raise FinalAnswer(answer)

    offered = {}
    try:
        import tools
        offered = tools._ptc_toolbox.script_globals()
    except Exception:
        pass
    for name, value in offered.items():
        if name not in vars(builtins) and not name.startswith("__"):
            g[name] = value
    g["final_answer"] = final_answer

    defs, values, modules = {}, {}, {}
    if os.path.exists(state_path):
        with open(state_path, "rb") as f:
            saved = pickle.load(f)
        defs, values, modules = saved["defs"], saved["values"], saved["modules"]
    for name, module in modules.items():
        try:
            g[name] = importlib.import_module(module)
        except Exception:
            pass
    failed = {}
    for name, blob in values.items():
        try:
            g[name] = pickle.loads(blob)
        except Exception:
            failed[name] = blob
    for name, source in defs.items():
        try:
            exec(compile(source, "<earlier step>", "exec"), g)
        except Exception:
            pass
    for name, blob in failed.items():
        try:
            g[name] = pickle.loads(blob)
        except Exception:
            pass
    g.update(_ptc_load_variables())

    code = _ptc_code
    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")
    outcome = {}
    new_defs = {}
    try:
        tree = ast.parse(code, "<code>")
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                new_defs[node.name] = ast.unparse(node)
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<code>", "exec"), g)
        value = eval(compile(last, "<code>", "eval"), g) if last is not None else None
        outcome = {"final": False, "value": _ptc_encode(value)}
    except FinalAnswer as answer:
        outcome = {"final": True, "value": _ptc_encode(answer.value)}
    except BaseException as exc:
        traceback.print_exc()
        outcome = {"error": "".join(traceback.format_exception_only(type(exc), exc)).strip()}

    skip = {"final_answer", "_ptc_code", "_ptc_variables", "_ptc_load_variables", "_ptc_step", "_ptc_encode"}
    kept_defs, kept_values, kept_modules = {}, {}, {}
    for name, value in list(g.items()):
        if name.startswith("__") or name in skip or offered.get(name) is value:
            continue
        if isinstance(value, types.ModuleType):
            kept_modules[name] = value.__name__
            continue
        source = new_defs.get(name) or defs.get(name)
        if (
            source is not None
            and isinstance(value, (types.FunctionType, type))
            and getattr(value, "__module__", None) == "__main__"
            and value.__qualname__ == name
        ):
            kept_defs[name] = source
            continue
        try:
            kept_values[name] = pickle.dumps(value)
        except Exception:
            pass
    os.makedirs(state_dir, exist_ok=True)
    with open(state_path + ".new", "wb") as f:
        pickle.dump({"defs": kept_defs, "values": kept_values, "modules": kept_modules}, f)
    os.replace(state_path + ".new", state_path)
    os.makedirs("/tmp/outputs", exist_ok=True)
    with open("/tmp/outputs/ptc-smolagents-result.json", "w") as f:
        json.dump(outcome, f)
    return "error" not in outcome


def _ptc_encode(obj):
    """smolagents' SafeSerializer.to_json_safe format; anything else as its str()."""
    import base64, dataclasses
    t = type(obj)
    if obj is None or t in (str, int, float, bool):
        return obj
    if t is list:
        return [_ptc_encode(i) for i in obj]
    if t is tuple:
        return {"__type__": "tuple", "data": [_ptc_encode(i) for i in obj]}
    if t is dict:
        if all(type(k) is str for k in obj):
            return {k: _ptc_encode(v) for k, v in obj.items()}
        pairs = [[_ptc_encode(k), _ptc_encode(v)] for k, v in obj.items()]
        return {"__type__": "dict_with_complex_keys", "data": pairs}
    if t in (set, frozenset):
        return {"__type__": t.__name__, "data": [_ptc_encode(i) for i in obj]}
    if t is bytes:
        return {"__type__": "bytes", "data": base64.b64encode(obj).decode()}
    if t is complex:
        return {"__type__": "complex", "real": obj.real, "imag": obj.imag}
    module, name = getattr(t, "__module__", ""), t.__name__
    if module == "datetime" and name in ("datetime", "date", "time"):
        return {"__type__": name, "data": obj.isoformat()}
    if module == "datetime" and name == "timedelta":
        return {"__type__": "timedelta", "total_seconds": obj.total_seconds()}
    if module == "decimal" and name == "Decimal":
        return {"__type__": "Decimal", "data": str(obj)}
    if module.startswith("pathlib") and "Path" in name:
        return {"__type__": "Path", "data": str(obj)}
    if module == "numpy" or module.startswith("numpy."):
        if name == "ndarray":
            return {"__type__": "ndarray", "data": obj.tolist(), "dtype": str(obj.dtype)}
        if hasattr(obj, "item"):
            return obj.item()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        data = {f.name: _ptc_encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return {"__type__": "dataclass", "class_name": name, "module": module, "data": data}
    return str(obj)


if not _ptc_step():
    raise SystemExit(1)
'''
