"""What the API's request bodies share: ``Limits``, ``FileIn`` (``Files``), ``Env`` and ``Metadata``, checked."""

from __future__ import annotations

import base64
import binascii
import math
import re
from typing import Annotated, Any, Literal

import orjson
from ptc_runtime.files import check_path
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from service.toolkit.schema import json_depth

MAX_METADATA_DEPTH = 32
MAX_METADATA_BYTES = 64 * 1024
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# PYTHON*: read by the interpreter as it starts, which a sandbox's resident interpreter did before the job came
# (and some, e.g. PYTHONMALLOC, could stop it); LD_*: read by the dynamic loader, likewise; PTC_*: the runtime's.
# NODE_*: read by Node.js as it starts (NODE_OPTIONS loads code before the runtime's own), for JavaScript scripts.
_RESERVED_ENV = ("PYTHON", "LD_", "PTC_", "NODE_")

Language = Literal["python", "javascript", "typescript"]
"""A script's language: what ``language`` on ``/execute``, ``POST /sessions`` and ``POST /stubs`` may name."""
LANGUAGE_DESCRIPTION = (
    "The script's language: python (default), javascript (an ES module, run by Node.js) or typescript (type-stripped, "
    "then run as javascript). JavaScript and TypeScript run in an image that has Node.js (PTC_IMAGES' node unless "
    "image names another)."
)


def _has_non_finite(value: Any) -> bool:
    """Whether a JSON-like value holds a float NaN or infinity anywhere (walked without recursion)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, float) and not math.isfinite(node):
            return True
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False


def check_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """``metadata`` if it is small JSON (size and depth caps); raises ValueError otherwise.

    The size first (orjson, in C): the depth walk, in Python, then only sees at most ``MAX_METADATA_BYTES``.
    """
    try:
        encoded = orjson.dumps(metadata)
    except orjson.JSONEncodeError as exc:
        raise ValueError(f"metadata cannot be stored as JSON: {exc}") from None
    size = len(encoded)
    if b"null" in encoded and size <= MAX_METADATA_BYTES and _has_non_finite(metadata):
        # orjson writes NaN and infinities (which the request reader lets through, 1e400 included) as null
        raise ValueError("metadata cannot be stored as JSON: NaN or an infinity (a number out of range of a double)")
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is larger than {MAX_METADATA_BYTES} bytes of JSON")
    if json_depth(metadata, MAX_METADATA_DEPTH) > MAX_METADATA_DEPTH:
        raise ValueError(f"metadata is nested deeper than {MAX_METADATA_DEPTH} levels")
    return metadata


def check_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` if every name is valid and not reserved by the runtime; raises ValueError otherwise."""
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name):
            raise ValueError(f"environment variable name {name!r} is not a valid name")
        if name.startswith(_RESERVED_ENV):
            raise ValueError(
                f"environment variable {name!r} is reserved: PYTHON*, LD_*, PTC_* and NODE_* variables act "
                "when the interpreter starts, before a script's env applies"
            )
        if "\x00" in value:
            raise ValueError(f"environment variable {name!r} contains a NUL character")
        utf8_text(value, f"environment variable {name!r}")
    return env


def utf8_text(text: str, name: str) -> str:
    """``text`` if it is valid Unicode text; raises ValueError for a lone surrogate (``"\\ud800"`` in JSON), which no
    UTF-8 store, log or script can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid UTF-8 text (a lone surrogate)") from None
    return text


Env = Annotated[dict[str, str], AfterValidator(check_env)]
Metadata = Annotated[dict[str, Any], AfterValidator(check_metadata)]


class Limits(BaseModel):
    """Per-request sandbox limits; each may be lowered freely or raised up to the server's ``max_*`` setting."""

    model_config = ConfigDict(extra="forbid")

    memory_mb: int | None = Field(None, strict=True, ge=16, description="Memory in MiB (swap is not added).")
    cpus: float | None = Field(
        None, strict=True, ge=0.01, description="CPU quota in CPUs (at most the host's CPU count)."
    )
    pids: int | None = Field(None, strict=True, ge=8, description="Maximum processes and threads.")
    output_bytes: int | None = Field(
        None, strict=True, ge=1024, description="Inline cap per stream in bytes (head and tail kept)."
    )
    tmp_mb: int | None = Field(None, strict=True, ge=1, description="Size of the tmpfs /tmp in MiB.")


class FileIn(BaseModel):
    """One file written under the sandbox's working directory (/tmp) before the script starts (docs/files.md)."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        ...,
        max_length=1024,
        description="Relative to /tmp: no '..', not absolute, no NUL, not under outputs/ (at most 16 components).",
    )
    content: str | None = Field(None, description="The file as UTF-8 text (or content_base64).")
    content_base64: str | None = Field(None, description="The file's bytes, base64 (standard alphabet, padded).")

    @field_validator("path")
    @classmethod
    def _safe_path(cls, path: str) -> str:
        return check_path(path)

    @model_validator(mode="after")
    def _one_content(self) -> FileIn:
        if (self.content is None) == (self.content_base64 is None):
            raise ValueError("give exactly one of content and content_base64")
        if self.content_base64 is not None:
            try:
                base64.b64decode(self.content_base64, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ValueError(f"content_base64 is not base64: {exc}") from None
        if self.content is not None:
            try:
                self.content.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("content is not UTF-8 text (lone surrogates): send content_base64") from None
        return self

    def data(self) -> bytes:
        """The file's bytes."""
        if self.content is not None:
            return self.content.encode("utf-8")
        return base64.b64decode(self.content_base64 or "", validate=True)

    def size(self) -> int:
        """The file's size in bytes (decoded), without decoding it."""
        if self.content is not None:
            return len(self.content.encode("utf-8"))
        text = (self.content_base64 or "").rstrip("=")
        return len(text) * 3 // 4


Files = Annotated[
    list[FileIn],
    Field(
        description="Files written under /tmp before the script starts (docs/files.md); at most PTC_MAX_FILES files "
        "and PTC_MAX_FILES_BYTES bytes (413)."
    ),
]
