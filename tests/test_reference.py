"""The float64 reference the exactness tests trust, checked by finite differences."""

import numpy as np
import pytest
from pfc_reference import loss_and_grads as reference


@pytest.mark.parametrize("subcenters, threshold", [(1, 0.0), (3, 0.0), (1, 0.3), (3, 0.3)])
def test_reference_gradients_match_finite_differences(subcenters, threshold):
    """Sub-centers (the class's cosine the max of its rows') and inter-class filtering
    (a filtered cosine is a constant 0) too: away from ties and the threshold, both are
    differentiable, and the reference's gradients must be their derivatives."""
    rng = np.random.default_rng(3)
    x, weight = rng.normal(size=(5, 6)), rng.normal(size=(9 * subcenters, 6))
    labels = np.array([0, 3, 3, 8, 5])
    columns = np.array([0, 1, 3, 5, 6, 8])  # a sampled subset: classes 2, 4, 7 left out
    margin, s = (1.0, 0.4, 0.1), 8.0

    def loss_and_grads(x, labels, weight, margin, s, columns):
        return reference(x, labels, weight, margin, s, columns, subcenters, threshold)

    _, grad_x, grad_w, filtered = loss_and_grads(x, labels, weight, margin, s, columns)
    assert (filtered > 0) == (threshold > 0)
    h = 1e-6
    for array, grad in ((x, grad_x), (weight, grad_w)):
        numeric = np.zeros_like(array)
        for i in np.ndindex(array.shape):
            old = array[i]
            array[i] = old + h
            up = loss_and_grads(x, labels, weight, margin, s, columns)[0]
            array[i] = old - h
            down = loss_and_grads(x, labels, weight, margin, s, columns)[0]
            array[i] = old
            numeric[i] = (up - down) / (2 * h)
        np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-8)
    left_out = np.array([2, 4, 7])[:, None] * subcenters + np.arange(subcenters)
    assert (grad_w[left_out.reshape(-1)] == 0).all()
