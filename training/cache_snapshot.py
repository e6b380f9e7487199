"""Snapshots of a BST cache as flat ``{name: tensor}`` dicts (safetensors; nothing pickled): the streamed
Transformer-XL / BRecT training state of a checkpoint (``training/train.py``), tests and tools.

Names: ``positions``, ``doc_start``, ``seen_tokens`` (the row state), then ``layers.{i}.{name}`` for each state a
layer holds (``k``, ``v``, ``kpos``, ``ssm_state``, ``ctx_k``, ...: ``modeling_bst.cache_bst``), as the cache's
pytree leaves are named.
"""

import torch
from transformers import Cache

from modeling_bst.cache_bst import BSTCache


def cache_to_tensors(cache: Cache) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of a BST cache's state: copies, which later decode steps (writing in place) leave alone."""
    rows, out = cache.layers[0], {}
    if not rows.is_empty:
        out.update(positions=rows.positions.clone(), doc_start=rows.doc_start.clone(), seen_tokens=rows.seen.clone())
    for i, layer in enumerate(cache.layers):
        for name, tensor in layer.tensors():
            out[f"layers.{i}.{name}"] = tensor.clone(memory_format=torch.contiguous_format)
    return out


def cache_from_tensors(config, tensors: dict[str, torch.Tensor]) -> BSTCache:
    """Inverse of [`cache_to_tensors`] for a model with this ``config``."""
    cache = BSTCache(config)
    for key, tensor in tensors.items():
        if key in ("positions", "doc_start", "seen_tokens"):
            continue
        _, index, name = key.split(".", 2)
        if not 0 <= int(index) < len(cache.layers) or name not in cache.layers[int(index)].names:
            raise ValueError(f"Unexpected tensor {key!r} in a saved BST cache.")
        if tensor.is_complex():  # an S4D state saved before states were real (re, im) pairs: (B, Ds, N2) complex
            tensor = torch.view_as_real(tensor)
        # Fresh memory: decoding writes the states in place (loaded storage may be shared or read-only).
        cache.layers[int(index)].set(**{name: tensor.clone()})
    if "positions" in tensors:
        seen = tensors["seen_tokens"].reshape(()).to(torch.long).clone()
        cache.layers[0].set_rows(tensors["positions"].clone(), tensors["doc_start"].clone(), seen, known=False)
    return cache


def cache_nbytes(cache: Cache) -> int:
    """Bytes held by a BST cache's state (the row state included)."""
    return sum(t.numel() * t.element_size() for t in cache_to_tensors(cache).values())
