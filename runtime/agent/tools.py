"""Tools the model may call, and how a call is checked and run.

A bad call (an unknown tool, arguments that are not JSON or do not match the tool's schema, a
tool that fails or runs out of time) goes back to the model as a tool error it can act on; it
never ends the run.
"""

from __future__ import annotations

import inspect
import json
import logging
import operator
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from persistence.transcript import ToolCall
from persistence.validate import strict_json
from runtime.models import ToolSpec, unicode_text

logger = logging.getLogger(__name__)

DEFAULT_TOOL_TIMEOUT_S = 30.0

Invoke = Callable[[dict[str, Any]], Awaitable[str]]


@attrs.frozen
class Tool:
    """A tool: its name, what it does, a JSON schema for its arguments, and the coroutine that runs it:
    ``invoke`` is an ``async def`` given the call's arguments (a dict, checked against the schema)
    and returning text for the model; what it raises goes back to the model as the call's error.

    The schema may use only the keywords its calls are checked against (``schema_mistake`` says
    why one is refused, as the tool is made). ``invoke`` runs on the event loop: a blocking call
    inside it stalls the whole process, past ``timeout_s``; give it to ``trio.to_thread.run_sync``.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    invoke: Invoke = attrs.field(repr=False)
    timeout_s: float = attrs.field(default=DEFAULT_TOOL_TIMEOUT_S, validator=attrs.validators.gt(0))

    def __attrs_post_init__(self) -> None:
        self.spec()  # a name or schema the model API would refuse is refused here, not at the first request
        # A keyword calls are not checked against would let a call that breaks it reach the tool.
        mistake = schema_mistake(self.parameters, "parameters")
        if mistake:
            raise ValueError(f"tool {self.name!r}: {mistake}")

    def spec(self) -> ToolSpec:
        return ToolSpec(name=self.name, description=self.description, parameters=self.parameters)


@attrs.frozen
class Outcome:
    text: str
    is_error: bool


async def call_tool(tools: Mapping[str, Tool], call: ToolCall, *, task_id: str | None = None) -> Outcome:
    """Check and run one tool call within the tool's timeout; every failure is an error Outcome.

    Blocks until the tool returns or its timeout passes. Cancellation of the caller propagates
    (it ends the tool too); nothing else is raised. The outcome's text is Unicode text, as the
    transcript stores it, whatever the model or the tool put in it (a lone surrogate, say).
    A tool that fails or runs out of time is logged in one line, naming ``task_id`` if given.
    """
    outcome = await _call_tool(tools, call, f"task {task_id}: " if task_id else "")
    return Outcome(unicode_text(outcome.text), outcome.is_error)


async def _call_tool(tools: Mapping[str, Tool], call: ToolCall, about: str) -> Outcome:
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        return Outcome(f"error: there is no tool named {call.name!r}; the tools are: {known}", True)
    try:
        # Strict, as the call is sent back to the model (NaN is not JSON); some models send ""
        # for a call without arguments.
        arguments = strict_json(call.arguments or "{}", unique_keys=True)
    except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested past what Python reads
        return Outcome(f"error: the arguments of {call.name} are not JSON ({exc}); send a JSON object", True)
    except ValueError as exc:  # JSON, but not as a server reading it back would (a key twice, say)
        return Outcome(f"error: the arguments of {call.name} cannot be read ({exc}); send a JSON object", True)
    if not isinstance(arguments, dict):
        return Outcome(f"error: the arguments of {call.name} must be a JSON object, not {_json_type(arguments)}", True)
    problem = schema_problem(tool.parameters, arguments, "arguments")
    if problem:
        return Outcome(f"error: {call.name} was called with bad arguments: {problem}", True)
    with trio.move_on_after(tool.timeout_s):
        try:
            pending = tool.invoke(arguments)
            if not inspect.isawaitable(pending):  # a plain def: it ran, on the event loop, and gave no coroutine
                logger.warning(
                    "%stool %r is not async: calling it returned a %s, which cannot be awaited; define it with async def",
                    about, call.name, type(pending).__name__,
                )  # fmt: skip
                return Outcome(f"error: {call.name} failed: it could not be run", True)
            text = await pending
        except (Exception, SystemExit, GeneratorExit) as exc:  # the model's to handle; Cancelled is not caught
            # SystemExit too: a tool wrapping a command's argparse parser must not end the process
            # (KeyboardInterrupt goes on: it may be the operator's Ctrl-C, raised inside the tool).
            logger.info("%stool %r failed: %r", about, call.name, exc)
            return Outcome(f"error: {call.name} failed: {_failure(exc)}", True)
        except BaseExceptionGroup as group:
            # A tool with a nursery of its own, cancelled (by its timeout or its caller) while
            # one of its tasks failed: the failure would otherwise outlive the cancel scope and
            # turn a timeout or a CancelTask into a crash of the run. Only the cancel goes on.
            failed, cancelled = group.split(Exception)
            if failed is None or cancelled is None:
                raise
            logger.info("%stool %r failed as it was cancelled: %r", about, call.name, failed)
            raise cancelled from None
        if not isinstance(text, str):
            logger.warning("%stool %r returned a %s, not text", about, call.name, type(text).__name__)
            return Outcome(f"error: {call.name} failed: it returned no text", True)
        # call_tool makes it Unicode text: a file name read with errors="surrogateescape" is not.
        return Outcome(text, False)
    # The tool's own scope ran out. A tool that ignores cancellation (a blocking call in a
    # thread, say) delays this until it returns; the caller's cancellation is never caught here.
    logger.info("%stool %r did not finish within %g s", about, call.name, tool.timeout_s)
    return Outcome(f"error: {call.name} did not finish within {tool.timeout_s:g} s", True)


_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


# The keywords calls are checked against, and those that only describe (for the model to read).
_CHECKED = frozenset({
    "type", "enum", "properties", "required", "additionalProperties", "items", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "minItems", "maxItems",
})  # fmt: skip
_NOTES = frozenset({"description", "title", "default", "examples", "$schema", "$comment", "deprecated"})
_BOUNDS: dict[str, tuple[str, Callable[[Any, Any], bool]]] = {
    "minimum": ("at least", operator.ge),
    "maximum": ("at most", operator.le),
    "exclusiveMinimum": ("more than", operator.gt),
    "exclusiveMaximum": ("less than", operator.lt),
}
_SIZES = frozenset({"minLength", "maxLength", "minItems", "maxItems"})


def schema_mistake(schema: Any, where: str) -> str | None:
    """Why calls could not be checked against a tool's JSON schema in full, or None.

    A keyword schema_problem does not check (anyOf, $ref, format, pattern...) is refused rather
    than left to the model's goodwill, as is a checked keyword's value it cannot read."""
    if not isinstance(schema, Mapping):
        return f"{where} must be a schema (a JSON object)"
    for keyword, value in schema.items():
        if keyword not in _CHECKED | _NOTES:
            return (
                f"the schema's {keyword!r} (at {where}) is not checked in calls; use only {', '.join(sorted(_CHECKED))} "
                "(and notes such as description), and check anything more in the tool itself"
            )
        mistake = _keyword_mistake(keyword, value, f"{where}.{keyword}")
        if mistake:
            return mistake
    return None


def _keyword_mistake(keyword: str, value: Any, where: str) -> str | None:
    if keyword == "type":
        names = [value] if isinstance(value, str) else value
        if not _is_list_of(names, str):
            return f"{where} must be a type name or a list of them"
        unknown = next((name for name in names if name not in _TYPES), None)
        if unknown is not None:
            return f"{where} is {unknown!r}, which is not a JSON schema type (one of {', '.join(_TYPES)})"
    if keyword == "required" and not _is_list_of(value, str):
        return f"{where} must be a list of names"
    if keyword == "enum" and not isinstance(value, list):
        return f"{where} must be a list"
    if keyword in _BOUNDS and not _is_type(value, "number"):
        return f"{where} must be a number"
    if keyword in _SIZES and not (_is_type(value, "integer") and value >= 0):
        return f"{where} must be a whole number, 0 or more"
    if keyword == "properties":
        if not isinstance(value, Mapping):
            return f"{where} must be an object of schemas"
        return next(filter(None, (schema_mistake(item, f"{where}.{name}") for name, item in value.items())), None)
    if keyword == "items" or (keyword == "additionalProperties" and not isinstance(value, bool)):
        return schema_mistake(value, where)
    return None


def _is_list_of(value: Any, kind: type) -> bool:
    return isinstance(value, list) and all(isinstance(item, kind) for item in value)


def schema_problem(schema: Mapping[str, Any], value: Any, where: str) -> str | None:
    """What is wrong with ``value`` under a JSON schema, or None. Covers the keywords tool
    schemas may use (schema_mistake refuses the others when a tool is made)."""
    expected = schema.get("type")
    if expected is not None:
        names = [expected] if isinstance(expected, str) else list(expected)
        if not any(_is_type(value, name) for name in names):
            return f"{where} must be {' or '.join(names)}, not {_json_type(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {json.dumps(schema['enum'])}"
    problem = _bound_problem(schema, value, where)
    if problem:
        return problem
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for name in schema.get("required", ()):
            if name not in value:
                return f"{where}.{name} is required"
        others = schema.get("additionalProperties", True)
        for name, item in value.items():
            problem = None
            if name in properties:
                problem = schema_problem(properties[name], item, f"{where}.{name}")
            elif others is False:
                problem = f"{where}.{name} is not a known field (known: {', '.join(properties) or 'none'})"
            elif isinstance(others, Mapping):
                problem = schema_problem(others, item, f"{where}.{name}")
            if problem:
                return problem
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(value):
            problem = schema_problem(schema["items"], item, f"{where}[{index}]")
            if problem:
                return problem
    return None


def _bound_problem(schema: Mapping[str, Any], value: Any, where: str) -> str | None:
    if _is_type(value, "number"):
        for keyword, (words, holds) in _BOUNDS.items():
            if keyword in schema and not holds(value, schema[keyword]):
                return f"{where} must be {words} {json.dumps(schema[keyword])}"
    if isinstance(value, (str, list)):
        low, high, unit = ("minLength", "maxLength", "character") if isinstance(value, str) else ("minItems", "maxItems", "item")
        for keyword, words, fails in ((low, "at least", operator.lt), (high, "at most", operator.gt)):
            if keyword in schema and fails(len(value), schema[keyword]):
                count = schema[keyword]
                size = f"{count} {unit if count == 1 else unit + 's'}"
                return f"{where} must be {words} {size} long" if unit == "character" else f"{where} must hold {words} {size}"
    return None


def _failure(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return "it exited" if exc.code is None else f"it exited with status {exc.code}"
    return str(exc) or type(exc).__name__


def _is_type(value: Any, name: str) -> bool:
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    return isinstance(value, _TYPES.get(name, object))


def _json_type(value: Any) -> str:
    for name in ("boolean", "null", "object", "array", "string", "integer", "number"):
        if _is_type(value, name):
            return name
    return type(value).__name__
