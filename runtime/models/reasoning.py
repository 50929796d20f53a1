"""Reasoning a model writes into its answer's text, taken out of it, sans I/O.

A thinking model (qwen3, deepseek-r1, QwQ...) served without a reasoning parser (Ollama, vLLM and
llama.cpp's server can each be run so) sends its reasoning in the content, as a ``<think>`` block
that opens the text: ``<think>...</think>`` and then the answer; Mistral's (Magistral) write
``[THINK]...[/THINK]``. That block is not the answer: it is not streamed as the answer, kept as
it, nor sent back to the model with it. Only a block that opens the text is taken out (white
space before it allowed), and only the closing tag of its own kind ends it: a tag further on is
the answer's own text, as when the model explains the tag. A text that ends inside the block
holds no answer. Servers that send reasoning apart (``reasoning_content``...) are read in
``assembly``.
"""

from __future__ import annotations

import attrs

BLOCKS = {"<think>": "</think>", "[THINK]": "[/THINK]"}  # each opening tag, and the tag that closes its block


@attrs.define(eq=False)
class ThinkFilter:
    """Feed it the text of an answer piece by piece; it returns what of each is the answer.

    While the text could still open with a tag of ``BLOCKS`` (a few characters at most), it is held
    back; inside the block, nothing is returned; after it, the white space that follows the
    block is dropped, and the rest is the answer. ``end()`` returns what was held back when the
    text ends; ``thinking`` says whether it ended inside the block.
    """

    _held: str = attrs.field(init=False, default="")
    _state: str = attrs.field(init=False, default="start")  # "start", "thinking", "after", "answer"
    _close: str = attrs.field(init=False, default="")  # the tag that ends the block being read

    @property
    def thinking(self) -> bool:
        return self._state == "thinking"

    @property
    def reasoned(self) -> bool:
        """Whether a block opened the text, and none of the answer has followed it yet."""
        return self._state in ("thinking", "after")

    def feed(self, text: str) -> str:
        if self._state == "answer":
            return text
        self._held += text
        if self._state == "start":
            opening = self._held.lstrip()
            tag = next((tag for tag in BLOCKS if opening.startswith(tag)), None)
            if tag is None:
                if any(tag.startswith(opening) for tag in BLOCKS):  # white space so far, or the start of a tag still coming
                    return ""
                return self._answer(self._held)
            self._state, self._held, self._close = "thinking", opening[len(tag) :], BLOCKS[tag]
        if self._state == "thinking":
            before, closed, after = self._held.partition(self._close)
            if not closed:  # only what could be the start of the closing tag is kept
                self._held = self._held[-(len(self._close) - 1) :]
                return ""
            self._state, self._held = "after", after
        answer = self._held.lstrip()
        return self._answer(answer) if answer else self._dropped()

    def end(self) -> str:
        """What was held back as the text ends: the start of a text that never became a tag."""
        held = self._held if self._state == "start" else ""
        if self._state != "thinking":
            self._state = "answer"
        self._held = ""
        return held

    def _answer(self, text: str) -> str:
        self._state, self._held = "answer", ""
        return text

    def _dropped(self) -> str:
        self._held = ""
        return ""


def answer_text(text: str) -> str:
    """A whole answer's text without the reasoning that opens it (see ThinkFilter)."""
    think = ThinkFilter()
    return think.feed(text) + think.end()
