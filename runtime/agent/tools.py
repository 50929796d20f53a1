"""Tools the model may call, and how a call is checked and run.

A bad call (an unknown tool, arguments that are not JSON or do not match the tool's schema, a
tool that fails or runs out of time) goes back to the model as a tool error it can act on; it
never ends the run.
"""

from __future__ import annotations

import json
import logging
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
    """A tool: its name, what it does, a JSON schema for its arguments, and the coroutine that runs it."""

    name: str
    description: str
    parameters: dict[str, Any]
    invoke: Invoke = attrs.field(repr=False)
    timeout_s: float = attrs.field(default=DEFAULT_TOOL_TIMEOUT_S, validator=attrs.validators.gt(0))

    def __attrs_post_init__(self) -> None:
        self.spec()  # a name or schema the model API would refuse is refused here, not at the first request

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
        arguments = strict_json(call.arguments or "{}")
    except (ValueError, RecursionError) as exc:  # RecursionError: nested past what Python reads
        return Outcome(f"error: the arguments of {call.name} are not JSON ({exc}); send a JSON object", True)
    if not isinstance(arguments, dict):
        return Outcome(f"error: the arguments of {call.name} must be a JSON object, not {_json_type(arguments)}", True)
    problem = schema_problem(tool.parameters, arguments, "arguments")
    if problem:
        return Outcome(f"error: {call.name} was called with bad arguments: {problem}", True)
    with trio.move_on_after(tool.timeout_s):
        try:
            text = await tool.invoke(arguments)
        except Exception as exc:  # a failing tool is the model's to handle; Cancelled is not caught
            logger.info("%stool %r failed: %r", about, call.name, exc)
            return Outcome(f"error: {call.name} failed: {str(exc) or type(exc).__name__}", True)
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


def schema_problem(schema: Mapping[str, Any], value: Any, where: str) -> str | None:
    """What is wrong with ``value`` under a JSON schema, or None. Covers the keywords tool
    schemas use: type, properties, required, additionalProperties, items, enum."""
    expected = schema.get("type")
    if expected is not None:
        names = [expected] if isinstance(expected, str) else list(expected)
        if not any(_is_type(value, name) for name in names):
            return f"{where} must be {' or '.join(names)}, not {_json_type(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {json.dumps(schema['enum'])}"
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for name in schema.get("required", ()):
            if name not in value:
                return f"{where}.{name} is required"
        for name, item in value.items():
            if name in properties:
                problem = schema_problem(properties[name], item, f"{where}.{name}")
                if problem:
                    return problem
            elif schema.get("additionalProperties") is False:
                return f"{where}.{name} is not a known field (known: {', '.join(properties) or 'none'})"
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for index, item in enumerate(value):
            problem = schema_problem(schema["items"], item, f"{where}[{index}]")
            if problem:
                return problem
    return None


def _is_type(value: Any, name: str) -> bool:
    if isinstance(value, bool) and name in ("integer", "number"):
        return False
    return isinstance(value, _TYPES.get(name, object))


def _json_type(value: Any) -> str:
    for name in ("boolean", "null", "object", "array", "string", "integer", "number"):
        if _is_type(value, name):
            return name
    return type(value).__name__
