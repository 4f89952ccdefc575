"""The real Inkling's chat format: messages -> token ids (INKLING_SERVING.md §3.3).

    renderer = ChatRenderer(tokenizer)
    prompt = renderer.render(messages, tools=tools, reasoning_effort="high")
    processed = processor.chat(prompt)          # each placeholder expanded to its media's count

Every block is `role-token [author] content-kind-token text <|end_message|>`, one per part:
- tool declarations first: `<|message_system|>tool_declare<|content_xml|>` + compact JSON with sorted
  keys of `[{"description", "name", "parameters", "type": "function"}]`;
- the leading system messages, then `<|message_system|><|content_text|>Thinking effort level: X`
  (X in [0, 0.99], to the thousandth; default 0.9; named levels in EFFORT_LEVELS), then the rest;
- user and system text `<|content_text|>`; an image `<|content_image|>` + one placeholder (200054), an
  audio clip `<|content_audio_input|>` + one placeholder (200053) + `<|audio_end|>`, each its own block:
  the processor expands a placeholder to the item's patch or frame count;
- a historical model turn: its thinking (`<|content_thinking|>`), text, and tool calls (author = the
  tool's name, `<|content_invoke_tool_json|>` + `{"args":{...},"name":...}` compact and sorted), closed
  by `<|content_model_end_sampling|>`;
- a tool result `<|message_tool|>NAME<|content_text|>...`, its name from `name` or the call it answers;
- the generation prompt `<|message_model|>`.

Where the public sources differ, the checkpoint's shipped template wins: it sorts the tool call's keys
(`args` before `name`), as MLX ports quoting it show; SGLang's renderer writes `name` first.

Text is encoded with the tokenizer's special tokens switched off, so content that spells a control
token (`<|message_model|>`) stays text and cannot forge structure. The same format ships as
`chat_template.jinja` (written into our checkpoints and engines) for tools that render with
transformers' `apply_chat_template`; it renders the same ids for content without control-token
spellings (tests/unit/test_published_chat.py), and is rendered here with `render_template`.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from ..processing.errors import ProcessingError

EFFORT_LEVELS = {
    "none": 0.0,
    "minimal": 0.1,
    "low": 0.2,
    "medium": 0.7,
    "high": 0.9,
    "xhigh": 0.95,
    "max": 0.99,
}
DEFAULT_EFFORT = 0.9
MAX_EFFORT = 0.99
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_PATH = os.path.join(os.path.dirname(__file__), TEMPLATE_FILE)

ROLE_TOKENS = {
    "system": "<|message_system|>",
    "user": "<|message_user|>",
    "assistant": "<|message_model|>",
    "tool": "<|message_tool|>",
}
KIND_TOKENS = {
    "text": "<|content_text|>",
    "thinking": "<|content_thinking|>",
    "xml": "<|content_xml|>",
    "invoke_tool_json": "<|content_invoke_tool_json|>",
    "image": "<|content_image|>",
    "audio": "<|content_audio_input|>",
}
END_MESSAGE, END_SAMPLING, AUDIO_END = "<|end_message|>", "<|content_model_end_sampling|>", "<|audio_end|>"
IMAGE_SLOT, AUDIO_SLOT = "<|unused_200054|>", "<|unused_200053|>"
IMAGE_PARTS = frozenset({"image", "image_url", "input_image"})
AUDIO_PARTS = frozenset({"audio", "input_audio", "audio_url"})


class ChatError(ProcessingError):
    """Messages, tools or an effort setting that the chat format cannot render."""


@dataclass
class ChatPrompt:
    """A rendered conversation: ids with one placeholder per media item, and the items in order
    (encoded file bytes, or None for an item whose data travels beside the messages)."""

    input_ids: list[int]
    images: list[bytes | None] = field(default_factory=list)
    audios: list[bytes | None] = field(default_factory=list)


def effort_value(effort: str | float | None) -> float:
    """A named level or a number in [0, 0.99] -> the number; None -> the default."""
    if effort is None:
        return DEFAULT_EFFORT
    if isinstance(effort, str):
        name = effort.strip().lower()
        if name in EFFORT_LEVELS:
            return EFFORT_LEVELS[name]
        try:
            effort = float(name)
        except ValueError:
            raise ChatError(
                f"reasoning_effort {effort!r} is neither a number nor one of {', '.join(EFFORT_LEVELS)}"
            ) from None
    if isinstance(effort, bool) or not isinstance(effort, (int, float)):
        raise ChatError(f"reasoning_effort must be a number or a level name, not {type(effort).__name__}")
    value = float(effort)
    if not math.isfinite(value) or not 0.0 <= value <= MAX_EFFORT:
        raise ChatError(f"reasoning_effort {effort} is outside [0, {MAX_EFFORT}]")
    return value


def effort_text(effort: str | float | None) -> str:
    """The effort system block's text, the value to the thousandth as the published renderers write it."""
    return f"Thinking effort level: {round(effort_value(effort) * 1000) / 1000}"


