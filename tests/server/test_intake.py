"""`Intake` (the bounded preparation stage) and `check_body` (what is refused before the app
validates a body), without a server."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from specserve.server.errors import APIError
from specserve.server.intake import Intake, check_body, longest_token_chars
from specserve.server.limits import prompt_char_bound


def test_a_full_intake_refuses_at_once_and_a_slot_is_held_until_its_work_ends():
    release = threading.Event()

    async def scenario():
        intake = Intake(max_preparing=2, retry_after_s=3, threads=1)
        running = asyncio.ensure_future(intake.run(release.wait))  # on the one thread
        queued = asyncio.ensure_future(intake.run(lambda: "queued"))  # behind it
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as refused:
            await intake.run(lambda: "refused")
        queued.cancel()  # its client went away: the queued work is dropped, its slot freed
        await asyncio.sleep(0.05)
        running.cancel()  # gone too, but its work still runs: the slot stays taken
        await asyncio.sleep(0.05)
        held = intake.preparing
        release.set()
        await asyncio.sleep(0.05)
        return refused.value, held, intake.preparing, await intake.run(lambda: 7)

    refused, held, after, answer = asyncio.run(scenario())
    assert refused.status == 429 and refused.headers == {"Retry-After": "3"}
    assert (held, after, answer) == (1, 0, 7)


@pytest.mark.parametrize(("path", "body", "code"), [
    ("/v1/chat/completions", b'{"messages": [', "invalid_json"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}] * 5},
     "too_many_messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}] * 5}]}, "too_many_messages"),
    ("/v1/completions", {"prompt": [1] * 10}, "context_length_exceeded"),
    ("/v1/completions", {"prompt": [[1], [1] * 10]}, "context_length_exceeded"),
])
def test_a_body_beyond_the_counts_is_refused_before_validation(path, body, code):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    problem = check_body(path, raw, max_messages=4, max_model_len=10)
    assert problem is not None and problem.status == 400 and problem.code == code


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}] * 4}),
    ("/v1/completions", {"prompt": [1] * 9}), ("/v1/completions", {"prompt": ["a"] * 16}),
    ("/v1/completions", [1, 2]),  # not an object: the app's validation says what is wrong
])
def test_a_body_within_the_counts_goes_on_to_the_app(path, body):
    assert check_body(path, json.dumps(body).encode(), max_messages=4, max_model_len=10) is None


def test_the_prompt_character_bound_is_the_context_times_the_longest_token():
    vocabulary = {"a": 0, "ĠĠĠĠ": 1, "hello": 2}
    assert longest_token_chars(vocabulary) == 5
    assert prompt_char_bound(4096, longest_token_chars(vocabulary)) == 4096 * 5
