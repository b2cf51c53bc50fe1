"""The top-k bench's row distributions (built on CPU here; the bench itself needs CUDA)."""

import pytest
import torch

from dsacache.bench.topk import DISTRIBUTIONS, make_logits


@pytest.mark.parametrize("dist", list(DISTRIBUTIONS))
def test_each_distribution_is_what_it_says(dist):
    logits, lens = make_logits(14, 4096, seed=3, dist=dist, device="cpu")
    assert logits.shape == (14, 4096) and logits.dtype == torch.float32
    assert lens.dtype == torch.int32 and (lens == 4096).all()
    finite = logits[~logits.isnan()]
    if dist == "ramp":  # the last quarter holds most of the top 5 %
        top = logits[0].topk(204).indices
        assert (top >= 3072).float().mean() > 0.8
    elif dist == "ties":
        assert logits.unique().numel() <= 50
    elif dist == "sorted":
        assert (logits.diff(dim=1) >= 0).all()
    elif dist == "mixed":
        assert logits.isnan().any() and (finite == 0).any()
    else:
        assert not logits.isnan().any()


def test_unknown_distribution_is_refused():
    with pytest.raises(ValueError, match="allowed: randn, ramp"):
        make_logits(2, 64, dist="zipf", device="cpu")
