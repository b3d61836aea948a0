"""Autograd: forward and backward traces, connected to ``torch.autograd``."""
from .function import make_autograd_computation
from .split import Split, split_forward_backward

__all__ = ["Split", "split_forward_backward", "make_autograd_computation"]
