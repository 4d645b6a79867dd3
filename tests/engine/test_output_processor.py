"""Deltas from the engine: streamed text equals the final text, stops never leak, aborts free.

A bigram toy whose token i is almost surely followed by i + 1 (mod 8) emits a known token
chain; a byte tokenizer maps those tokens to byte strings that split multi-byte UTF-8
characters across tokens and make stop strings span tokens.
"""

from __future__ import annotations

import threading

import pytest
import torch

from specserve.clients.async_engine import AsyncEngine
from specserve.engine.engine import LLMEngine
from specserve.engine.output_processor import IncrementalDetokenizer
from specserve.engine.outputs import SpeculationOverride, TokenOrigin
from specserve.sampling.params import SamplingParams
from tests import toy

V = 8
# the chain 1, 2, 3, ... decodes to "aé€</s>😀" with every multi-byte character split
PIECES = [b"\x98\x80", b"a", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac<", b"/s", b">\xf0\x9f"]


class ByteTokenizer:
    """Token i is the byte string PIECES[i]; text is their concatenation, decoded as UTF-8."""

    def __init__(self, eos: int | None = None) -> None:
        self.eos_token_ids = frozenset() if eos is None else frozenset({eos})
        self.decoded_lengths: list[int] = []

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.decoded_lengths.append(len(ids))
        data = b"".join(PIECES[i] for i in ids if i not in self.eos_token_ids)
        return data.decode("utf-8", errors="replace")


def chain_table() -> torch.Tensor:
    table = torch.full((V, V), 1e-3)
    for i in range(V):
        table[i, (i + 1) % V] = 1.0
    return table


def byte_engine(k: int, max_num_seqs: int = 8, eos: int | None = None) -> LLMEngine:
    base = toy.toy_engine(chain_table(), chain_table() if k else None, k,
                          max_num_seqs=max_num_seqs, max_len=256)
    return LLMEngine(base.runner, base.scheduler.blocks, ByteTokenizer(eos), base.config, base.spec)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def expected_text(n: int, stop: str | None = None, include: bool = False) -> str:
    data = b"".join(PIECES[(i + 1) % V] for i in range(n))
    text = data.decode("utf-8", errors="replace")
    if stop is not None and stop in text:
        cut = text.index(stop)
        text = text[:cut + len(stop) if include else cut]
    return text


def stream_all(engine: LLMEngine) -> tuple[dict, dict]:
    """Step until idle: (request id -> list of its deltas, request id -> final output)."""
    deltas, finals = {}, {}
    while engine.has_unfinished():
        for d in engine.step():
            deltas.setdefault(d.request_id, []).append(d)
            if d.finished:
                finals[d.request_id] = d.output
    return deltas, finals


def streamed(deltas, index: int = 0) -> tuple[list[str], list[int], list[str]]:
    texts, ids, origins = [], [], []
    for d in deltas:
        for c in d.completions:
            if c.index == index:
                texts.append(c.text)
                ids += c.token_ids
                origins += c.origins
    return texts, ids, origins


@pytest.mark.parametrize("k", [0, 1, 3, 4])
@pytest.mark.parametrize("stop,include", [(None, False), ("</s>", False), ("</s>", True),
                                          ("€<", False), ("é", True), ("s>😀a", False)])
def test_stream_concatenates_to_the_final_text_and_never_shows_what_a_stop_cuts(k, stop, include):
    engine = byte_engine(k)
    lengths = [1, 2, 3, 4, 5, 7, 9, 12, 17, 30]
    for n in lengths:
        engine.add_request([0], greedy(max_tokens=n, stop=[stop] if stop else None,
                                       include_stop_str_in_output=include), request_id=f"n{n}")
    deltas, finals = stream_all(engine)
    for n in lengths:
        out = finals[f"n{n}"].outputs[0]
        assert out.text == expected_text(n, stop, include), (n, out.text)
        texts, ids, _ = streamed(deltas[f"n{n}"])
        assert "".join(texts) == out.text
        assert ids == out.token_ids
        shown = ""
        for piece in texts:
            shown += piece
            assert out.text.startswith(shown)  # nothing streamed is ever taken back
        # split characters come out whole; a character cut short by the end shows as U+FFFD
        assert "\ufffd" not in "".join(texts[:-1]) + out.text[:-1]
        if stop is not None and stop in expected_text(n):
            assert out.finish_reason == "stop"
            assert not include or out.text.endswith(stop)
        else:
            assert out.finish_reason == "length" and len(out.token_ids) == n


def test_a_character_is_emitted_in_the_step_its_last_byte_arrives():
    engine = byte_engine(0)
    engine.add_request([0], greedy(max_tokens=8))
    texts = []
    while engine.has_unfinished():
        for d in engine.step():
            texts += [c.text for c in d.completions]
    # tokens: a | \xc3 | \xa9 | \xe2\x82 | \xac< | /s | >\xf0\x9f | \x98\x80
    # a window ending in an unfinished character holds all its text (">" waits for "😀")
    assert texts == ["a", "", "é", "", "€<", "/s", "", ">😀"]


def test_detokenization_decodes_a_short_window_not_the_whole_output():
    engine = byte_engine(3)
    engine.add_request([0], greedy(max_tokens=200))
    stream_all(engine)
    assert max(engine.tokenizer.decoded_lengths) <= 4


def test_incremental_detokenizer_flushes_an_unfinished_character_at_the_end():
    tok = ByteTokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.push(1) == "a"
    assert detok.push(2) == ""  # \xc3 alone
    assert detok.flush() == "\ufffd"


def test_eos_and_stop_token_ids_end_the_stream_with_all_text_flushed():
    engine = byte_engine(4, eos=6)
    engine.add_request([0], greedy(max_tokens=20, stop=["</s>x"]))  # "</s" is held back ...
    deltas, finals = stream_all(engine)
    out = finals["0"].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == [1, 2, 3, 4, 5, 6]
    assert out.text == "aé€<"  # ... and flushed when EOS ends it (EOS has no text)
    assert "".join(streamed(deltas["0"])[0]) == out.text


def test_token_origins_follow_each_round_plain_accepted_bonus():
    engine = byte_engine(3)
    engine.add_request([0], greedy(max_tokens=9))
    deltas, finals = stream_all(engine)
    out = finals["0"].outputs[0]
    a, b, p = TokenOrigin.ACCEPTED, TokenOrigin.BONUS, TokenOrigin.PLAIN
    assert out.origins == [p, a, a, a, b, a, a, a, b]  # the prefill's token, then two rounds
    assert streamed(deltas["0"])[2] == out.origins
    assert out.origins.count(a) == out.spec.accepted


def test_a_rejected_draft_gives_a_recovered_token():
    P = chain_table()
    Q = torch.roll(chain_table(), 1, dims=1)  # the draft always proposes i + 2
    base = toy.toy_engine(P, Q, 2)
    base.add_request([0], greedy(max_tokens=5))
    (out,) = toy.run_all(base)
    # the last token is left alone for the bonus slot: a round with k = 0, plain
    plain, recovered = TokenOrigin.PLAIN, TokenOrigin.RECOVERED
    assert out.outputs[0].origins == [plain, recovered, recovered, recovered, plain]


def test_logprobs_stream_one_entry_per_token():
    engine = byte_engine(3)
    engine.add_request([0], greedy(max_tokens=10, logprobs=1))
    deltas, finals = stream_all(engine)
    out = finals["0"].outputs[0]
    streamed_lp = [lp for d in deltas["0"] for c in d.completions for lp in c.logprobs]
    assert streamed_lp == out.logprobs and len(out.logprobs) == 10
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry


def test_n_completions_stream_under_their_index():
    engine = byte_engine(0)
    engine.add_request([0], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6))
    deltas, finals = stream_all(engine)
    for c in finals["0"].outputs:
        texts, ids, _ = streamed(deltas["0"], c.index)
        assert "".join(texts) == c.text and ids == c.token_ids


