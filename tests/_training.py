"""Comparing two AdamW runs that differ only in the order of floating-point reductions (two processes averaging their
gradients against one process summing a batch twice as large)."""

import math


NOISY_FRACTION = 0.01  # of a tensor's weights may move past NOISE_ATOL by reduction order (measured: 1 in 6,144)
NOISE_ATOL = 1e-5


def adam_step_bound(steps: int, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """The most one bias-corrected Adam step can move a weight, in units of lr, after `steps` steps, for any
    gradients: m_hat = sum_i w_i g_i and v_hat = sum_i u_i g_i^2 with w and u each summing to one, so by
    Cauchy-Schwarz |m_hat| / sqrt(v_hat) <= sqrt(sum_i w_i^2 / u_i) (1.004 at 3 steps)."""
    w = [(1 - beta1) * beta1 ** (steps - i) / (1 - beta1**steps) for i in range(1, steps + 1)]
    u = [(1 - beta2) * beta2 ** (steps - i) / (1 - beta2**steps) for i in range(1, steps + 1)]
    return max(
        math.sqrt(sum(wi * wi / ui for wi, ui in zip(w[:t], u[:t])) * sum(u[:t]) / sum(w[:t]) ** 2)
        for t in range(1, steps + 1)
    )


def assert_same_adam_training(a, b, *, lr: float, steps: int) -> None:
    """a and b: models trained from one start by AdamW (lr at most `lr`) on the same data. A gradient whose terms
    cancel to near zero keeps a reduction-order error as large as itself, and Adam's normalisation turns that into a
    step of up to ~lr: so a few weights may differ by up to 2 * steps * lr * adam_step_bound (never more), and all
    but NOISY_FRACTION of each tensor agree within NOISE_ATOL (a relative eps 1.2e-7 per gradient, over steps of
    ~lr 1e-3). Training on other data moves most weights of a trained tensor past NOISE_ATOL."""
    bound = 2 * steps * lr * adam_step_bound(steps)
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        diff = (x - y).abs()
        assert diff.max() <= bound, f"{name}: max difference {diff.max():.3g} > {bound:.3g}"
        noisy = (diff > NOISE_ATOL).float().mean().item()
        assert noisy <= NOISY_FRACTION, f"{name}: {noisy:.2%} of the weights differ by more than {NOISE_ATOL}"
