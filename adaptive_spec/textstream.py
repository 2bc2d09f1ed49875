"""Text for a stream of token chunks: deltas that never show a stop string or half a character.

Used by `adaptive-spec generate` and by the HTTP service's streaming responses.
"""

from __future__ import annotations


class IncrementalText:
    """Text deltas for a stream of token chunks that never show a stop string or half a character.

    Example with stop ["\\n\\n"]: if the text so far is "Paris.\\n", the "\\n" is held back, since it
    may start a stop string; if the next token makes it "Paris.\\n\\n", the request ends there and
    the final text, "Paris.", has nothing more to show.
    """

    def __init__(self, engine, stops: list[str] | None) -> None:
        self.engine = engine
        self.stops = stops or []
        self.tokens: list[int] = []
        self.shown = ""

    def push(self, token_ids: list[int]) -> str:
        self.tokens += token_ids
        text = self.engine.decode(self.tokens)
        if text is None or not text.startswith(self.shown):
            return ""
        safe = len(text) - _holdback(text, self.stops)
        while safe > len(self.shown) and text[safe - 1] == "\ufffd":  # a character still incomplete
            safe -= 1
        delta = text[len(self.shown) : safe] if safe > len(self.shown) else ""
        self.shown += delta
        return delta

    def finish(self, final_text: str | None) -> str:
        """The rest of the output's final text (stop strings already cut by the engine)."""
        if not final_text or not final_text.startswith(self.shown):
            return ""
        rest = final_text[len(self.shown) :]
        self.shown = final_text
        return rest


def _holdback(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
