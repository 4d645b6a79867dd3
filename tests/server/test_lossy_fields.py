"""The lossy verifiers through the API: a `speculative` object's FLy and entropy-budget fields
reach the request's SamplingParams; out-of-range values are refused; off means off."""

import pytest
from pydantic import ValidationError

from specserve.server.errors import APIError
from specserve.server.preparation import ModelLimits, completion_jobs
from specserve.server.protocol import CompletionRequest

LIMITS = ModelLimits("m", 64, 100, speculative=True)


def params_of(speculative):
    req = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3],
                                            "speculative": speculative})
    (job,) = completion_jobs(req, tokenizer=None, limits=LIMITS)
    return job


def test_speculative_object_sets_fly_and_entropy_budget_fields():
    job = params_of({"tv_budget": 0.3, "tv_entropy_top_k": 4, "fly_window": 2,
                     "fly_entropy_threshold": 0.5, "fly_top_k": 5})
    p = job.params
    assert (p.tv_entropy_top_k, p.fly_window, p.fly_entropy_threshold, p.fly_top_k) == (4, 2, 0.5, 5)
    assert job.speculation.tv_budget == 0.3


def test_omitted_or_disabled_leaves_them_off():
    for speculative in (None, {"enabled": False, "fly_window": 2}, {"num_speculative_tokens": 2}):
        p = params_of(speculative).params
        assert p.fly_window is None and p.tv_entropy_top_k is None
        assert (p.fly_entropy_threshold, p.fly_top_k) == (0.3, 3)  # the defaults


def test_published_fly_is_on_by_itself_with_its_window_and_threshold_in_nats():
    p = params_of({"fly_variant": "published", "fly_entropy_threshold": 1.05}).params
    assert (p.fly_variant, p.fly_window, p.fly_entropy_threshold, p.fly_top_k) == \
        ("published", 6, 1.05, 3)
    assert params_of({"fly_variant": "published", "fly_window": 4}).params.fly_window == 4


@pytest.mark.parametrize("speculative", [{"fly_window": 2, "fly_entropy_threshold": 1.05},
                                         {"fly_variant": "published",
                                          "fly_entropy_threshold": 1.2}])
def test_a_threshold_beyond_its_variants_range_is_a_400_naming_the_field(speculative):
    with pytest.raises(APIError) as info:
        params_of(speculative)
    assert info.value.status == 400 and info.value.param == "fly_entropy_threshold"


@pytest.mark.parametrize("field,value", [("fly_window", 0), ("fly_entropy_threshold", -0.1),
                                         ("fly_top_k", 1), ("tv_entropy_top_k", 1),
                                         ("fly_window", 1.0), ("fly_variant", "paper")])
def test_out_of_range_lossy_fields_are_refused(field, value):
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": [1], "speculative": {field: value}})
    assert info.value.errors()[0]["loc"][0] == "speculative"