def canonical_json(value: Any) -> str:
    """Compact JSON with sorted keys at every depth, non-ASCII kept: how the format writes tools."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"), sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ChatError(f"not JSON-serialisable: {e}") from e


def tool_declarations(tools: Sequence[Any]) -> str:
    """OpenAI-style tools ({"type": "function", "function": {...}}, or the function itself) -> the
    tool_declare block's JSON."""
    specs = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ChatError(f"tools[{i}] must be an object")
        function = tool.get("function", tool)
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatError(f"tools[{i}] needs a function with a string name")
        specs.append({
            "description": function.get("description") or "",
            "name": function["name"],
            "parameters": function.get("parameters") or {},
            "type": tool.get("type", "function"),
        })  # fmt: skip
    return canonical_json(specs)


def tool_call_json(name: str, args: Mapping[str, Any]) -> str:
    return canonical_json({"args": args, "name": name})


def _tool_call(call: Any, where: str) -> tuple[str, Mapping[str, Any]]:
    if not isinstance(call, Mapping):
        raise ChatError(f"{where} must be an object")
    function = call.get("function", call)
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not name:
        raise ChatError(f"{where} needs a function name")
    args = function.get("arguments", function.get("args")) or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ChatError(f"{where}.function.arguments is not JSON: {e}") from e
    if not isinstance(args, Mapping):
        raise ChatError(f"{where}.function.arguments must be a JSON object")
    return name, args


