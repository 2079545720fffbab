"""Generated token ids -> text deltas, with stop strings: one object per request.

Used for streamed and non-streamed responses alike, so both cut at exactly the same place.

* Incremental detokenization (vLLM's scheme): decode a short window of ids ending at the newest
  token and diff it against the same window without it; text is added only once it does not end
  in U+FFFD, so a multi-byte character split over tokens is never emitted half. The window starts
  with the prompt's last tokens, so tokenizers that drop a leading space at the start of a decode
  (SentencePiece) still render the first generated token right. Cost per token is O(window).
* Stop strings: tokens are taken one at a time; when a stop string appears the text is cut before
  it, later tokens are dropped, and `stopped` is set. Text that could be the beginning of a stop
  string is held back until it cannot be.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

PROMPT_TAIL = 5  # prompt tokens that prefix the decode window (vLLM's initial offset)


@dataclass
class Delta:
    text: str = ""  # text safe to send now
    token_ids: list[int] = field(default_factory=list)  # the ids taken by this push
    stopped: bool = False  # a stop string ended the output inside this push


class TextStream:
    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (), stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._ids = list(prompt_ids[-PROMPT_TAIL:])  # window source: prompt tail + generated ids
        self._prefix = 0  # start of the decode window in _ids
        self._read = len(self._ids)  # ids before this are already turned into text
        self.text = ""  # the output text so far (cut at a stop string once stopped)
        self._sent = 0  # characters of `text` already returned
        self.token_ids: list[int] = []  # generated ids taken so far
        self.stopped = False

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, final: bool = False) -> None:
        """Moves newly decodable text from the id window into `text`."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self.text += new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self._ids)

    def _find_stop(self, start: int) -> int:
        """Earliest index >= start where a stop string begins in `text`, or -1."""
        hits = [i for s in self.stop if (i := self.text.find(s, max(0, start - len(s) + 1))) >= 0]
        return min(hits, default=-1)

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _take(self, end: int) -> str:
        out = self.text[self._sent:end]
        self._sent = max(self._sent, end)
        return out

    def push(self, token_ids: Sequence[int]) -> Delta:
        """Takes generated ids (one engine step); returns the text that can be sent now."""
        delta = Delta()
        for tok in token_ids:
            if self.stopped:
                break
            before = len(self.text)
            self._ids.append(int(tok))
            self.token_ids.append(int(tok))
            delta.token_ids.append(int(tok))
            self._advance()
            if self.stop and len(self.text) > before:
                i = self._find_stop(before)
                if i >= 0:
                    self.text, self.stopped, delta.stopped = self.text[:i], True, True
        end = len(self.text) if self.stopped else len(self.text) - self._held_back()
        delta.text = self._take(end)
        return delta

    def finish(self) -> str:
        """At the end of generation: everything still held back (an unfinished character too)."""
        if not self.stopped:
            self._advance(final=True)
        return self._take(len(self.text))
