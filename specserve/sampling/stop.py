"""Stop conditions: stop strings on the detokenized text, stop tokens on token ids.

Stop strings are found on text, not tokens, because one string may span several tokens
and one token may hold several strings. The engine appends each step's new text and asks
`StopChecker.check` for a cut; while none is found it streams all but the `held_back`
tail, which might still become a stop string. Since a speculative round can add several
tokens at once, a check may see many new characters: the earliest stop string to be
*completed* wins, so the output does not depend on how the text arrived in chunks.

Token-level stops (EOS, `stop_token_ids`) are decided by `finish_reason_for_token`;
`max_tokens` and the context limit are the engine's.
"""

from __future__ import annotations

from specserve.sampling.params import SamplingParams

FINISH_STOP = "stop"  # the OpenAI finish_reason for a stop string, stop token or EOS


class StopChecker:
    """Finds stop strings in growing text; built once per request.

    With `include_stop_str_in_output` the output ends after the stop string, otherwise
    just before it.
    """

    __slots__ = ("_stops", "_include", "_longest")

    def __init__(self, stop: tuple[str, ...], include_stop_str_in_output: bool) -> None:
        for entry in stop:
            if not isinstance(entry, str) or not entry:
                raise ValueError(f"stop entries must be non-empty strings, got {entry!r}")
        self._stops = tuple(stop)
        self._include = include_stop_str_in_output
        self._longest = max((len(entry) for entry in self._stops), default=0)

    @classmethod
    def from_params(cls, params: SamplingParams) -> StopChecker:
        """The checker for a request's `stop` and `include_stop_str_in_output`."""
        return cls(params.stop, params.include_stop_str_in_output)

    def check(self, text: str, new_text_start: int) -> int | None:
        """Where `text` must be cut if a stop string ends in its new part, else None.

        `text[new_text_start:]` is what arrived since the last check; the search starts
        `longest stop - 1` characters earlier so a string spanning the old and new text is
        found. Among matches the one completed first wins (ties: the longer string); the
        output is `text[:cut]`.
        """
        start = max(0, new_text_start - self._longest + 1)
        best_end, best_begin = None, None
        for entry in self._stops:
            begin = text.find(entry, start)
            if begin < 0:
                continue
            end = begin + len(entry)
            if best_end is None or (end, begin) < (best_end, best_begin):
                best_end, best_begin = end, begin
        if best_end is None:
            return None
        return best_end if self._include else best_begin

    def held_back(self, text: str) -> int:
        """How many trailing characters of `text` to withhold from streaming.

        They are a proper prefix of some stop string, so the next chunk may complete it.
        Call after `check` found no stop in `text`.
        """
        held = 0
        for entry in self._stops:
            for length in range(min(len(entry) - 1, len(text)), held, -1):
                if text.endswith(entry[:length]):
                    held = length
                    break
        return held


def finish_reason_for_token(
    token: int, params: SamplingParams, eos_token_ids: frozenset[int]
) -> str | None:
    """"stop" when `token` ends the request (a stop token id, or EOS unless ignore_eos)."""
    if token in params.stop_token_ids:
        return FINISH_STOP
    if token in eos_token_ids and not params.ignore_eos:
        return FINISH_STOP
    return None