def _media_bytes(part: Mapping[str, Any], kind: str, where: str) -> bytes | None:
    """The encoded file a media part carries (a data: URL or base64), None if it carries none."""
    value = part.get(part["type"], part.get("data"))
    if isinstance(value, Mapping):
        value = value.get("url", value.get("data"))
    if value is None or value == "":
        return None
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if not isinstance(value, str):
        raise ChatError(f"{where}: the {kind} must be a data: URL or base64 text")
    if value.startswith(("http://", "https://", "file:")):
        raise ChatError(f"{where}: remote {kind} URLs are not fetched; send the file as a data: URL")
    if value.startswith("data:"):
        header, sep, value = value.partition(",")
        if not sep or ";base64" not in header:
            raise ChatError(f"{where}: a data: URL must be base64 (data:<type>;base64,<data>)")
    try:
        data = base64.b64decode("".join(value.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise ChatError(f"{where}: the {kind} is not valid base64: {e}") from e
    if not data:
        raise ChatError(f"{where}: the {kind} is empty")
    return data


def _parts(content: Any, where: str) -> list[tuple[str, Any]]:
    """A message's content -> ordered (kind, text or media bytes) parts."""
    if content is None:
        return []
    if isinstance(content, str):
        return [("text", content)] if content else []
    if not isinstance(content, Sequence):
        raise ChatError(f"{where}.content must be a string or a list of parts")
    parts = []
    for i, part in enumerate(content):
        at = f"{where}.content[{i}]"
        if isinstance(part, str):
            parts.append(("text", part))
            continue
        if not isinstance(part, Mapping):
            raise ChatError(f"{at} must be a string or an object")
        kind = part.get("type", "text")
        if kind in ("text", "input_text"):
            if not isinstance(part.get("text", ""), str):
                raise ChatError(f"{at}.text must be a string")
            parts.append(("text", part.get("text", "")))
        elif kind in ("thinking", "reasoning"):
            text = part.get("thinking", part.get("text", ""))
            if not isinstance(text, str):
                raise ChatError(f"{at}.thinking must be a string")
            parts.append(("thinking", text))
        elif kind in IMAGE_PARTS:
            parts.append(("image", _media_bytes(part, "image", at)))
        elif kind in AUDIO_PARTS:
            parts.append(("audio", _media_bytes(part, "audio", at)))
        else:
            raise ChatError(f"{at}: unknown part type {kind!r}")
    return parts


class ChatRenderer:
    """Messages -> ids in the published chat format, with the tokenizer a checkpoint ships."""

    def __init__(self, tokenizer: Tokenizer):
        self.content_tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self.content_tokenizer.encode_special_tokens = True  # content never forms control tokens
        names = [*ROLE_TOKENS.values(), *KIND_TOKENS.values(), END_MESSAGE, END_SAMPLING, AUDIO_END,
                 IMAGE_SLOT, AUDIO_SLOT]  # fmt: skip
        self.ids = {}
        for name in names:
            token_id = tokenizer.token_to_id(name)
            if token_id is None:
                raise ValueError(
                    f"the tokenizer has no {name} token: not the Inkling chat format's tokenizer"
                )
            self.ids[name] = token_id

    def encode(self, text: str) -> list[int]:
        return self.content_tokenizer.encode(text, add_special_tokens=False).ids if text else []

    def _block(self, out: ChatPrompt, role: str, kind: str, value: Any = "", author: str = "") -> None:
        ids = out.input_ids
        ids.append(self.ids[ROLE_TOKENS[role]])
        ids += self.encode(author)
        ids.append(self.ids[KIND_TOKENS[kind]])
        if kind == "image":
            ids.append(self.ids[IMAGE_SLOT])
            out.images.append(value)
        elif kind == "audio":
            ids += [self.ids[AUDIO_SLOT], self.ids[AUDIO_END]]
            out.audios.append(value)
        else:
            ids += self.encode(value)
        ids.append(self.ids[END_MESSAGE])

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Any] | None = None,
        reasoning_effort: str | float | None = None,
        add_generation_prompt: bool = True,
    ) -> ChatPrompt:
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ChatError("messages must be a non-empty list of {role, content} objects")
        out, call_names = ChatPrompt([]), {}
        effort = effort_text(reasoning_effort)
        if tools:
            if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
                raise ChatError("tools must be a list")
            self._block(out, "system", "xml", tool_declarations(tools), author="tool_declare")
        roles = []
        for i, m in enumerate(messages):
            role = m.get("role") if isinstance(m, Mapping) else None
            role = "assistant" if role == "model" else role
            if role not in ROLE_TOKENS:
                raise ChatError(f"messages[{i}].role must be one of {', '.join(ROLE_TOKENS)}, not {role!r}")
            roles.append(role)
        leading = next((i for i, r in enumerate(roles) if r != "system"), len(roles))
        for i, (m, role) in enumerate(zip(messages, roles)):
            if i == leading:
                self._block(out, "system", "text", effort)
            self._message(out, m, role, f"messages[{i}]", call_names)
        if leading == len(roles):
            self._block(out, "system", "text", effort)
        if add_generation_prompt:
            out.input_ids.append(self.ids[ROLE_TOKENS["assistant"]])
        return out

    def _message(self, out: ChatPrompt, m: Mapping, role: str, where: str, call_names: dict) -> None:
        if role == "tool":
            content = m.get("content") or ""
            if isinstance(content, Sequence) and not isinstance(content, str):
                parts = _parts(content, where)
                if any(kind != "text" for kind, _ in parts):
                    raise ChatError(f"{where}: a tool result holds text only")
                content = "".join(text for _, text in parts)
            if not isinstance(content, str):
                raise ChatError(f"{where}.content must be text")
            name = m.get("name") or call_names.get(m.get("tool_call_id") or "", "")
            self._block(out, "tool", "text", content, author=str(name))
            return
        parts = _parts(m.get("content"), where)
        start = len(out.input_ids)
        if role == "assistant":
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning:
                if not isinstance(reasoning, str):
                    raise ChatError(f"{where}.reasoning_content must be a string")
                if any(kind == "thinking" for kind, _ in parts):
                    raise ChatError(f"{where}: reasoning_content beside thinking parts: send one of them")
                self._block(out, "assistant", "thinking", reasoning)
        elif any(kind == "thinking" for kind, _ in parts):
            raise ChatError(f"{where}: thinking parts belong to assistant messages")
        for kind, value in parts:
            self._block(out, role, kind, value)
        if role != "assistant":
            if m.get("tool_calls"):
                raise ChatError(f"{where}: only assistant messages make tool calls")
            return
        for j, call in enumerate(m.get("tool_calls") or []):
            name, args = _tool_call(call, f"{where}.tool_calls[{j}]")
            if isinstance(call, Mapping) and call.get("id"):
                call_names[str(call["id"])] = name
            self._block(out, "assistant", "invoke_tool_json", tool_call_json(name, args), author=name)
        if len(out.input_ids) > start:  # never a bare end-of-sampling for an empty turn
            out.input_ids.append(self.ids[END_SAMPLING])


def read_template(path: str | os.PathLike = TEMPLATE_PATH) -> str:
    with open(path) as f:
        return f.read()


def render_template(template: str, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
    """A chat template rendered as transformers' apply_chat_template renders it: jinja2's immutable
    sandbox, trim_blocks and lstrip_blocks, loop controls, `tojson` and `raise_exception`."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(messages=messages, **kwargs)
    except TemplateError as e:
        raise ChatError(f"the chat template refused the messages: {e}") from e
