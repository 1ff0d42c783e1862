"""The pipeline benchmark's bubble formulas (the measurements: tests/launch/test_bench.py)."""

import pytest

from ep_runtime.bench.pipeline import bubble_formula, bubble_model


@pytest.mark.parametrize("pp, m, v", [(2, 8, 1), (4, 4, 1), (4, 8, 2), (2, 1, 1)])
def test_equal_stages_give_the_formula(pp, m, v):
    assert bubble_model([0.3] * pp, m, v) == pytest.approx([bubble_formula(pp, m, v)] * pp)


def test_unequal_stages_wait_on_the_slowest():
    """Stage 1 takes 1.0 a micro-batch, stage 0 0.5: the step is 8 * 1.0 + 0.5 = 8.5 for M = 8, of
    which stage 0 computes 4.0 and stage 1 8.0; with two virtual stages the warm-up halves."""
    assert bubble_model([0.5, 1.0], 8) == pytest.approx([1 - 4.0 / 8.5, 1 - 8.0 / 8.5])
    assert bubble_model([0.5, 1.0], 8, 2) == pytest.approx([1 - 4.0 / 8.25, 1 - 8.0 / 8.25])
