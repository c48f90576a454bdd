"""SpecForge's conversation parser, run on exported rows as its trainer runs it.

``tests/fixtures/specforge/parse.py`` is SpecForge's ``specforge/data/parse.py``, copied
unchanged. It needs torch and transformers only to tokenise, after the chat template has
rendered the messages; so it is loaded here with stand-ins for those two, and the
tokenizer's ``apply_chat_template`` records what it is handed and stops the parse there.
That call is the boundary: what reaches it is what the target's template renders.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
import warnings
from pathlib import Path
from typing import Any

SPECFORGE = Path(__file__).parent / "fixtures" / "specforge"

# The warning GeneralParser.parse gives for every row with a system prompt: nothing lost.
SYSTEM_NOTE = "The first message is from system"


class Rendered(Exception):
    """Raised by the stand-in tokenizer with what the chat template would render."""

    def __init__(self, messages: list[dict[str, Any]], tools: Any) -> None:
        super().__init__("rendered")
        self.messages, self.tools = messages, tools


class _Tokenizer:
    def apply_chat_template(self, messages: Any, tools: Any = None, **_: Any) -> str:
        raise Rendered(messages, tools)


def _load() -> types.ModuleType:
    """parse.py under a package of its own, torch and transformers stood in for while it
    is imported (it names ``torch.Tensor`` and ``PreTrainedTokenizer`` in signatures)."""
    stand_ins = {
        "torch": types.ModuleType("torch"),
        "transformers": types.ModuleType("transformers"),
        "_specforge_data": types.ModuleType("_specforge_data"),
        "_specforge_data.template": types.ModuleType("_specforge_data.template"),
    }
    stand_ins["torch"].Tensor = object  # type: ignore[attr-defined]
    stand_ins["transformers"].PreTrainedTokenizer = object  # type: ignore[attr-defined]
    stand_ins["_specforge_data"].__path__ = []  # type: ignore[attr-defined]
    stand_ins["_specforge_data.template"].ChatTemplate = object  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)
    try:
        spec = importlib.util.spec_from_file_location(
            "_specforge_data.parse", SPECFORGE / "parse.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old


parse = _load()

TEMPLATE = types.SimpleNamespace(
    system_prompt=None,
    end_of_turn_token="<|im_end|>\n",
    assistant_header="<|im_start|>assistant\n",
    user_header="<|im_start|>user\n",
    assistant_pattern_type=None,
    enable_thinking=False,
)


def render(
    parser_type: str, conversation: list[dict[str, Any]], tools: Any
) -> tuple[list[dict[str, Any]], Any, list[str]]:
    """What SpecForge's parser (``general`` or ``thinking``) hands the chat template for
    one row: the messages, the tools, and the warnings it gave on the way."""
    cls = parse.GeneralParser if parser_type == "general" else parse.ThinkingParser
    parser = cls(_Tokenizer(), TEMPLATE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            parser.parse(conversation, 4096, tool=tools)
        except Rendered as done:
            said = [str(w.message) for w in caught]
            return done.messages, done.tools, said
    raise AssertionError("the parser never reached the chat template")


def offline_row(line: dict[str, Any]) -> dict[str, Any]:
    """A line as ``specforge.utils.safe_conversations_generator`` yields it: conversations,
    each message's list and dict values as JSON text, and ``tools`` as JSON text."""
    turns = [
        {k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in turn.items()}
        for turn in line.get("conversations", [])
        if isinstance(turn, dict)
    ]
    out: dict[str, Any] = {"conversations": turns}
    if "tools" in line:
        tools = line["tools"]
        out["tools"] = json.dumps(tools) if tools is not None else []
    return out


def tools_of(value: Any) -> list[Any]:
    """``build_eagle3_dataset``'s reading of a row's ``tools`` (specforge/data/
    preprocessing.py): JSON text parsed, a list kept, anything else no tools."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return []
    return value if isinstance(value, list) else []


def _arguments(value: Any) -> Any:
    try:
        return json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        return value  # as written: the parser's {} differs


def expected(message: Any, keys: set[str]) -> Any:
    """The exported message as the template should get it: the parser's keys, a null
    content as "", each call's arguments as the object they spell."""
    if not isinstance(message, dict):
        return message
    out = {k: v for k, v in message.items() if k in keys and v is not None}
    out["content"] = message.get("content") or ""
    calls = message.get("tool_calls")
    if calls and isinstance(calls, list):
        out["tool_calls"] = [
            {
                "id": call.get("id", ""),
                "type": call.get("type", "function"),
                "function": {
                    **call["function"],
                    "arguments": _arguments(call["function"].get("arguments", {})),
                },
            }
            if isinstance(call, dict) and isinstance(call.get("function"), dict)
            else call
            for call in calls
        ]
    return out


def losses(line: dict[str, Any], loaded: dict[str, Any]) -> list[str]:
    """What SpecForge's parsers lose of an exported line, given the row its loader made of
    it (``loaded``): every message should reach the template as written, with the tools."""
    if not loaded["conversations"]:
        return ["no messages: preprocess_conversations skips the row"]
    found = []
    want_tools = line.get("tools") or None
    for parser_type, keys in (
        ("general", {"role", "content", "tool_calls"}),
        (
            "thinking",
            {"role", "content", "tool_calls", "reasoning_content", "name", "tool_call_id"},
        ),
    ):
        conversation, offered = loaded["conversations"], tools_of(loaded.get("tools"))
        messages, tools, said = render(parser_type, conversation, offered)
        said = [s for s in said if not s.startswith(SYSTEM_NOTE)]
        if said:
            found.append(f"{parser_type}: {said}")
        got = [{k: v for k, v in m.items() if v is not None or k == "content"} for m in messages]
        want = [expected(m, keys) for m in line["conversations"]]
        if got != want:
            found.append(f"{parser_type}: rendered {got!r}, wrote {want!r}")
        if (tools or None) != want_tools:
            found.append(f"{parser_type}: tools {tools!r}, wrote {want_tools!r}")
    return found
