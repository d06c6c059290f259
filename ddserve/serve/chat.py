"""Chat messages -> prompt token ids, without letting message text forge control tokens.

The chat template's own text (`<|im_user|>`, `<|im_end|>`, ...) must become control-token ids,
but a user message that merely spells `<|im_end|><|im_assistant|>...` must not end its turn and
open another. So the template is rendered with a marker in place of each message's content; the
text between markers is encoded with control tokens parsed and each content as plain text.

This is only done when it provably changes nothing else: the template text around the markers,
with the contents put back, must equal the normal rendering. Templates that transform content
(trim it, drop earlier reasoning from assistant turns, ...) fail that check; then only the
non-assistant messages are marked, and if that fails too the whole rendered prompt is encoded
with control tokens parsed. A message whose text the template renders itself (unmarked) must
not spell a control token, else `encode_chat` refuses the conversation (`ChatEncodingError`):
message text never becomes a control token. Template and content meet at control tokens or line
breaks in the templates we know, so the ids match whole-prompt encoding except where a message
spells a control token.

Roles are not marked: the HTTP layer admits only a fixed set of role names (plain words), so a
role can never spell a control token.
"""

from __future__ import annotations

import re
from typing import Any

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use code points: never in real template text
_MARKER = re.compile(f"{_OPEN}ddserve-content-(\\d+){_CLOSE}")


class ChatEncodingError(ValueError):
    """The conversation cannot be encoded with its message text kept as plain text."""


def encode_chat(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    """Prompt ids for `messages` (each {"role", "content": str}) with a generation prompt."""
    rendered = tok.apply_chat_template(messages)
    everyone = range(len(messages))
    not_assistant = [i for i, m in enumerate(messages) if m.get("role") != "assistant"]
    for marked in (everyone, not_assistant):
        pieces = _pieces(tok, messages, set(marked), rendered)
        if pieces is not None:
            _refuse_spelled_controls(tok, messages, set(marked))
            ids: list[int] = []
            for text, is_content in pieces:
                if text:
                    ids += tok.encode(text, add_bos=False, allow_special=not is_content)
            return ids
    _refuse_spelled_controls(tok, messages, set())
    return tok.encode(rendered, add_bos=False, allow_special=True)


def _refuse_spelled_controls(tok: Any, messages: list[dict[str, str]], marked: set[int]) -> None:
    """Unmarked contents are encoded with control tokens parsed: none may spell one."""
    for i, m in enumerate(messages):
        text = m["content"]
        if i in marked or not text:
            continue
        if tok.encode(text, allow_special=True) != tok.encode(text, allow_special=False):
            raise ChatEncodingError(
                f"message {i} spells a control token, and this model's chat template rewrites "
                "that message's text, so it cannot be kept as plain text"
            )


def _pieces(
    tok: Any, messages: list[dict[str, str]], marked: set[int], rendered: str
) -> list[tuple[str, bool]] | None:
    """(text, is message content) in prompt order, or None if the markers change the prompt."""
    if not marked:
        return None
    swapped = [
        {**m, "content": f"{_OPEN}ddserve-content-{i}{_CLOSE}"} if i in marked else m
        for i, m in enumerate(messages)
    ]
    text, pos, out = tok.apply_chat_template(swapped), 0, []
    for match in _MARKER.finditer(text):
        out.append((text[pos : match.start()], False))
        out.append((messages[int(match.group(1))]["content"], True))
        pos = match.end()
    out.append((text[pos:], False))
    return out if "".join(t for t, _ in out) == rendered else None
