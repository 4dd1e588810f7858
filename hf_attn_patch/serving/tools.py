"""Function calling for /v1/chat/completions: `tools` and `tool_choice` -> a grammar, the output -> `tool_calls`.

tool_choice (default "auto" with tools, "none" without):
    "none"                       no constraint; the answer is text
    {"type": "function", "function": {"name": F}}   the output is F's arguments: JSON of its `parameters` schema
    "required"                   the output is {"name": one of the tools, "arguments": its schema} (JSON Schema anyOf)
    "auto"                       the output is either text that does not start with "<", or
                                 <tool_call>{"name": ..., "arguments": ...}</tool_call> (a tagged_json grammar)
Every mode compiles the arguments' schemas the same way as response_format: keywords the grammar backend refuses are
widened and checked exactly where their value closes (hf_attn_patch.grammar: schema_relax.py, schema_checks.py).
Every constraint goes through hf_attn_patch.grammar, so arguments always parse and follow the schema unless the
length limit cut them short: then the call comes back with the arguments generated so far and finish_reason "length"
(as OpenAI and vLLM answer), or as content if even the function's name was cut.
At most one call per answer (parallel_tool_calls is accepted: one call is allowed either way).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .protocol import _short, bad

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
# calls keep declaration order: "name" before "arguments" (forced: fewer model steps), arguments in the order the
# function declares them, as function-calling models write them
ORDER = "schema"


@dataclass
class ToolPlan:
    mode: str  # "none" | "named" | "required" | "auto"
    tools: list[dict]  # [{"type": "function", "function": {"name", "description", "parameters"}}] as validated
    name: str | None = None  # the named function
    grammar: dict | None = None  # for SamplingParams.grammar

    @property
    def active(self) -> bool:
        return self.mode != "none"


def read_tools(body: dict) -> ToolPlan:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise bad("tool_choice", f"{_short(choice)} needs `tools`")
        return ToolPlan("none", [])
    if not isinstance(tools, list) or not 1 <= len(tools) <= MAX_TOOLS:
        raise bad("tools", f"expected a list of 1 to {MAX_TOOLS} function tools, got {_short(tools)}")
    clean, schemas = [], {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
            raise bad(
                "tools",
                f"tools[{i}]: expected {{'type': 'function', 'function': {{name, parameters}}}}, got {_short(tool)}",
            )
        name, params = fn.get("name"), fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad("tools", f"tools[{i}].function.name={_short(name)}: expected 1-64 letters, digits, _ or -")
        if name in schemas:
            raise bad("tools", f"tools[{i}].function.name={name!r} appears twice")
        if not isinstance(params, dict):
            raise bad("tools", f"tools[{i}].function.parameters: expected a JSON Schema object, got {_short(params)}")
        extra = set(fn) - {"name", "description", "parameters", "strict"}
        if extra or not isinstance(fn.get("description", ""), str) or not isinstance(fn.get("strict", False), bool):
            raise bad("tools", f"tools[{i}].function: unknown key or wrong type ({_short(fn)})")
        schemas[name] = params
        clean.append(
            {
                "type": "function",
                "function": {"name": name, "description": fn.get("description", ""), "parameters": params},
            }
        )
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": n}, "arguments": s},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for n, s in schemas.items()
        ]
    }
    if choice is None or choice == "auto":
        return ToolPlan(
            "auto",
            clean,
            grammar={"type": "tagged_json", "schema": call, "open": OPEN, "close": CLOSE, "property_order": ORDER},
        )
    if choice == "none":
        return ToolPlan("none", clean)
    if choice == "required":
        return ToolPlan("required", clean, grammar={"type": "json_schema", "schema": call, "property_order": ORDER})
    name = (
        choice.get("function", {}).get("name")
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
        else None
    )
    if name not in schemas:
        raise bad(
            "tool_choice",
            f"expected 'none', 'auto', 'required' or {{'type': 'function', 'function': {{'name': "
            f"one of {sorted(schemas)}}}}}, got {_short(choice)}",
        )
    return ToolPlan("named", clean, name, {"type": "json_schema", "schema": schemas[name], "property_order": ORDER})


def parse_output(plan: ToolPlan, text: str, cut: bool = False) -> tuple[str | None, list[dict] | None]:
    """The model's text -> (content, tool_calls). cut: the length limit ended it; a call it cut short comes back
    as a call with the arguments generated so far (as OpenAI and vLLM do, beside finish_reason "length"), once the
    function's name is complete; before that, and for text, the text is the content."""
    if plan.mode == "none":
        return text, None
    body = text
    if plan.mode == "auto":
        if not text.startswith(OPEN):
            return text, None
        body = text[len(OPEN) :].removesuffix(CLOSE)
    try:
        if plan.mode == "named":
            json.loads(body)
            return None, [_call(plan.name, body)]
        payload = json.loads(body)
        return None, [_call(payload["name"], json.dumps(payload["arguments"], ensure_ascii=False))]
    except (ValueError, KeyError, TypeError):
        if not cut:
            return text, None
    if plan.mode == "named":
        return None, [_call(plan.name, body)]
    partial = _PARTIAL_CALL.match(body)  # the grammar writes "name" before "arguments" (the schema's order)
    names = {tool["function"]["name"] for tool in plan.tools}
    if partial is None or partial["name"] not in names:
        return text, None
    return None, [_call(partial["name"], partial["arguments"])]


_PARTIAL_CALL = re.compile(
    r'\s*\{\s*"name"\s*:\s*"(?P<name>[A-Za-z0-9_-]+)"\s*,\s*"arguments"\s*:\s*(?P<arguments>.*)\Z', re.S
)


def _call(name: str, arguments: str) -> dict:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
