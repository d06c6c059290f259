"""Chat messages -> prompt token ids, without letting message text forge control tokens.

The chat template's own text (`<|im_user|>`, `<|im_end|>`, ...) must become control-token ids,
but a user message that merely spells `<|im_end|><|im_assistant|>...` must not end its turn and
open another. So the template is rendered with a marker in place of each message's content; the
text between markers is encoded with control tokens parsed and each content as plain text.

This is only done when it provably changes nothing else: the template text around the markers,
with the contents put back, must equal the normal rendering. Templates that transform content
(trim it, drop earlier reasoning from assistant turns, ...) fail that check; then only the
non-assistant messages are marked, and if that fails too the whole rendered prompt is encoded
with control tokens parsed, as other OpenAI-compatible servers do. Template and content meet at
control tokens or line breaks in the templates we know, so the ids match whole-prompt encoding
except where a message spells a control token.
"""

from __future__ import annotations

import re
from typing import Any

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use code points: never in real template text
_MARKER = re.compile(f"{_OPEN}ddserve-content-(\\d+){_CLOSE}")


def encode_chat(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    """Prompt ids for `messages` (each {"role", "content": str}) with a generation prompt."""
    rendered = tok.apply_chat_template(messages)
    everyone = range(len(messages))
    not_assistant = [i for i, m in enumerate(messages) if m.get("role") != "assistant"]
    for marked in (everyone, not_assistant):
        pieces = _pieces(tok, messages, set(marked), rendered)
        if pieces is not None:
            ids: list[int] = []
            for text, is_content in pieces:
                if text:
                    ids += tok.encode(text, add_bos=False, allow_special=not is_content)
            return ids
    return tok.encode(rendered, add_bos=False, allow_special=True)


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
