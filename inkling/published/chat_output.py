"""The model's output in the chat format -> visible text, thinking and tool calls, as it streams.

    parser = ChatOutputParser(tokenizer)
    for ids in deltas:
        d = parser.feed(ids)        # ChatDelta: content, thinking, tool calls completed in these ids
    d = parser.finish()             # what is left at the end of the stream

The prompt ends with `<|message_model|>`, so the stream starts inside a block's header. A model turn is
blocks of `[<|message_model|> [author]] kind-token text <|end_message|>`, ended by
`<|content_model_end_sampling|>` (the EOS, usually held back by the engine): `<|content_thinking|>` is
thinking, `<|content_text|>` (and `<|content_xml|>`) visible text, `<|content_invoke_tool_json|>` a tool
call whose body is `{"args": {...}, "name": ...}` (the block's author is the name where the body has
none). A tool call's body that is not a JSON object stays visible text, so nothing the model wrote is
lost. Text outside any block (a model that skips the kind token) counts as visible text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from ..detokenizer import IncrementalDetokenizer
from .chat import END_MESSAGE, END_SAMPLING, KIND_TOKENS, ROLE_TOKENS

TOOL_TEXT = "<|content_invoke_tool_text|>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the call's args, as OpenAI's tool_calls carry them
    index: int

    def to_dict(self) -> dict[str, Any]:
        return {"id": f"call_{self.index}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


@dataclass
class ChatDelta:
    content: str = ""
    thinking: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: ChatDelta) -> ChatDelta:
        self.content += other.content
        self.thinking += other.thinking
        self.tool_calls += other.tool_calls
        return self


class ChatOutputParser:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        ids = lambda names: {tokenizer.token_to_id(n) for n in names} - {None}  # noqa: E731
        self.role_ids = ids(ROLE_TOKENS.values())
        self.end_ids = ids([END_MESSAGE, END_SAMPLING])
        by_id = {tokenizer.token_to_id(t): kind for kind, t in KIND_TOKENS.items()}
        # no public source says what a <|content_invoke_tool_text|> body holds: it stays visible text
        by_id[tokenizer.token_to_id(TOOL_TEXT)] = "text"
        self.kind_of = {i: kind for i, kind in by_id.items() if i is not None}
        self.in_header = True  # after a role token: the author's ids until the kind token
        self.kind: str | None = None  # the open block's kind; None outside a block
        self.author: list[int] = []
        self.body: list[int] = []
        self.text = IncrementalDetokenizer(tokenizer)
        self.num_calls = 0

    def feed(self, token_ids: list[int]) -> ChatDelta:
        out = ChatDelta()
        for t in token_ids:
            t = int(t)
            if t in self.role_ids:
                out += self._close()
                self.in_header, self.author = True, []
            elif self.in_header and t in self.kind_of:
                self.in_header, self.kind, self.body = False, self.kind_of[t], []
                self.text = IncrementalDetokenizer(self.tokenizer)
            elif t in self.end_ids:
                out += self._close()
            elif self.in_header:
                self.author.append(t)
            else:
                if self.kind is None:  # text outside a block: visible
                    self.kind, self.body = "text", []
                    self.text = IncrementalDetokenizer(self.tokenizer)
                self.body.append(t)
                if self.kind in ("text", "xml", "thinking"):
                    out += self._streamed(self.text.add([t]))
        return out

    def finish(self) -> ChatDelta:
        """The end of the stream: an open block is closed as it stands (a truncated answer keeps its text)."""
        return self._close()

    def _streamed(self, text: str) -> ChatDelta:
        return ChatDelta(thinking=text) if self.kind == "thinking" else ChatDelta(content=text)

    def _close(self) -> ChatDelta:
        kind, author = self.kind, self.author
        self.kind, self.in_header, self.author = None, False, []
        if kind is None:  # a header that never reached its kind token: its text is visible
            return ChatDelta(content=self.tokenizer.decode(author)) if author else ChatDelta()
        if kind in ("text", "xml", "thinking"):
            text = self.text.flush()
            return ChatDelta(thinking=text) if kind == "thinking" else ChatDelta(content=text)
        body = self.tokenizer.decode(self.body)
        call = self._call(body, self.tokenizer.decode(author).strip())
        if call is None:
            return ChatDelta(content=body)
        self.num_calls += 1
        return ChatDelta(tool_calls=[call])

    def _call(self, body: str, author: str) -> ToolCall | None:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict):
            return None
        name = value.get("name", author)
        args = value.get("args", value.get("arguments", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(name, str) or not name or not isinstance(args, dict):
            return None
        return ToolCall(name, json.dumps(args, ensure_ascii=False), self.num_calls)


def parse_output(tokenizer: Tokenizer, token_ids: list[int]) -> ChatDelta:
    """A whole model turn at once."""
    parser = ChatOutputParser(tokenizer)
    out = parser.feed(token_ids)
    out += parser.finish()
    return out