def memory_in_use(engine: LLMEngine) -> int:
    """Target KV blocks held by sequences."""
    return engine.stats().kv_blocks_used


def test_abort_from_another_thread_frees_memory_and_the_others_finish():
    engine = byte_engine(3, max_num_seqs=4)
    client = AsyncEngine(engine)  # the thread that owns the engine core
    finals, deltas, memory = {}, {}, {"most": 0, "at_abort": None}
    done, first = threading.Event(), threading.Event()

    def on_delta(d):  # on the engine thread, between steps
        memory["most"] = max(memory["most"], memory_in_use(engine))
        deltas.setdefault(d.request_id, []).append(d)
        if d.request_id == "r1":
            first.set()
        if d.finished:
            finals[d.request_id] = d.output
            if d.request_id == "r1":
                memory["at_abort"] = memory_in_use(engine)
                assert d.completions[0].finish_reason == "abort"
            if len(finals) == 3:
                done.set()

    try:
        for i in range(3):
            client.add([0], greedy(max_tokens=150), request_id=f"r{i}", on_delta=on_delta)
        first.wait(30)
        aborter = threading.Thread(target=client.abort, args=("r1",))
        aborter.start()
        aborter.join()
        assert done.wait(60)
    finally:
        client.shutdown(timeout=10)
    r1 = finals["r1"].outputs[0]
    assert r1.finish_reason == "abort" and 0 < len(r1.token_ids) < 150
    assert r1.text == expected_text(len(r1.token_ids))
    assert memory["at_abort"] is not None and 0 < memory["at_abort"] < memory["most"]
    assert engine.spec.model._seqs == {}  # the draft cache let go too
    for rid in ("r0", "r2"):
        assert finals[rid].outputs[0].finish_reason == "length"
        assert finals[rid].outputs[0].text == expected_text(150)
    assert memory_in_use(engine) == 0 and engine.num_aborted == 1


