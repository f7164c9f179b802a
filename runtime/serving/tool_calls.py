"""Tool calling for /v1/chat/completions: OpenAI's `tools` / `tool_choice` rendered through the
model's own chat template, and the model's tool-call text parsed back into OpenAI `tool_calls`,
whole or as streamed deltas.

Formats (picked from the chat template, like vLLM's `--tool-call-parser`):
  hermes       Qwen2.5 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one
               block per call, possibly after some text (the message's content)
  llama3_json  Llama-3.1 / 3.2: the whole answer is `{"name": ..., "parameters": {...}}` (several
               joined by "; "), possibly after `<|python_tag|>`

tool_choice:
  "none"       tools are not shown to the model, the output is plain text
  "auto"       tools rendered; the output is parsed (text that is not a call stays content); needs
               a chat template that renders tools
  "required"   tools rendered; a grammar forces one or more calls in the model's format (hermes
               when the template has none); exactly one with parallel_tool_calls false
  {"type": "function", "function": {"name": N}}  a grammar forces N's arguments: the whole
               output is the arguments object (vLLM's way), answered as one call of N
Forced calls use structured output (runtime/structured_output.py), so "required" and a named
function work on any engine with a tokenizer.

    >>> plan = ToolCallPlan.of([WEATHER], "auto", "... <tool_call> ...")     # doctest: +SKIP
    >>> plan.parse('<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>')
    (None, [{'id': 'call_...', 'type': 'function', 'function': {'name': 'get_weather', 'arguments': '{"city": "Paris"}'}}])
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from infhip.runtime.structured_output import StructuredOutputsParams

HERMES, LLAMA3 = "hermes", "llama3_json"
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# The head of a hermes call block up to its arguments' value: once it has come, the call opens
# (id, name) and the arguments stream as they grow.
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def detect_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, or None (it renders no tools)."""
    t = chat_template or ""
    if _OPEN in t:
        return HERMES
    if _PYTHON_TAG in t or ("tools" in t and '"parameters"' in t):
        return LLAMA3
    return None


def _call(name: str, arguments) -> dict:
    """An OpenAI tool call; arguments: a dict (dumped as JSON) or JSON text (kept as it is)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def _json_calls(text: str, args_key: str) -> list[dict] | None:
    """The calls in text made of JSON objects {"name", args_key} (separated by whitespace, "," or
    ";"), or None if text is anything else."""
    dec, i, calls = json.JSONDecoder(), 0, []
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i == len(text):
            return calls or None
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        args = obj.get(args_key, obj.get("arguments", obj.get("parameters"))) if isinstance(obj, dict) else None
        if not isinstance(obj.get("name") if isinstance(obj, dict) else None, str) or not isinstance(args, (dict, str)):
            return None
        calls.append(_call(obj["name"], args))


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """(content or None, calls). Blank space next to a call block is dropped (text before a call
    loses its trailing blanks, text after one its leading blanks; with calls, the end is
    stripped too); a block that is not a valid call stays content as written."""
    calls, pieces, rest = [], [], text
    while _OPEN in rest:
        before, _, after = rest.partition(_OPEN)
        body, closed, rest = after.partition(_CLOSE)
        parsed = _json_calls(body, "arguments")
        if parsed is None:
            pieces.append(before + _OPEN + body + closed)
            continue
        pieces.append(before.rstrip())
        calls += parsed
        rest = rest.lstrip()
    pieces.append(rest.rstrip() if calls else rest)
    return "".join(pieces) or None, calls


def parse_llama3(text: str) -> tuple[str | None, list[dict]]:
    """The whole answer as calls, or as content if it is not one."""
    body = text.strip()
    body = body[len(_PYTHON_TAG):] if body.startswith(_PYTHON_TAG) else body
    calls = _json_calls(body, "parameters") if body.startswith("{") else None
    return (None, calls) if calls else (text or None, [])


@dataclass
class ToolCallPlan:
    """How one chat request handles tools: what the template gets, what constrains the output,
    how the output is read."""

    tools: list[dict] | None  # for the chat template (None: not rendered)
    fmt: str | None  # HERMES | LLAMA3 | None (plain text)
    named: str | None = None  # tool_choice named this function: the output is its arguments
    structured_outputs: StructuredOutputsParams | None = None  # the grammar forcing a call

    @classmethod
    def of(cls, tools: list[dict] | None, tool_choice, chat_template: str | None,
           parallel: bool = True) -> ToolCallPlan | None:
        """The plan of a request's tools / tool_choice, None if it has no tools to handle;
        ValueError (the client's mistake, with what to send) for bad ones. parallel: OpenAI's
        parallel_tool_calls (False: "required" forces exactly one call)."""
        if tool_choice is not None and not tools:
            raise ValueError("tool_choice needs tools: send \"tools\" with it, or leave tool_choice out")
        if not tools:
            return None
        funcs = _check_tools(tools)
        choice = "auto" if tool_choice is None else tool_choice
        if choice == "none":
            return None
        fmt = detect_format(chat_template)
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            if name not in funcs:
                raise ValueError(f"tool_choice must be \"none\", \"auto\", \"required\" or "
                                 f"{{\"type\": \"function\", \"function\": {{\"name\": one of {sorted(funcs)}}}}}; "
                                 f"got {json.dumps(choice)[:200]}")
            return cls(tools, fmt, name, StructuredOutputsParams(json=funcs[name]))
        if choice == "auto":
            if fmt is None:
                raise ValueError("this model's chat template does not render tools, so tool_choice \"auto\" "
                                 "cannot work; send tool_choice \"required\" or a named function (a grammar "
                                 "then forces the call)")
            return cls(tools, fmt)
        if choice == "required":
            fmt = fmt or HERMES
            return cls(tools, fmt, None, StructuredOutputsParams(structural_tag=_forced_calls(funcs, fmt, parallel)))
        raise ValueError(f"tool_choice must be \"none\", \"auto\", \"required\" or a named function, got {choice!r}")

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """(message content, tool calls) of a whole answer."""
        if self.named is not None:
            return None, [_call(self.named, text)]
        return parse_hermes(text) if self.fmt == HERMES else parse_llama3(text)

    def finish_reason(self, calls: list[dict], reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model called tools (not for a named tool_choice, which
        answers "stop"), "length" stays."""
        return "tool_calls" if calls and self.named is None and reason == "stop" else reason

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


def _check_tools(tools) -> dict[str, dict]:
    """name -> parameters schema of OpenAI function tools; ValueError naming the bad one."""
    funcs = {}
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             f"\"parameters\": {{JSON schema}}}}}}, got {json.dumps(t)[:200]}")
        params = f.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        funcs[f["name"]] = params
    return funcs


