"""`ServerLimits` (validation, Host names, slots per request) and `Admission` (the waiting
bound and its 429), without a server."""

from __future__ import annotations

import pytest

from specserve.server.admission import Admission
from specserve.server.errors import APIError
from specserve.server.limits import ServerLimits


@pytest.mark.parametrize(("field", "value"), [
    ("max_choices", 0), ("max_choices", 1.5), ("max_prompt_chars", True), ("max_waiting", -1),
    ("max_slot_share", 0.0), ("max_slot_share", 1.5), ("request_timeout", 0),
    ("request_timeout", float("inf")), ("keep_alive_s", -1.0), ("header_timeout_s", 0),
    ("max_connections", 0), ("allowed_hosts", ()), ("allowed_hosts", ("",))])
def test_bad_limits_raise_value_errors_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must"):
        ServerLimits(**{field: value})


@pytest.mark.parametrize(("host", "allowed"), [
    ("localhost", True), ("LOCALHOST:8000", True), ("127.0.0.1:8000", True), ("[::1]:8000", True),
    ("[::1]", True), ("evil.example", False), ("127.0.0.1.evil.example:80", False),
    ("localhost.evil.example", False), ("", False), ("[::1", False)])
def test_only_loopback_host_names_are_allowed_by_default(host, allowed):
    assert ServerLimits().allows_host(host) is allowed


def test_allowed_hosts_extend_or_open_the_list():
    limits = ServerLimits(allowed_hosts=("api.example", "localhost"))
    assert limits.allows_host("API.example:443") and not limits.allows_host("127.0.0.1")
    assert ServerLimits(allowed_hosts=("*",)).allows_host("anything.example")


def test_a_request_gets_its_share_of_the_slots_and_at_least_one():
    assert ServerLimits(max_slot_share=0.5).slots_per_request(8) == 4
    assert ServerLimits(max_slot_share=0.5).slots_per_request(1) == 1
    assert ServerLimits(max_slot_share=1.0).slots_per_request(3) == 3


def test_admission_refuses_beyond_slots_plus_waiting_and_takes_back_released_holds():
    admission = Admission(slots=2, max_waiting=1, retry_after_s=3)
    tickets = [admission.admit(1), admission.admit(2)]
    with pytest.raises(APIError) as refused:
        admission.admit(1)
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "3"}
    assert refused.value.body()["error"]["type"] == "rate_limit_error"
    tickets[1].release()
    tickets[1].release()  # idempotent
    assert admission.held == 1
    admission.admit(2)
    assert admission.held == 3


def test_an_idle_server_admits_even_a_request_beyond_its_capacity():
    admission = Admission(slots=1, max_waiting=0, retry_after_s=1)
    ticket = admission.admit(4)  # nothing else runs: refusing it would refuse it forever
    with pytest.raises(APIError):
        admission.admit(1)
    ticket.release()
    assert admission.held == 0


def test_max_new_tokens_bounds_what_a_request_asks_for_or_leaves_out_and_never_refuses(
        tmp_path):
    from specserve.server.preparation import ModelLimits, chat_jobs
    from specserve.server.protocol import ChatCompletionRequest
    from tests.server.tool_calls import templates

    tok = templates.char_tokenizer(tmp_path, ["<s>", "</s>"],
                                   "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    limits = ModelLimits("m", 64, tok.vocab_size, speculative=False)

    def max_tokens(cap, **fields):
        req = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hello"}], **fields})
        return chat_jobs(req, tok, limits, ServerLimits(max_new_tokens=cap))[0].params.max_tokens

    room = 64 - 5
    assert max_tokens(None) == room and max_tokens(None, max_tokens=7) == 7
    assert max_tokens(16) == 16 and max_tokens(16, max_tokens=7) == 7
    assert max_tokens(16, max_tokens=40) == 16 and max_tokens(500) == room
    with pytest.raises(ValueError):
        ServerLimits(max_new_tokens=0)
