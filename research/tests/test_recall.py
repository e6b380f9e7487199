"""Long-range recall beyond the attention window: BST solves it, Slide cannot (chance is 1/8)."""

import pytest

from research.long_range_recall import train_and_eval


@pytest.mark.slow  # two 300-step trainings (minutes on 2 cores); the code it runs is covered by the default tests
def test_bst_recalls_beyond_two_blocks_and_slide_does_not():
    # The key sits 46 tokens before the query; block attention sees at most 2W = 16 tokens back.
    bst_acc, _ = train_and_eval(bst=True, length=48, block_len=8, steps=300)
    slide_acc, _ = train_and_eval(bst=False, length=48, block_len=8, steps=300)
    assert bst_acc > 0.9, bst_acc
    assert slide_acc < 0.3, slide_acc