def _forced_calls(funcs: dict[str, dict], fmt: str, parallel: bool) -> dict:
    """An xgrammar structural tag: one or more calls (one if not parallel) of these functions in
    fmt, nothing else."""
    if fmt == HERMES:
        begin, end, sep = '<tool_call>\n{{"name": {}, "arguments": ', "}\n</tool_call>", "\n"
    else:
        begin, end, sep = '{{"name": {}, "parameters": ', "}", "; "
    tags = [{"type": "tag", "begin": begin.format(json.dumps(name, ensure_ascii=False)), "end": end,
             "content": {"type": "json_schema", "json_schema": schema}} for name, schema in funcs.items()]
    fmt = ({"type": "tags_with_separator", "tags": tags, "separator": sep, "at_least_one": True} if parallel
           else {"type": "or", "elements": tags})
    return {"type": "structural_tag", "format": fmt}


class ToolCallStream:
    """The incremental parser of one streamed answer: feed() each text delta, then finish();
    each returns (content text to send now, OpenAI tool_calls delta items).

    hermes: text goes out as content until `<tool_call>` (a tail that may begin one is held
    back); a call opens (index, id, name, arguments "") as soon as its head `{"name": ...,
    "arguments": ` has come, then its arguments object streams as it grows (vLLM's hermes parser
    does the same), holding back a tail that may be the block's own closing `}` or
    `</tool_call>`; at `</tool_call>` the rest of the arguments' text goes out. A block whose
    head never matches goes out whole at its end, as a call or (not JSON) as content; one that
    opened and then is not JSON ends the call with the arguments sent so far. llama3_json: an
    answer whose first non-blank character starts a call is held to the end, then parsed. A
    named function: the first delta opens the call (id, name), the text follows as arguments."""

    def __init__(self, plan: ToolCallPlan):
        self.plan, self.buf, self.calls = plan, "", 0
        self.in_call, self.ws, self.skip_ws = False, "", False  # hermes (_hermes)
        self.opened: int | None = None  # hermes: index of the call streaming its arguments now
        self.args_start = 0  # where its arguments' value starts in self.buf
        self.args_sent = ""  # of its arguments' text, what went out
        self.held: bool | None = None  # llama3_json: holding the whole answer (None: undecided)

    def _item(self, call: dict) -> dict:
        self.calls += 1
        return {"index": self.calls - 1, **call}

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.plan.named is not None:
            if self.calls == 0:
                head = self._item(_call(self.plan.named, ""))
                head["function"]["arguments"] = text
                return "", [head]
            return "", ([{"index": 0, "function": {"arguments": text}}] if text else [])
        self.buf += text
        return self._hermes() if self.plan.fmt == HERMES else self._llama3()

    def finish(self) -> tuple[str, list[dict]]:
        if self.plan.named is not None:
            return "", ([] if self.calls else [self._item(_call(self.plan.named, ""))])
        rest, self.buf = self.buf, ""
        if self.plan.fmt == HERMES:
            if self.in_call:  # no </tool_call>: the answer ended inside a block
                out = []
                items = self._close(rest, out)
                return "".join(out), items
            text = self.ws + (rest.lstrip() if self.skip_ws else rest)
            return (text.rstrip() if self.calls else text), []
        if not self.held:
            return rest, []
        content, calls = parse_llama3(rest)
        return content or "", [self._item(c) for c in calls]

    def _hermes(self) -> tuple[str, list[dict]]:
        """parse_hermes, incrementally: blanks that may turn out to be next to a call are held
        (self.ws) until the next text says whether they are."""
        out, items = [], []
        while True:
            if self.in_call:
                body, closed, after = self.buf.partition(_CLOSE)
                if not closed:
                    items += self._grow()
                    break
                items += self._close(body + closed, out)
                self.buf = after
                continue
            if self.skip_ws:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.skip_ws = False
            before, opened, after = self.buf.partition(_OPEN)
            keep = 0 if opened else _partial_suffix(before, _OPEN)
            text = self.ws + before[:len(before) - keep]
            out.append(text.rstrip())
            self.ws = text[len(text.rstrip()):]
            self.buf = after if opened else before[len(before) - keep:]
            self.in_call = bool(opened)
            if not opened:
                break
        return "".join(out), items

    def _grow(self) -> list[dict]:
        """The open call block's head (once) and the arguments' text that came since."""
        items = []
        if self.opened is None:
            head = _HERMES_HEAD.match(self.buf)
            if head is None or not self.buf[head.end():].lstrip().startswith("{"):
                return []  # not (yet) a call whose arguments are an object: wait for its end
            try:
                name = json.loads(head.group(1))
            except json.JSONDecodeError:
                return []
            items.append(self._item(_call(name, "")))
            self.opened, self.args_start, self.args_sent = self.calls - 1, head.end(), ""
        raw = self.buf[self.args_start:]
        raw = raw[:len(raw) - _partial_suffix(raw, _CLOSE)].rstrip()
        if raw.endswith("}"):  # may be the block's own closing brace: held until more comes
            raw = raw[:-1].rstrip()
        if len(raw) > len(self.args_sent) and raw.startswith(self.args_sent):
            items.append({"index": self.opened, "function": {"arguments": raw[len(self.args_sent):]}})
            self.args_sent = raw
        return items

    def _close(self, block: str, out: list[str]) -> list[dict]:
        """A call block read to its end (block: after <tool_call>, with </tool_call> if it came)."""
        self.in_call = False
        content, calls = parse_hermes(_OPEN + block)
        opened, self.opened = self.opened, None
        if opened is not None:  # its head and part of its arguments went out already
            items = []
            try:
                _, end = json.JSONDecoder().raw_decode(block, self.args_start)
                rest = block[self.args_start:end][len(self.args_sent):]
            except json.JSONDecodeError:
                rest = ""  # not JSON after all: the call keeps what was sent
            if rest:
                items.append({"index": opened, "function": {"arguments": rest}})
            self.ws, self.skip_ws = "", True
            return items + [self._item(c) for c in calls[1:]]
        if not calls:  # not a call: the held blanks and the block are content
            out.append(self.ws + _OPEN + block)
        self.ws, self.skip_ws = "", bool(calls)
        return [self._item(c) for c in calls]

    def _llama3(self) -> tuple[str, list[dict]]:
        if self.held is None:
            head = self.buf.lstrip()
            if not head or (_PYTHON_TAG.startswith(head) and len(head) < len(_PYTHON_TAG)):
                return "", []  # undecided: only blanks or the start of <|python_tag|> so far
            self.held = head.startswith("{") or head.startswith(_PYTHON_TAG)
        if self.held:
            return "", []
        out, self.buf = self.buf, ""
        return out, []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that is a proper start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages as chat templates read them: an assistant's tool_calls arguments as
    objects (templates write them with `tojson`; OpenAI sends JSON text)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_template_call(c) for c in calls]}
        out.append(m)
    return out


def _template_call(c: dict) -> dict:
    f = dict(c.get("function") or {})
    if isinstance(f.get("arguments"), str):
        try:
            f["arguments"] = json.loads(f["arguments"])
        except json.JSONDecodeError:
            pass  # the template writes it as it is
    return {**c, "function": f}
