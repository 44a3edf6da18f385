"""The float64 reference the exactness tests trust, checked by finite differences."""

import numpy as np
from pfc_reference import loss_and_grads


def test_reference_gradients_match_finite_differences():
    rng = np.random.default_rng(3)
    x, weight = rng.normal(size=(5, 6)), rng.normal(size=(9, 6))
    labels = np.array([0, 3, 3, 8, 5])
    columns = np.array([0, 1, 3, 5, 6, 8])  # a sampled subset: rows 2, 4, 7 left out
    margin, s = (1.0, 0.4, 0.1), 8.0
    _, grad_x, grad_w = loss_and_grads(x, labels, weight, margin, s, columns)
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
    assert (grad_w[[2, 4, 7]] == 0).all()
