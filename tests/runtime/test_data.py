"""The generated Markov data: its loss floor is what a model that knows the chain scores on it."""

import torch

from ep_runtime.data import MarkovText


def test_loss_floor_is_the_expected_loss_of_the_chain_itself():
    """Sample sequences, score each next token by the chain's own (merged) probabilities: the mean
    is the floor, within the sampling error."""
    data = MarkovText(16, successors=4, seed=3)
    tokens = data.batch(20000, 9, seed=1)
    next_VV = torch.zeros(16, 16, dtype=torch.float64).scatter_add_(1, data.next_VN, data.probs_VN.double())
    nll = -next_VV[tokens[:, :-1], tokens[:, 1:]].log()
    assert abs(float(nll.mean()) - data.loss_floor(9)) < 4 * float(nll.std()) / nll.numel() ** 0.5
    assert data.loss_floor(9) < data.uniform_loss
