"""Bounded recurrent-mode cache of the Block-State Transformer.

A [`BSTCache`] holds, per layer, only state whose size does not depend on how many tokens were decoded:

* ``k``, ``v`` `(B, R, H, d_h)` and ``kpos`` `(B, R)`: ring buffer of the keys/values of the last R tokens
  (R = W + 1 for block and BST layers, 2W for BRecT layers, which also need the previous block), slot = position % R,
  ``kpos = -1`` marks an empty slot;
* ``ssm_state``: the SSM kernel's own state (``ssm_bst``): the complex S4D state `(B, Ds, N2)`, or for ``unstruct``
  kernels the input history `(B, Ds, max_position_embeddings)` (newest last; bounded by the filter length);
* ``ctx_k``, ``ctx_v``: context keys/values of the current block: SH/MH `(B, W, H, d_h)` ring with ``ctx_pos``;
  MF `(B, S, H, d_h)`; ``mf_last`` `(B, S, Ds)`: the latest MF SSM output (the next block's context);
* ``rec_state`` `(B, S, D)` and its keys/values ``rec_k``, ``rec_v`` `(B, S, H, d_h)` for BRecT layers.

``positions`` `(B,)` counts the real tokens each row has seen (rows of a padded batch differ); ``seen_tokens`` (a
Python int) counts every position processed, padding included: what ``generate`` slices already-processed inputs by.
``common_position`` (Python int or None) is every row's real-token count when all rows agree (no padding), and
``docs_on_grid`` says whether every row's document started on the block grid; both let ``BSTModel.forward`` choose
its path without reading tensors back to the host.
"""

from collections import deque
from dataclasses import dataclass, fields

import torch


# Positions a recording cache can take back (``BSTCache.crop``): assisted decoding verifies at most this many drafted
# tokens per round.
MAX_ROLLBACK = 64


def cache_signature(config) -> tuple:
    """The structural fields a cache depends on: a cache only fits models with the same signature."""
    return (
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.head_dim,
        config.block_len,
        config.context_mode,
        config.ssm_kind,
        config.ssm_channels,
        config.ssm_state_size,
        config.num_context_states,
        tuple(config.bst_layer_indices),
        tuple(config.recurrent_layer_indices),
        tuple(getattr(config, "gss_layer_indices", ())),
        config.num_recurrent_states,
        config.max_position_embeddings,
    )


@dataclass
class BSTLayerCache:
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    kpos: torch.Tensor | None = None
    ssm_state: torch.Tensor | None = None
    ctx_k: torch.Tensor | None = None
    ctx_v: torch.Tensor | None = None
    ctx_pos: torch.Tensor | None = None
    mf_last: torch.Tensor | None = None
    rec_state: torch.Tensor | None = None
    rec_k: torch.Tensor | None = None
    rec_v: torch.Tensor | None = None
    # Position at which each row's current document started (BSTCache.reset_rows); blocks count from it.
    doc_start: torch.Tensor | None = None
    # Not batched: per-step constants (S4 step matrices, T5 bias per distance, unstruct filter taps), each reused
    # while the parameters it was computed from are unchanged (``ssm_bst.memoised``).
    step_memo: dict | None = None

    def tensors(self):
        unbatched = ("step_memo",)
        return [
            (f.name, getattr(self, f.name))
            for f in fields(self)
            if f.name not in unbatched and getattr(self, f.name) is not None
        ]

    def apply(self, fn):
        for name, tensor in self.tensors():
            setattr(self, name, fn(tensor))


