"""An oracle for exports of runs against the simulated server.

The simulated server's answer is a function of the messages it received
(``orchestrator.sim``: ``request_digest``, ``answer_matches``). This module recomputes,
from an exported line and the input row it came from, the messages every exported answer
must have been asked with, and checks the answer against them. It is written from the
rules as users read them (docs/INPUTS-AND-EXPORTS.md, "Kinds of dataset"), not from
``orchestrator.items.conversation``, so a fault in that module shows here:

* ``last``: the answer to the input without its trailing assistant turns; nothing else
  changes.
* ``all``: every assistant message after the first user message is the model's, and so
  is one more after a final user or tool message. Each was asked with everything before
  it, the earlier answers with their reasoning, and never with its own original.
  Tool results keep their place and content, and answer a call of the assistant turn
  before them. A turn whose calls differ from the original's in number or functions ends
  the conversation when more would follow (flagged ``tool_mismatch``); one that matches
  never does.
* pass-through: the input as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.items.quality import split_think
from orchestrator.sim import answer_matches

Message = dict[str, Any]

_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "tool": "tool"}


@dataclass
class Verdict:
    """What the oracle found in one export: counts, and the first faults (empty: none)."""

    lines: int = 0
    answers: int = 0  # generated assistant turns checked against their requests
    stopped: int = 0  # conversations ended early at a turn whose calls went another way
    renamed: int = 0  # tool results now answering a regenerated call
    faults: list[str] = field(default_factory=list)

    def fault(self, key: str, text: str) -> None:
        if len(self.faults) < 20:
            self.faults.append(f"{key}: {text}")


def from_line(line: Mapping[str, Any], fmt: str) -> list[Message]:
    """The conversation of an exported line, in OpenAI form (``messages``, ShareGPT or
    SpecForge's ``role``/``content`` conversations)."""
    if fmt == "messages":
        return [dict(m) for m in line["messages"]]
    if fmt == "specforge":
        return [dict(m) for m in line["conversations"]]
    out = []
    for turn in line["conversations"]:
        message = {k: v for k, v in turn.items() if k not in ("from", "value")}
        message["role"] = _ROLES.get(turn["from"], turn["from"])
        message["content"] = turn["value"]
        out.append(message)
    return out


def call_functions(message: Mapping[str, Any]) -> list[str]:
    return [c["function"]["name"] for c in message.get("tool_calls") or []]


def _sent_back(message: Message, reasoning: str) -> Message:
    """An exported answer as it was sent back as context: role, content, tool calls, and
    its reasoning (in ``reasoning_content``, the simulated server's field)."""
    content = message.get("content")
    thought = message.get("reasoning_content")
    if reasoning == "inline" and isinstance(content, str):
        thought, content, _ = split_think(content)
    if message.get("tool_calls") and content == "":
        content = None  # a call's empty content is null (ShareGPT writes it as "")
    sent: Message = {"role": "assistant", "content": content}
    if message.get("tool_calls"):
        sent["tool_calls"] = message["tool_calls"]
    if thought is not None:
        sent["reasoning_content"] = thought
    return sent


def _same_original(exported: Message, original: Message, fmt: str) -> bool:
    """A message the run must not change (tool results: but for the call they answer)."""
    mine = {k: v for k, v in exported.items() if k != "tool_call_id"}
    theirs = {k: v for k, v in original.items() if k != "tool_call_id"}
    if fmt == "specforge":
        # An assistant turn always says reasoning_content, null when it had none; a
        # developer message is a system one.
        if mine.get("role") == "assistant" and mine.get("reasoning_content") is None:
            mine.pop("reasoning_content", None)
        if theirs["role"] == "developer":
            theirs["role"] = "system"
    if fmt == "sharegpt":
        # ShareGPT has no developer speaker (a system prompt under its newer name), and
        # writes a null content as "".
        if theirs["role"] == "developer":
            theirs["role"] = "system"
        if theirs.get("content") is None:
            theirs["content"] = ""
    return mine == theirs


def check_reasoning(key: str, answer: Message, sim_reasoning: str, mode: str, v: Verdict) -> None:
    """The answer's thinking is where the export's ``--reasoning`` mode puts it."""
    if sim_reasoning == "none":
        return
    content = answer.get("content")
    if mode == "separate" and not answer.get("reasoning_content"):
        v.fault(key, "reasoning_content missing")
    elif mode == "inline" and not (isinstance(content, str) and content.startswith("<think>")):
        v.fault(key, f"reasoning not inlined: {content!r:.80}")
    elif mode == "drop" and (
        answer.get("reasoning_content") is not None or "<think>" in (content or "")
    ):  # SpecForge's assistant turns say reasoning_content always, null when dropped
        v.fault(key, "reasoning not dropped")


def check_all(
    key: str,
    original: Sequence[Message],
    exported: Sequence[Message],
    fmt: str,
    reasoning: str,
    sim_reasoning: str,
    v: Verdict,
) -> None:
    """One ``regenerate = "all"`` conversation, walked front to back beside its input."""
    first_user = next(i for i, m in enumerate(original) if m["role"] == "user")
    answered = original[-1]["role"] != "assistant"  # a final user or tool turn is answered
    full = len(original) + (1 if answered else 0)
    if not 0 < len(exported) <= full:
        v.fault(key, f"{len(exported)} messages exported of {full}")
        return
    asked: list[Message] = []
    offered: list[str] = []
    for i, message in enumerate(exported):
        generated = i == len(original) or (i > first_user and original[i]["role"] == "assistant")
        if not generated:
            if not _same_original(message, original[i], fmt):
                v.fault(key, f"message {i} changed: {message!r:.120}")
            if message["role"] == "tool":
                if message.get("tool_call_id") not in offered:
                    v.fault(key, f"tool result {i} answers no call: {message.get('tool_call_id')}")
                elif message.get("tool_call_id") != original[i].get("tool_call_id"):
                    v.renamed += 1
                asked.append({**original[i], "tool_call_id": message.get("tool_call_id")})
            else:
                offered = [c["id"] for c in message.get("tool_calls") or []]
                asked.append(dict(original[i]))
            continue
        v.answers += 1
        if message["role"] != "assistant" or not answer_matches(asked, message):
            v.fault(key, f"answer {i} was not asked with the conversation before it")
        check_reasoning(key, message, sim_reasoning, reasoning, v)
        offered = [c["id"] for c in message.get("tool_calls") or []]
        later = i + 1 < full
        differs = i < len(original) and call_functions(message) != call_functions(original[i])
        last = i == len(exported) - 1
        if later and differs and not last:
            v.fault(key, f"turn at {i} went another way, yet the conversation went on")
        if last and len(exported) < full:
            if not differs:
                v.fault(key, f"ended at {i} of {full}, though its calls matched")
            v.stopped += 1
        asked.append(_sent_back(message, reasoning))


def check_export(
    lines: Iterable[Mapping[str, Any]],
    inputs: Mapping[str, Mapping[str, Any]],
    *,
    modes: Mapping[str, str],
    fmt: str = "messages",
    reasoning: str = "separate",
    sim_reasoning: str = "none",
) -> Verdict:
    """Check every exported line of the ``messages`` or ``sharegpt`` format.

    ``inputs`` maps each key to its input row (``{"messages": [...]}``), ``modes`` each
    dataset to ``last``, ``all`` or ``passthrough``; keys start with their dataset's
    name and a dash (ShareGPT lines name no dataset).
    """
    v = Verdict()
    for line in lines:
        v.lines += 1
        key = key_of(line, inputs)
        original = inputs[key]["messages"]
        exported = from_line(line, fmt)
        mode = modes[line.get("dataset") or dataset_of(key, modes)]
        if mode == "passthrough":
            if not all(_same_original(e, o, fmt) for e, o in zip(exported, original, strict=False)):
                v.fault(key, "pass-through row changed")
            if len(exported) != len(original):
                v.fault(key, "pass-through row cut")
        elif mode == "last":
            prompt = list(original)
            while prompt and prompt[-1]["role"] == "assistant":
                prompt.pop()
            *before, answer = exported
            if len(before) != len(prompt) or not all(
                _same_original(e, o, fmt) for e, o in zip(before, prompt, strict=True)
            ):
                v.fault(key, "the prompt of a last-turn answer changed")
            v.answers += 1
            if not answer_matches(prompt, answer):
                v.fault(key, "the answer was not asked with its prompt")
            check_reasoning(key, answer, sim_reasoning, reasoning, v)
        else:
            check_all(key, original, exported, fmt, reasoning, sim_reasoning, v)
    return v


def check_batch(
    lines: Iterable[Mapping[str, Any]], conversations: Mapping[str, Sequence[Message]]
) -> Verdict:
    """Check ``openai-batch`` lines: each answer is the last turn of its conversation as
    the (checked) ``messages`` export has it."""
    v = Verdict()
    for line in lines:
        v.lines += 1
        key = key_of(line, conversations)
        message = line["response"]["body"]["choices"][0]["message"]
        if message != conversations[key][-1]:
            v.fault(key, "the batch answer is not the conversation's last turn")
    return v


def key_of(line: Mapping[str, Any], inputs: Mapping[str, Any]) -> str:
    """The input key of an exported line (a combined export may prefix it with the
    dataset's name, ``name/key``)."""
    found = line["custom_id"] if "custom_id" in line else line["id"]
    if found not in inputs and "/" in found:
        found = found.split("/", 1)[1]
    if found not in inputs:
        raise KeyError(f"{line['id']}: no such input row")
    return found


def dataset_of(key: str, modes: Mapping[str, str]) -> str:
    """The dataset of a key: these tests' keys start with it (``name-…``)."""
    name = key.rsplit("-", 1)[0]
    if name not in modes:
        raise KeyError(f"{key}: no dataset named by the key")
    return name


# ---------------------------------------------------------------- tokens and logprobs
# The simulated server's tokens, from its documented rule (orchestrator/sim/logprobs.py's
# docstring), written again here rather than imported: position i of the answer to a
# request of digest D is token u32(h[0:4]) % 32000 at logprob -(u16(h[4:6]) % 512) / 64,
# h = sha256(f"{D}:{i}"); its k alternatives are itself, then (id + 7919 j) % 32000 at
# logprob - j / 4; an alternative's text is " t<id>".


def sim_token(digest: str, i: int) -> tuple[int, float]:
    import hashlib

    h = hashlib.sha256(f"{digest}:{i}".encode()).digest()
    return int.from_bytes(h[:4], "little") % 32000, -(int.from_bytes(h[4:6], "little") % 512) / 64


def check_tokens(key: str, line: Mapping[str, Any], asked: Any, k: int, v: Verdict) -> None:
    """An exported line's token columns (``export --logprobs --token-ids``) against the
    answer the simulator gave to ``asked`` (the messages, or a raw completion's prompt):
    one entry per generated token, each id and logprob its rule's, the top ``k`` in order.
    With ids exported, no texts; without, the texts spell the answer."""
    from orchestrator.sim import request_digest

    digest = request_digest(asked)
    n = line["usage"]["completion_tokens"]
    want = [sim_token(digest, i) for i in range(n)]
    if line["token_logprobs"] != [lp for _, lp in want]:
        v.fault(key, "token logprobs differ from the answer's")
    tops = line["top_logprobs"]
    if tops != [[lp - j / 4 for j in range(k)] for _, lp in want]:
        v.fault(key, "top logprobs differ from the answer's")
    ids = line.get("token_ids")
    if ids is not None:
        if ids != [t for t, _ in want]:
            v.fault(key, "token ids differ from the answer's")
        if "tokens" in line:
            v.fault(key, "token texts exported beside their ids")
    else:
        text = line.get("completion")
        if text is None:
            text = line["messages"][-1]["content"]
        if "".join(line["tokens"]) != text:
            v.fault(key, "token texts do not spell the answer")
    if "top_tokens" in line:
        alternatives = [[f" t{(t + 7919 * j) % 32000}" for j in range(1, k)] for t, _ in want]
        if [row[1:] for row in line["top_tokens"]] != alternatives:
            v.fault(key, "top token texts differ from the answer's")
    elif line.get("top_token_ids") != [[(t + 7919 * j) % 32000 for j in range(k)] for t, _ in want]:
        v.fault(key, "top token ids differ from the answer's")
    v.answers += 1
