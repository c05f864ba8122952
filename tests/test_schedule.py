"""The learning-rate schedule (eaglenest.train.optim.lr_factor) against transformers' own, which
speculators 0.9.0 trains with (docs/RECIPE.md "speculators 0.9.0's recipe, from its code")."""

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

from eaglenest.train.optim import lr_factor

WARMUP, TOTAL = 21, 2199


@pytest.mark.parametrize("schedule, theirs", [("linear", get_linear_schedule_with_warmup),
                                              ("cosine", get_cosine_schedule_with_warmup)])
def test_warmup_from_zero_is_transformers_schedule_and_ours_one_step_ahead_in_the_warmup(schedule, theirs):
    """train.warmup_from_zero true: every step's factor equals transformers' (step 0 at lr 0);
    false: the warmup's step s runs at transformers' s + 1, and the decay is the same."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    transformers_factor = theirs(optimizer, WARMUP, TOTAL).lr_lambdas[0]
    for step in range(TOTAL + 1):
        assert lr_factor(step, WARMUP, TOTAL, schedule, warmup_from_zero=True) == pytest.approx(
            transformers_factor(step), abs=1e-12)
        ours = transformers_factor(step + 1) if step < WARMUP else transformers_factor(step)
        assert lr_factor(step, WARMUP, TOTAL, schedule) == pytest.approx(ours, abs=1e-12)
    assert lr_factor(0, WARMUP, TOTAL, schedule, warmup_from_zero=True) == 0.0
