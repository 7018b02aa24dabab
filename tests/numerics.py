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
