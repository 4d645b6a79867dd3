"""Stop conditions: stop strings on the detokenized text, stop tokens on token ids.

Stop strings are found on text, not tokens, because one string may span several tokens
and one token may hold several strings. The engine appends each step's new text and asks
`StopChecker.check` for a cut; while none is found it streams all but the `held_back`
tail, which might still become a stop string. Since a speculative round can add several
tokens at once, a check may see many new characters: the earliest stop string to be
*completed* wins, so the output does not depend on how the text arrived in chunks.

The work is linear in the new text, whatever the stop strings' length: each stop string
has a Knuth-Morris-Pratt matcher that carries, from one check to the next, the length of
the longest tail of the text that is a prefix of the string. A new character moves each
matcher by amortized O(1) comparisons, a full match is a stop, and `held_back` is the
largest matcher state, read without looking at the text again. (`SamplingParams` caps the
count and the length of stop strings too: `MAX_STOP_STRINGS`, `MAX_STOP_CHARS`.)

Token-level stops (EOS, `stop_token_ids`) are decided by `finish_reason_for_token`;
`max_tokens` and the context limit are the engine's.
"""

from __future__ import annotations

from specserve.sampling.params import SamplingParams

FINISH_STOP = "stop"  # the OpenAI finish_reason for a stop string, stop token or EOS


class StopChecker:
    """Finds stop strings in growing text; built once per completion.

    With `include_stop_str_in_output` the output ends after the stop string, otherwise
    just before it. The checker follows one text that only grows; a call about another
    text (a `new_text_start` other than the length seen so far) restarts its matchers on
    the last `longest stop - 1` characters before the new part. `comparisons` counts the
    character comparisons made so far (the work the checker did).
    """

    __slots__ = ("_stops", "_include", "_longest", "_fail", "_states", "_seen", "comparisons",
                 "matched")

    def __init__(self, stop: tuple[str, ...], include_stop_str_in_output: bool) -> None:
        for entry in stop:
            if not isinstance(entry, str) or not entry:
                raise ValueError(f"stop entries must be non-empty strings, got {entry!r}")
        self._stops = tuple(stop)
        self._include = include_stop_str_in_output
        self._longest = max((len(entry) for entry in self._stops), default=0)
        self._fail = tuple(_failure(entry) for entry in self._stops)
        self._states = [0] * len(self._stops)
        self._seen = 0  # characters of the followed text the matchers have consumed
        self.comparisons = 0
        self.matched: str | None = None  # the stop string the last cut ended

    @classmethod
    def from_params(cls, params: SamplingParams) -> StopChecker:
        """The checker for a request's `stop` and `include_stop_str_in_output`."""
        return cls(params.stop, params.include_stop_str_in_output)

    def check(self, text: str, new_text_start: int) -> int | None:
        """Where `text` must be cut if a stop string ends in its new part, else None.

        `text[new_text_start:]` is what arrived since the last check. Among matches the
        one completed first wins (ties: the longer string); the output is `text[:cut]`.
        """
        if new_text_start != self._seen:
            self._restart(text, new_text_start)
        for end in range(new_text_start, len(text)):
            entry = self._advance(text[end])
            if entry is not None:
                self._seen, self.matched = end + 1, entry
                return end + 1 if self._include else end + 1 - len(entry)
        self._seen = len(text)
        return None

    def held_back(self, text: str) -> int:
        """How many trailing characters of `text` to withhold from streaming.

        They are a proper prefix of some stop string, so the next chunk may complete it.
        Call after `check` found no stop in `text`.
        """
        if len(text) != self._seen:
            self._restart(text, len(text))
        held = 0
        for entry, fail, state in zip(self._stops, self._fail, self._states):
            if state == len(entry):  # a full match is check's business; its proper tail may stay
                state = fail[state - 1]
            held = max(held, state)
        return min(held, len(text))

    def _restart(self, text: str, upto: int) -> None:
        """Matchers fed afresh with the window of `text` that can still reach `upto`."""
        self._states = [0] * len(self._stops)
        for ch in text[max(0, upto - self._longest + 1):upto]:
            for i in range(len(self._stops)):
                self._states[i] = self._step(i, ch)
        self._seen = upto

    def _advance(self, ch: str) -> str | None:
        """Feed one character; the longest stop string it completes, if any."""
        done = None
        for i, entry in enumerate(self._stops):
            state = self._step(i, ch)
            self._states[i] = state
            if state == len(entry) and (done is None or len(entry) > len(done)):
                done = entry
        return done

    def _step(self, i: int, ch: str) -> int:
        entry, fail, state = self._stops[i], self._fail[i], self._states[i]
        if state == len(entry):
            state = fail[state - 1]
        while True:
            self.comparisons += 1
            if entry[state] == ch:
                return state + 1
            if state == 0:
                return 0
            state = fail[state - 1]


def _failure(entry: str) -> tuple[int, ...]:
    """KMP's failure function: `fail[i]` is the length of the longest proper prefix of
    `entry[:i + 1]` that is also its suffix."""
    fail = [0] * len(entry)
    k = 0
    for i in range(1, len(entry)):
        while k and entry[i] != entry[k]:
            k = fail[k - 1]
        if entry[i] == entry[k]:
            k += 1
        fail[i] = k
    return tuple(fail)


def finish_reason_for_token(
    token: int, params: SamplingParams, eos_token_ids: frozenset[int]
) -> str | None:
    """"stop" when `token` ends the request (a stop token id, or EOS unless ignore_eos)."""
    if token in params.stop_token_ids:
        return FINISH_STOP
    if token in eos_token_ids and not params.ignore_eos:
        return FINISH_STOP
    return None