def test_abort_during_a_step_takes_effect_at_the_next_step():
    engine = byte_engine(3)
    client = AsyncEngine(engine)
    forward, calls, log, done = engine.runner.forward, [], [], threading.Event()

    def forward_then_abort(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            client.abort("a")  # posted while a step holds the engine: applied before the next
        return forward(*a, **kw)

    def on_delta(d):  # (target passes so far, request, finished, reason)
        reasons = [c.finish_reason for c in d.completions]
        log.append((len(calls), d.request_id, d.finished, reasons))
        if d.finished and d.request_id == "b":
            done.set()

    engine.runner.forward = forward_then_abort
    try:
        client.add([0], greedy(max_tokens=100), request_id="a", on_delta=on_delta)
        client.add([0], greedy(max_tokens=100), request_id="b", on_delta=on_delta)
        assert done.wait(60)
    finally:
        client.shutdown(timeout=10)
    a = [entry for entry in log if entry[1] == "a"]
    assert (3, "a", False, [None]) in a  # it advanced in the step the abort arrived during
    assert a[-1] == (4, "a", True, ["abort"])  # and was aborted at the next one
    b = [entry for entry in log if entry[1] == "b"]
    assert b[-1][2] and b[-1][3] == ["length"] and not any(e[2] for e in b[:-1])


def test_abort_before_scheduling_removes_the_waiting_request():
    engine = byte_engine(0, max_num_seqs=1)
    engine.add_request([0], greedy(max_tokens=5), request_id="a")
    engine.add_request([0], greedy(max_tokens=5), request_id="b")
    engine.abort_request("b")  # no step is running: applied at once
    assert [s.request_id for s in engine.scheduler.waiting] == ["a"]
    deltas, finals = stream_all(engine)
    b = finals["b"]
    assert b.outputs[0].finish_reason == "abort" and b.outputs[0].token_ids == []
    assert b.queue_time is None and finals["a"].outputs[0].finish_reason == "length"
    engine.abort_request("a")  # finished: ignored
    engine.abort_request("unknown")
    assert not engine.has_unfinished()


def test_an_exception_in_a_step_fails_the_running_requests_only():
    engine = byte_engine(0, max_num_seqs=2)
    for i in range(3):
        engine.add_request([0], greedy(max_tokens=6), request_id=f"r{i}")
    forward, calls = engine.runner.forward, []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return forward(*a, **kw)

    engine.runner.forward = failing
    deltas, finals = stream_all(engine)
    for rid in ("r0", "r1"):
        last = deltas[rid][-1]
        assert isinstance(last.error, RuntimeError) and last.finished
        assert last.output.outputs[0].finish_reason == "abort"
    assert deltas["r2"][-1].error is None
    assert finals["r2"].outputs[0].text == expected_text(6)
    assert memory_in_use(engine) == 0
    engine.add_request([0], greedy(max_tokens=4), request_id="after")
    assert stream_all(engine)[1]["after"].outputs[0].text == expected_text(4)


def test_queue_time_ends_when_a_request_is_first_scheduled():
    engine = byte_engine(0, max_num_seqs=1)
    engine.add_request([0], greedy(max_tokens=20), request_id="first")
    engine.add_request([0], greedy(max_tokens=2), request_id="second")
    _, finals = stream_all(engine)
    first, second = finals["first"], finals["second"]
    assert 0 <= first.queue_time <= first.outputs[0].ttft
    # the second waited for the whole first request
    assert second.queue_time >= first.outputs[0].e2e_time - first.queue_time
    assert second.outputs[0].queue_time == second.queue_time <= second.outputs[0].ttft


def test_speculation_override_reaches_the_sequence_and_its_controller_state():
    engine = byte_engine(3)
    override = SpeculationOverride(enabled=False, tv_budget=0.25)
    engine.add_request([0], greedy(max_tokens=3, n=1), speculation=override)
    (seq,) = engine.scheduler.waiting
    assert seq.tv_budget == 0.25 and not engine.spec.state(seq).enabled
    toy.run_all(engine)
    assert seq.metrics.drafted == 0 and seq.metrics.idle == {"off": 2}


def test_bad_requests_are_refused_before_anything_is_queued():
    engine = byte_engine(0)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([0, 99], greedy())
    with pytest.raises(ValueError, match="speculation"):
        engine.add_request([0], greedy(), speculation={"enabled": False})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculationOverride(num_speculative_tokens=2.5)
    engine.add_request([0], greedy(max_tokens=1), request_id="x")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([0], greedy(), request_id="x")
    assert len(engine.scheduler.waiting) == 1


def test_a_request_that_fails_while_being_queued_gets_an_error_delta_and_others_run():
    engine = byte_engine(0)
    new_sequence = engine._new_sequence

    def failing(req, *a):
        if req.request_id == "bad":
            raise RuntimeError("cannot build")
        return new_sequence(req, *a)

    engine._new_sequence = failing
    with pytest.raises(RuntimeError, match="cannot build"):  # the core: raised to its caller
        engine.add_request([0], greedy(max_tokens=3), request_id="bad")
    assert not engine.has_request("bad") and not engine.has_unfinished()
    client = AsyncEngine(engine)  # a client: the failure is that request's error delta
    finals, done = {}, threading.Event()

    def on_delta(d):
        if d.finished:
            finals[d.request_id] = d
            if len(finals) == 2:
                done.set()

    try:
        client.add([0], greedy(max_tokens=3), request_id="bad", on_delta=on_delta)
        client.add([0], greedy(max_tokens=3), request_id="good", on_delta=on_delta)
        assert done.wait(30)
    finally:
        client.shutdown(timeout=10)
    assert isinstance(finals["bad"].error, RuntimeError) and finals["bad"].output is None
    assert finals["good"].output.outputs[0].text == expected_text(3)
    assert not engine.has_request("bad")


def test_automatic_request_ids_skip_ids_chosen_by_callers():
    engine = byte_engine(0)
    chosen = {str(i) for i in range(0, 40, 2)}  # the counter also numbers sequences: it meets one
    for rid in sorted(chosen, key=int):
        engine.add_request([0], greedy(max_tokens=2), request_id=rid)
    automatic = {engine.add_request([0], greedy(max_tokens=2)) for _ in range(5)}
    assert len(automatic) == 5 and not automatic & chosen


def byte_level_tokenizer():
    """A real byte-level BPE tokenizer (the `tokenizers` library): one token per byte, some
    whole multi-byte characters, some pieces of them, and a special EOS token."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    from specserve.models.tokenizer import Tokenizer

    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = iter(range(256, 512))
    char_of = {b: chr(b) if b in printable else chr(next(shifted)) for b in range(256)}

    def token(data: bytes) -> str:
        return "".join(char_of[b] for b in data)

    pieces = ["é", "€", "😀", "日本", " the"]
    vocab = [token(bytes([b])) for b in range(256)] + [token(w.encode()) for w in pieces]
    vocab += [token(p) for p in (b"\xf0\x9f", b"\x98\x80", b"\xe2\x82", b"\xac ")] + ["<eos>"]
    backend = HFTokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    return Tokenizer(backend, frozenset({len(vocab) - 1}), None, False, None, {}), len(vocab)


def test_incremental_text_equals_a_full_decode_for_random_token_sequences():
    """Seeded: token by token (plus the final flush) gives exactly what decoding the whole
    sequence at once gives, whatever the byte splits, invalid bytes and specials."""
    import random

    tokenizer, vocab = byte_level_tokenizer()
    rng = random.Random(0)
    for _ in range(2000):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 16))]
        detok = IncrementalDetokenizer(tokenizer)
        text = "".join(detok.push(t) for t in ids) + detok.flush()
        assert text == tokenizer.decode(ids), ids
