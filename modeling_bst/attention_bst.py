"""The RMS norm module, shared by the layers (modeling_bst.py) and the context builders (context_bst.py)."""

import torch
from torch import nn

from .functional_bst import rms_norm


class BSTRMSNorm(nn.Module):
    """RMS norm computed in float32 (meliad "LayerNorm": no mean, no bias, learned scale)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)
