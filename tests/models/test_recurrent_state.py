"""Rollback of the Gated DeltaNet layers' recurrent state by snapshots (`recurrent_state.py`):
a pass that starts where a rejected draft began gives bit for bit what a run that never saw
the draft gives; a start with no snapshot is an internal error; snapshots are bounded; a freed
block table frees its sequence's state."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.runner import ModelRunner
from specserve.models.hybrid import DEFAULT_STATE_HISTORY, HybridModel
from specserve.models.transformer import ForwardBatch
from specserve.weights.hf_loader import load_hf_dir
from tests import hybrid_tiny

PREFIX = [5, 17, 33, 8, 90, 41, 3, 3, 12, 60]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(config, float32 weights) of the tiny Qwen3.5."""
    path = hybrid_tiny.save(hybrid_tiny.build("qwen35"), tmp_path_factory.mktemp("q35") / "hf")
    cfg, _, weights = load_hf_dir(path, torch.float32)
    return cfg, weights


def run(model, pool, key, passes):
    """Feed `passes` [(rows, start)] to sequence `key` (blocks 0-3); the last pass's logits."""
    for rows, start in passes:
        (logits,) = model.forward(ForwardBatch.paged([rows], [start], [[0, 1, 2, 3]], [key]),
                                  pool)
    return logits


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_a_rejected_draft_leaves_the_next_pass_identical_to_a_run_without_it(checkpoint,
                                                                             accepted):
    """Verify [x, d1, d2, d3] after the prefix, keep x and `accepted` drafts, then feed the
    recovered token and one more: the same bits as feeding only the kept tokens."""
    model = HybridModel(*checkpoint)
    verify = [70, 71, 72, 73]
    kept, s = verify[:1 + accepted], len(PREFIX)
    nxt = [11, 12]
    with_draft = run(model, model.new_pool(4, 16), "a",
                     [(PREFIX, 0), (verify, s), (nxt, s + len(kept))])
    without = run(model, model.new_pool(4, 16), "b",
                  [(PREFIX, 0), (kept, s), (nxt, s + len(kept))])
    assert torch.equal(with_draft, without)
    whole = run(model, model.new_pool(4, 16), "c", [(PREFIX + kept + nxt, 0)])
    assert (whole[-len(nxt):] - without).abs().max() <= 1e-5  # one pass, other row splits


def test_a_pass_may_start_over_at_the_position_of_the_last_one(checkpoint):
    """The same verify rows at the same start twice (a round redone) give the same bits."""
    model = HybridModel(*checkpoint)
    pool = model.new_pool(4, 16)
    first = run(model, pool, "a", [(PREFIX, 0), ([70, 71, 72], len(PREFIX))])
    again = run(model, pool, "a", [([70, 71, 72], len(PREFIX))])
    assert torch.equal(first, again)


def test_snapshots_are_bounded_and_a_start_without_one_is_an_internal_error(checkpoint):
    model = HybridModel(*checkpoint, state_history=4)
    pool = model.new_pool(4, 16)
    run(model, pool, "a", [(PREFIX, 0)])
    assert list(pool.states.positions("a")) == [7, 8, 9, 10]  # the states after 7..10 tokens
    run(model, pool, "a", [([70, 71, 72], 10)])  # keeps 10, then the 3 new ones
    assert list(pool.states.positions("a")) == [10, 11, 12, 13]
    with pytest.raises(AssertionError, match="no recurrent state after position 9"):
        run(model, pool, "a", [([1], 9)])
    with pytest.raises(AssertionError, match="no recurrent state after position 14"):
        run(model, pool, "a", [([1], 14)])
    assert list(pool.states.positions("a")) == [10, 11, 12, 13]  # a failed pass stores nothing
    fresh = run(model, pool, "a", [(PREFIX, 0)])  # position 0 always starts over
    assert torch.equal(fresh, run(model, model.new_pool(4, 16), "b", [(PREFIX, 0)]))


def test_a_model_with_linear_layers_needs_its_sequences_named(checkpoint):
    model = HybridModel(*checkpoint)
    with pytest.raises(ValueError, match="seq_keys"):
        model.forward(ForwardBatch.paged([PREFIX], [0], [[0]]), model.new_pool(4, 16))


def test_freeing_a_block_table_frees_its_recurrent_state(checkpoint):
    runner = ModelRunner(HybridModel(*checkpoint), num_blocks=8)
    blocks = runner.block_manager(prefix_caching=True)
    assert not blocks.prefix_caching  # KV blocks cannot restore recurrent state
    tables = [blocks.new_table() for _ in range(3)]
    for t in tables:
        assert blocks.reserve(t, len(PREFIX))
    runner.forward([PREFIX] * 3, [0] * 3, tables)
    states = runner.cache.states
    assert len(states) == 3
    blocks.free(tables[1])
    assert len(states) == 2 and not states.positions(tables[1])
    for t in (tables[0], tables[2]):
        blocks.free(t)
    assert len(states) == 0 and blocks.num_used == 0


def test_the_default_history_covers_the_longest_verify_pass_and_its_start():
    from specserve.speculative.config import MAX_SPECULATIVE_TOKENS

    assert DEFAULT_STATE_HISTORY >= MAX_SPECULATIVE_TOKENS + 2
