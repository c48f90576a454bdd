"""Structured output: the JSON an answer must be, and whether it is.

A request that carries ``response_format`` (``json_object``, or ``json_schema`` with a
schema) asks the server to constrain its answer, but servers differ in how strictly they
do (a grammar that is not enforced, a reasoning model that thinks first, an answer cut at
``max_tokens``): what is stored becomes training data, so each answer is checked here,
its reasoning already split off (``orchestrator.items.quality.split_think``): parsed, then
validated with ``jsonschema``. The result is a quality flag (``invalid_json``,
``schema_mismatch``); the dataset's ``on_invalid`` says what the worker does with it.

Pure and without I/O: the worker checks each answer, export recomputes the parsed value
from the stored content, and ``enqueue --json-schema`` checks a schema file up front.
``jsonschema`` is imported where a schema is first used: ``status`` reads the flags
defined here, and importing the validator costs it more than its queries.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from orchestrator.errors import ConfigError
from orchestrator.items.quality import INVALID_JSON, SCHEMA_MISMATCH

if TYPE_CHECKING:
    import referencing
    import referencing.exceptions

__all__ = [
    "INVALID_FLAGS",
    "Checked",
    "check",
    "expected_format",
    "format_problem",
    "response_format_for",
    "schema_of",
    "schema_problem",
]

#: The flags an answer that is not the JSON asked for carries.
INVALID_FLAGS = INVALID_JSON | SCHEMA_MISMATCH

#: Messages of a mismatch keep this many characters of the validator's words.
_MESSAGE_CHARS = 300


@dataclass(frozen=True, slots=True)
class Checked:
    """One answer checked: its flag (0: valid), the parsed value, and why not."""

    flags: int
    parsed: Any = None
    reason: str = ""


def expected_format(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``response_format`` of a request that asks for JSON, else None.

    ``{"type": "json_object"}`` asks for any JSON object; ``{"type": "json_schema",
    "json_schema": {"schema": ...}}`` (OpenAI, vLLM, SGLang) for one that satisfies the
    schema; llama.cpp also takes ``{"type": "json_object", "schema": ...}``.
    """
    fmt = body.get("response_format")
    if isinstance(fmt, Mapping) and fmt.get("type") in ("json_object", "json_schema"):
        return dict(fmt)
    return None


def schema_of(fmt: Mapping[str, Any]) -> dict[str, Any] | None:
    """The JSON schema a ``response_format`` names (None: any JSON will do)."""
    inner = fmt.get("json_schema")
    schema = inner.get("schema") if isinstance(inner, Mapping) else None
    if schema is None:
        schema = fmt.get("schema")
    return schema if isinstance(schema, dict) else None


def check(content: str | None, fmt: Mapping[str, Any]) -> Checked:
    """Whether ``content`` (reasoning already split off) is the JSON ``fmt`` asks for.

    A ``json_object`` answer must parse to an object; a schema's answer must satisfy it.
    Whitespace around the JSON is allowed (models end with a newline); a Markdown fence
    is not: the answer is stored as the training target, and a fence in it is not JSON.
    """
    text = (content or "").strip()
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        return Checked(INVALID_JSON, None, f"the answer is not JSON: {exc}")
    schema = schema_of(fmt)
    if schema is None:
        if fmt.get("type") == "json_object" and not isinstance(parsed, dict):
            return Checked(SCHEMA_MISMATCH, parsed, "the answer is JSON but not an object")
        return Checked(0, parsed)
    import jsonschema

    error = jsonschema.exceptions.best_match(_validator(_key(schema)).iter_errors(parsed))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(the whole answer)"
        reason = f"the answer does not match the schema at {where}: {error.message}"
        return Checked(SCHEMA_MISMATCH, parsed, reason[:_MESSAGE_CHARS])
    return Checked(0, parsed)


def _key(schema: dict[str, Any]) -> str:
    return orjson.dumps(schema, option=orjson.OPT_SORT_KEYS).decode()


@functools.lru_cache(maxsize=64)
def _validator(key: str) -> Any:
    """A compiled validator per schema: a dataset checks every answer against one. Its
    registry holds the meta-schemas alone: a ``$ref`` to another document is never
    fetched (jsonschema's default would, over the network, for every answer)."""
    import referencing

    schema = orjson.loads(key)
    cls = _validator_class(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER, registry=referencing.Registry())


