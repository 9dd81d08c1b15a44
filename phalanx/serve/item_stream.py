"""A streamed chat output as items — its reasoning, its answer, its calls — read the way the
whole output is read (``openai_server.chat_message``), for the APIs whose streams are items
(OpenAI's Responses API, Anthropic's Messages API). Each API formats the items' events itself.

Items open as their first text comes and close when another kind begins, or at the end. With a
reasoning parser (``strip``) the reasoning goes without the blanks around it and the answer
without the blanks it starts with (as the whole message is stripped); blank answer text is held
until text comes, and a call after it drops it (a whole message with calls has no blank
content); an output with neither an answer nor a call ends with an empty answer. The item being
written when the output ends takes its status (``incomplete`` where the output limit cut it):
the answer, or with a ``named`` function (its arguments are the output) the call. So a streamed
output's items are the whole output's.

Pure Python: no torch, no server.
"""

from __future__ import annotations

from typing import Any

REASONING, ANSWER, CALL = "reasoning", "answer", "call"


class ItemStream:
    def __init__(self, strip: bool, named: bool = False) -> None:
        self.strip, self.named = strip, named
        self.kind: str | None = None                 # the open item's kind
        self.text = ""                               # its text (a call's: its arguments)
        self.closed = 0                              # items closed so far (the open one's index)
        self.calls = 0                               # calls opened
        self.pending_lps: list[dict[str, Any]] = []  # logprobs of tokens no answer delta has carried yet
        self.reasoned = False                        # reasoning sent
        self.reasoning_tail = ""                     # blanks at the reasoning's end so far (held)
        self.answer_held = ""                        # blank answer text before the answer opens
        self.answered = False                        # the answer opened

    # -- what each API formats ------------------------------------------------------------------
    def _opened(self, kind: str, call: dict[str, Any] | None) -> list[str]:
        raise NotImplementedError

    def _added(self, kind: str, text: str, lps: list[dict[str, Any]]) -> list[str]:
        raise NotImplementedError

    def _closed(self, kind: str, text: str, status: str) -> list[str]:
        raise NotImplementedError

    # -- reading the output ---------------------------------------------------------------------
    def feed(self, delta: dict[str, Any], calls: list[dict[str, Any]], lps: list[dict[str, Any]]) -> list[str]:
        """Events for a chat stream's delta (``_ChoiceStream.feed``: reasoning_content, content,
        tool-call deltas) and the logprobs of its tokens."""
        out: list[str] = []
        self.pending_lps += lps
        thought = delta.get("reasoning_content", "")
        if thought:
            thought = self.reasoning_tail + (thought if self.reasoned else thought.lstrip())
            body = thought.rstrip()
            self.reasoning_tail = thought[len(body):]
            if body:
                self.reasoned = True
                out += self._text(REASONING, body)
        answer = delta.get("content", "")
        if answer and not self.answered:
            answer = self.answer_held + answer
            if self.strip:
                answer = answer.lstrip()
            self.answer_held, answer = (answer, "") if not answer.strip() else ("", answer)
        if answer:
            self.answered = True
            out += self._text(ANSWER, answer)
        for call in calls:
            if "id" in call:      # a new call: its header (and what arguments there are yet)
                out += self._close("completed")
                self.answer_held = ""
                self.kind, self.text = CALL, ""
                self.calls += 1
                out += self._opened(CALL, call)
            args = call["function"].get("arguments", "")
            if args and self.kind == CALL:
                self.text += args
                out += self._added(CALL, args, [])
        return out

    def finish(self, status: str) -> list[str]:
        """The end of the output: an answer that never came is an empty one (where no call came
        either); the open item closes with ``status``."""
        out: list[str] = []
        if not self.answered and not self.calls:
            self.answered = True
            out += self._text(ANSWER, self.answer_held)
        return out + self._close(status if self.kind != CALL or self.named else "completed")

    def _text(self, kind: str, text: str) -> list[str]:
        out: list[str] = []
        if self.kind != kind:
            out += self._close("completed")
            self.kind, self.text = kind, ""
            out += self._opened(kind, None)
        self.text += text
        if not text:
            return out
        lps: list[dict[str, Any]] = []
        if kind == ANSWER:
            lps, self.pending_lps = self.pending_lps, []
        return out + self._added(kind, text, lps)

    def _close(self, status: str) -> list[str]:
        if self.kind is None:
            return []
        out = self._closed(self.kind, self.text, status)
        self.kind, self.text = None, ""
        self.closed += 1
        return out