class BSTCache:
    """Recurrent-mode generation state of a BST model (returned as ``past_key_values``).

    Args:
        config ([`BSTConfig`]): the model's configuration; a cache only fits the model it was made for.
        batch_size (`int`): number of rows.
    """

    is_compileable = False
    # ``crop`` takes back the last positions processed while recording (``activate_past_recording``).
    is_croppable = True

    def __init__(self, config, batch_size: int):
        self.num_layers = config.num_hidden_layers
        self.block_len = config.block_len
        self.hidden_size = config.hidden_size
        self.model_signature = cache_signature(config)
        self.batch_size = batch_size
        self.layers = [BSTLayerCache() for _ in range(config.num_hidden_layers)]
        self.positions: torch.Tensor | None = None
        self.doc_start: torch.Tensor | None = None
        self.seen_tokens = 0
        self.common_position: int | None = None
        self.docs_on_grid = True
        self.record_past = False
        # Per recorded position (newest last): per layer, what its step overwrote ([`capture`]).
        self._undo: deque = deque(maxlen=MAX_ROLLBACK)

    def __len__(self):
        return self.num_layers

    @property
    def is_empty(self) -> bool:
        return self.positions is None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions processed so far, padding included (what ``generate`` slices already-processed inputs by)."""
        return self.seen_tokens

    def get_mask_sizes(self, *args, **kwargs):
        raise NotImplementedError("BSTCache builds its own block masks.")

    def _apply(self, fn):
        self._undo.clear()  # recorded states are per row: a batch change drops them
        for layer in self.layers:
            layer.apply(fn)
        if self.positions is not None:
            self.positions = fn(self.positions)
            self.doc_start = fn(self.doc_start)

    def reorder_cache(self, beam_idx: torch.LongTensor):
        """Select rows in place (beam search)."""
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))
        self.batch_size = int(beam_idx.numel())

    def batch_repeat_interleave(self, repeats: int):
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))
        self.batch_size *= repeats

    def batch_select_indices(self, indices: torch.Tensor):
        self._apply(lambda t: t[indices])
        self.batch_size = int(self.positions.shape[0]) if self.positions is not None else self.batch_size

    # -- rollback (assisted / speculative decoding) -----------------------------------------------------------------
    def activate_past_recording(self):
        """Record what each decoded position overwrites, so that [`crop`] can take back up to ``MAX_ROLLBACK`` of the
        latest positions (``generate`` calls this for assisted decoding)."""
        self.record_past = True

    @staticmethod
    def capture(layer: BSTLayerCache, positions: torch.Tensor) -> dict:
        """What one recurrent step of ``layer`` at ``positions`` `(B,)` will overwrite.

        Ring buffers (keys/values, SH/MH context) are written in place at slot ``position % ring``: their old slot is
        copied. An unstruct history shifts by one: its oldest input is copied. Every other state (S4D state, MF
        context, BRecT state) is replaced by a new tensor: the old one is kept by reference.
        """
        rows = torch.arange(positions.shape[0], device=positions.device)
        ring_names = {"k", "v", "kpos"} | ({"ctx_k", "ctx_v", "ctx_pos"} if layer.ctx_pos is not None else set())
        changes = {}
        for name, tensor in layer.tensors():
            if name == "doc_start":
                continue
            if name in ring_names:
                slot = positions.remainder(tensor.shape[1])
                changes[name] = ("slot", slot, tensor[rows, slot].clone())
            elif name == "ssm_state" and not tensor.is_complex():
                changes[name] = ("shift", tensor[..., 0].clone())
            else:
                changes[name] = ("whole", tensor)
        return changes

    def push_undo(self, entries: list):
        """Append the captures of a chunk: ``entries[t][layer]`` for each of its positions t."""
        self._undo.extend(entries)

    def crop(self, tokens_to_remove: int):
        """Take back the last ``-tokens_to_remove`` positions (transformers' convention: a negative count; 0 does
        nothing). Needs [`activate_past_recording`] before those positions were processed."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"BSTCache.crop takes minus the number of positions to remove, got {tokens_to_remove}: use "
                f"crop(-n) to take back the last n positions."
            )
        n = -tokens_to_remove
        if n == 0:
            return
        if n > len(self._undo):
            raise ValueError(
                f"BSTCache can take back only the {len(self._undo)} latest positions processed while recording "
                f"(activate_past_recording(); at most {MAX_ROLLBACK}), asked for {n}."
            )
        for _ in range(n):
            for layer, changes in zip(self.layers, self._undo.pop()):
                for name, (how, *data) in changes.items():
                    tensor = getattr(layer, name)
                    if how == "slot":
                        slot, old = data
                        rows = torch.arange(slot.shape[0], device=slot.device)
                        tensor.index_put_((rows, slot), old)
                    elif how == "shift":
                        setattr(layer, name, torch.cat([data[0][..., None], tensor[..., :-1]], -1))
                    else:
                        setattr(layer, name, data[0])
        self.positions = self.positions - n
        self.seen_tokens -= n
        if self.common_position is not None:
            self.common_position -= n

    def reset_rows(self, rows: torch.Tensor) -> "BSTCache":
        """Start a new document in the rows where ``rows`` (bool `(B,)`) is True, keeping the other rows' state.

        Used when streaming consecutive segments of documents (Transformer-XL / BRecT training, evaluation): the
        reset rows forget their cached keys/values, SSM state and context, and the BRecT state restarts from the
        learned initial state, exactly as if their next token were the first of a sequence.
        """
        if self.positions is None:
            return self
        rows = rows.to(device=self.positions.device, dtype=torch.bool)
        for layer in self.layers:
            if layer.kpos is not None:
                layer.kpos = layer.kpos.masked_fill(rows[:, None], -1)
            if layer.ctx_pos is not None:
                layer.ctx_pos = layer.ctx_pos.masked_fill(rows[:, None], -1)
            if layer.ssm_state is not None:
                keep = (~rows).reshape((-1,) + (1,) * (layer.ssm_state.dim() - 1)).to(layer.ssm_state.dtype)
                layer.ssm_state = layer.ssm_state * keep
        self.doc_start = torch.where(rows, self.positions, self.doc_start)
        if self.common_position is None or self.common_position % self.block_len:
            # A row may now start a document off the block grid (checked without reading ``rows`` back).
            self.docs_on_grid = False
        return self

    def detach(self) -> "BSTCache":
        """Stop gradients through the cache (Transformer-XL / BRecT segment streaming during training)."""
        self._apply(lambda t: t.detach())
        return self

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Flat ``{name: tensor}`` of the cache's state (for safetensors; nothing is pickled)."""
        out = {}
        if self.positions is not None:
            out["positions"] = self.positions
            out["doc_start"] = self.doc_start
            out["seen_tokens"] = torch.tensor(self.seen_tokens, dtype=torch.long)
        for i, layer in enumerate(self.layers):
            for name, tensor in layer.tensors():
                if name != "doc_start":  # shared by all layers: stored once above
                    out[f"layers.{i}.{name}"] = tensor.contiguous()
        return out

    @classmethod
    def from_tensors(cls, config, tensors: dict[str, torch.Tensor]) -> "BSTCache":
        """Inverse of [`to_tensors`] for a model with this ``config``."""
        batch = int(tensors["positions"].shape[0]) if "positions" in tensors else 0
        cache = cls(config, batch)
        names = {f.name for f in fields(BSTLayerCache)}
        for key, tensor in tensors.items():
            if key in ("positions", "doc_start"):
                setattr(cache, key, tensor)
                continue
            if key == "seen_tokens":
                cache.seen_tokens = int(tensor)
                continue
            _, index, name = key.split(".", 2)
            if name not in names or not 0 <= int(index) < cache.num_layers:
                raise ValueError(f"Unexpected tensor {key!r} in a saved BSTCache.")
            # Fresh memory: decoding writes the ring buffers in place (loaded storage may be shared or read-only).
            tensor = tensor.clone()
            kind = config.layer_kind(int(index))
            s4 = kind == "gss" or (kind == "bst" and config.ssm_kind == "s4")
            if name == "ssm_state" and s4 and not tensor.is_complex():
                tensor = torch.view_as_complex(tensor)  # saved by an older version (a real view)
            setattr(cache.layers[int(index)], name, tensor)
        for layer in cache.layers:
            layer.doc_start = cache.doc_start
        if cache.positions is not None:
            if "seen_tokens" not in tensors:  # saved before seen_tokens existed: the longest row
                cache.seen_tokens = int(cache.positions.max())
            if bool((cache.positions == cache.positions[0]).all()):
                cache.common_position = int(cache.positions[0])
            cache.docs_on_grid = bool((cache.doc_start.remainder(cache.block_len) == 0).all())
        return cache

    def nbytes(self) -> int:
        total = 0 if self.positions is None else self.positions.numel() * self.positions.element_size()
        for layer in self.layers:
            total += sum(t.numel() * t.element_size() for _, t in layer.tensors())
        return total


__all__ = ["MAX_ROLLBACK", "BSTCache", "BSTLayerCache", "cache_signature"]