def _validator_class(schema: Any) -> Any:
    import jsonschema

    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)


def schema_problem(schema: Any) -> str:
    """Why ``schema`` cannot check answers ("" when it can): not an object, not a valid
    JSON schema, or a ``$ref`` that resolves to nothing. Every ``$ref`` is looked up,
    those the answers may never reach too, so that no answer meets one in the worker."""
    if not isinstance(schema, dict):
        return f"a JSON schema must be an object, not {type(schema).__name__}"
    try:
        key = _key(schema)
    except orjson.JSONEncodeError as exc:
        return f"the schema is not JSON: {exc}"
    return _schema_problem(key)


@functools.lru_cache(maxsize=64)
def _schema_problem(key: str) -> str:
    """``schema_problem`` once per schema: input lines may each carry the same one."""
    import jsonschema
    import referencing
    import referencing.jsonschema
    from jsonschema_specifications import REGISTRY as META_SCHEMAS

    schema = orjson.loads(key)
    cls = _validator_class(schema)
    try:
        cls.check_schema(schema)
        dialect = referencing.jsonschema.specification_with(
            cls.ID_OF(cls.META_SCHEMA), default=referencing.Specification.OPAQUE
        )
        root = dialect.create_resource(schema)
        unresolved = _unresolved(META_SCHEMAS.resolver_with_root(root), root)
        if unresolved:
            return unresolved
        # The worker's own validator, on a probe: what building it could raise, raised here.
        list(_validator(key).iter_errors({}))
    except jsonschema.exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "the top level"
        return f"not a valid JSON schema at {where}: {exc.message}"
    except RecursionError:
        return "the schema is nested too deeply to be checked"
    except Exception as exc:  # whatever else would stop every answer's check
        return f"it cannot check answers: {type(exc).__name__}: {exc}"[:_MESSAGE_CHARS]
    return ""


def _unresolved(resolver: referencing.Resolver[Any], resource: referencing.Resource[Any]) -> str:
    """The first ``$ref`` (or ``$dynamicRef``) under ``resource`` that resolves to
    nothing, said as a reason; "" when every one resolves."""
    import referencing.exceptions

    contents = resource.contents
    if isinstance(contents, dict):
        for keyword in ("$ref", "$dynamicRef"):
            ref = contents.get(keyword)
            if not isinstance(ref, str):
                continue
            try:
                resolver.lookup(ref)
            except referencing.exceptions.Unresolvable as exc:
                return f"{keyword} {ref!r} {_why_unresolved(exc)}"
    for sub in resource.subresources():
        found = _unresolved(resolver.in_subresource(sub), sub)
        if found:
            return found
    return ""


def _why_unresolved(exc: referencing.exceptions.Unresolvable) -> str:
    import referencing.exceptions

    if isinstance(exc, referencing.exceptions.PointerToNowhere):
        return "points to nothing in the schema"
    if isinstance(exc, referencing.exceptions.NoSuchAnchor):
        return f"names an anchor the schema does not define ({exc.anchor!r})"
    return "names a document outside the schema, never fetched: put what it defines in $defs"


def format_problem(fmt: object) -> str:
    """Why a ``response_format`` (a request's, a dataset's, an input line's) cannot be
    asked with ("" when it can): the schema it names cannot check the answers."""
    if not isinstance(fmt, Mapping) or fmt.get("type") not in ("json_object", "json_schema"):
        return ""
    inner = fmt.get("json_schema")
    given = inner.get("schema") if isinstance(inner, Mapping) else None
    if given is None:
        given = fmt.get("schema")
    if given is None or isinstance(given, bool):
        return ""  # any JSON (an object, for json_object) will do; false fails every answer
    why = schema_problem(given)
    return f"its schema: {why}" if why else ""


def response_format_for(schema: Any, *, source: str, name: str | None = None) -> dict[str, Any]:
    """The ``response_format`` that asks for ``schema`` (``enqueue --json-schema``);
    ``ConfigError`` naming ``source`` when it is not a usable JSON schema."""
    why = schema_problem(schema)
    if why:
        raise ConfigError(f"{source}: {why}")
    label = name or str(schema.get("title") or "answer")
    return {"type": "json_schema", "json_schema": {"name": label[:64], "schema": schema}}
