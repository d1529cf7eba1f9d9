"""A row's text as its tokens come: decoded whole characters only (a multi-byte character
split between tokens is held back until complete), cut at the first stop string, and never
sending what may turn out to be the start of one."""

from __future__ import annotations


class TextOut:
    def __init__(self, tokenizer, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.text = ""  # the decoded text, up to the stop string when one was met
        self.sent = 0  # characters of it handed out
        self.stopped = False

    def add(self, token: int) -> tuple[str, bool]:
        """(the text that can be sent now, whether a stop string ended the row)."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            return "", False
        self.text = text
        if self.stop:
            start = max(0, self.sent - max(map(len, self.stop)) + 1)
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = text[:min(hits)]
                self.stopped = True
                return self._send(len(self.text)), True
            return self._send(len(text) - self._held(text)), False
        return self._send(len(text)), False

    def _held(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins a stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def _send(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def flush(self) -> str:
        """What is left to send when the row ends: the text held back for a stop string that
        never came, and an incomplete character as it decodes (the replacement character)."""
        if self.stopped:
            return ""
        self.text = self.tokenizer.decode(self.ids)
        return self._send(len(self.text))

    @property
    def full(self) -> str:
        return self.text if self.stopped else self.tokenizer.decode(self.ids)
