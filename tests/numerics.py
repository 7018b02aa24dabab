"""How far a result is from its reference, the one way the tests measure it."""

import torch


def relative_error(result, reference) -> float:
    """||result - reference|| / ||reference|| in fp64: of two tensors, or of two dicts of tensors
    with the same keys taken together (all of a model's gradients as one vector). Relative to
    the whole: the reference and hpsft sum in different orders, so each element carries fp32
    rounding of the whole tensor's scale."""
    if isinstance(result, torch.Tensor):
        result, reference = {"": result}, {"": reference}
    assert result.keys() == reference.keys(), sorted(set(result) ^ set(reference))
    diff = sum(float((result[k].detach().double() - reference[k].detach().double()).square().sum()) for k in result)
    norm = sum(float(reference[k].detach().double().square().sum()) for k in result)
    return (diff / max(norm, 1e-60)) ** 0.5


def adamw_fp64_step(param, grad, moments, t, lr, betas, eps, weight_decay) -> None:
    """One step t (from 1) of Loshchilov & Hutter's AdamW in place on an fp64 `param`: decoupled
    decay, then the bias-corrected moments `moments` = (m, v), updated in place."""
    m, v = moments
    grad = grad.double()
    param.mul_(1 - lr * weight_decay)
    m.mul_(betas[0]).add_((1 - betas[0]) * grad)
    v.mul_(betas[1]).add_((1 - betas[1]) * grad * grad)
    m_hat, v_hat = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
    param.sub_(lr * m_hat / (v_hat.sqrt() + eps))
