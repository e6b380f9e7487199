"""Bounded recurrent-mode cache of the Block-State Transformer, as a transformers ``Cache``.

A [`BSTCache`] is a ``transformers.Cache`` of one [`BSTLayerCache`] per model layer. The layer classes register
themselves under BST's layer types (``_layer_type``: ``"bst_block"``, ``"bst_context"``, ``"bst_recurrent"``,
``"bst_gss"``, prefixed so that no other family's names collide), so transformers' own
``DynamicCache(config=bst_config)``, the cache ``generate`` prepares by default, is made of the same layers; the
model reads it through a ``BSTCache`` over its layers ([`BSTCache.of`]). That registry is process-wide: where several
copies of this code are loaded (``trust_remote_code`` folders, each its own module, and the installed package), it
holds the last copy's classes, and each model takes fresh layers of another copy as its own ([`BSTCache.of`]). transformers' sliding-window
and linear-attention layers do not fit: a BST layer's attention ring is indexed by each row's own position (left
padding, document resets), its context states depend on the block grid, and assisted decoding needs an exact
rollback of the SSM and recurrent states ([`BSTLayerCache.crop`]), which their ``crop`` does not give.

Each layer holds only state whose size does not depend on how many tokens were decoded, in typed parts that the
model's layers use through their methods (saved names in brackets):

* ``attention`` ([`AttentionCache`]): ring buffer of the keys/values of the last R tokens `(B, R, H, d_h)` (R = W + 1
  for block and BST layers, 2W for BRecT layers, which also need the previous block), slot = position % R, with
  their positions `(B, R)` (-1: empty slot) [``k``, ``v``, ``kpos``];
* ``ssm`` ([`SSMStateCache`]): the SSM kernel's own state (``ssm_bst``): the complex S4D state `(B, Ds, N2)`, or for
  ``unstruct`` kernels the input history `(B, Ds, max_position_embeddings)` [``ssm_state``] (SH/MH decoding also
  keeps the current chunk's pending outputs `(B, C, Ds, M)`, derived, not saved);
* ``context``: SH/MH ([`TokenContextCache`]) the current block's context keys/values, a W-slot ring
  [``ctx_k``, ``ctx_v``, ``ctx_pos``]; MF ([`BlockContextCache`]) the block's S context keys/values and the latest
  SSM outputs `(B, S, Ds)`, the next block's context [``ctx_k``, ``ctx_v``, ``mf_last``];
* ``recurrent`` ([`RecurrentStateCache`]): the BRecT state `(B, S, D)` and its keys/values [``rec_state``, ``rec_k``,
  ``rec_v``].

Row state, in every layer (transformers' ``Cache`` applies ``reorder_cache``, ``crop``, ... layer by layer, so each
layer keeps its own copy; they always agree): ``positions`` `(B,)` counts the real tokens each row has seen (rows of
a padded batch differ); ``doc_start`` `(B,)` where each row's current document started; ``seen`` (a 0-d tensor)
counts every position processed, padding included: what ``generate`` slices already-processed inputs by
(``get_seq_length()``, a Python int).

Host mirrors. ``seen_tokens`` (int), ``common_position`` (every row's real-token count when all rows agree, else
None) and ``docs_on_grid`` (every row's document started on the block grid) let ``BSTModel.forward`` choose its path
without reading tensors back to the host. They are kept up to date in eager mode; under tracing (``torch.export``,
``torch.compile``) a step marks the first two unknown instead of reading or writing a changing Python value (which
would fix a traced graph to one position), and a cache rebuilt from its pytree leaves has all three unknown. An
unknown mirror is derived from the tensors once, on its next read in eager mode (one host read), and is conservative
under tracing (``common_position`` None, ``docs_on_grid`` False: a continued chunk takes the stepwise form).

``BSTCache`` is a registered pytree node ([`register_pytree`]): its leaves are ``positions``, ``doc_start``,
``seen`` (the first layer's), then every layer part's tensors in ``SAVED_NAMES`` order, named as in
[`BSTCache.to_tensors`]; its context is the structure only (layer types and parts, model signature), which no decode
step changes, so one exported or compiled decode step serves every position.

Fixed addresses. Without gradients (decoding, evaluation) a step updates every state in place ([`assign`]): the ring
buffers slot by slot, the other states by copying the new values over the old. A state tensor then keeps its memory
from the prefill to the last step, which CUDA graphs (``torch.compile(mode="reduce-overhead")``) need twice: an input
written in place must have a static address ([`keep_address`]), and a graph's outputs cannot be the next replay's
inputs (a replay overwrites them). So a tensor read from a cache is a live view of that state: clone it to keep it
([`BSTCache.to_tensors`] and the rollback records do). A cache made under ``torch.inference_mode`` and stepped
outside it writes each state out of place once (torch refuses in-place writes to inference tensors there), then in
place.
"""

import json
from collections import deque

import torch
import torch.utils._pytree as pytree
from transformers.cache_utils import Cache, CacheLayerMixin, StaticLayer

from .configuration_bst import LAYER_TYPE_NAMES


def tracing() -> bool:
    """Whether the code is being traced (``torch.export``, ``torch.compile``, ``torch.jit``)."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.jit.is_tracing()


# Set by [`accelerator_code_path`]: CPU tensors take the code path of an accelerator.
_ACCELERATOR_PATH = [False]


class accelerator_code_path:
    """Context manager: inside it the model takes, on CPU tensors, the code path it takes on an accelerator (no host
    reads of tensor values, the attention forms chosen for GPU kernels). The results are the same; this is for
    counting and testing that path where no GPU is (``benchmarks/train_ops.py``, the tests)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def __enter__(self):
        self.previous = _ACCELERATOR_PATH[0]
        _ACCELERATOR_PATH[0] = self.enabled
        return self

    def __exit__(self, *exc):
        _ACCELERATOR_PATH[0] = self.previous


def on_accelerator(t: torch.Tensor) -> bool:
    """Whether ``t`` takes the accelerator code path: it is on an accelerator, or inside [`accelerator_code_path`]."""
    return t.device.type != "cpu" or _ACCELERATOR_PATH[0]


def host_can_branch(t: torch.Tensor) -> bool:
    """Whether Python may read values of ``t``: a CPU tensor in eager mode, where no device sync is involved.

    Under tracing (``torch.export``, ``torch.compile``, ``torch.jit``) or on an accelerator, code must not branch on
    tensor values: the callers then take the branch-free form, which gives the same result.
    """
    return not on_accelerator(t) and not tracing()


# A host mirror of a BSTCache that is not known (derived from the tensors on its next eager read).
UNKNOWN = "unknown"

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
        getattr(config, "mf_independent_filters", False),
        config.max_position_embeddings,
    )


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` `(B, T, ...)`, ``index`` `(B, K)` -> `(B, K, ...)`."""
    shape = index.shape + x.shape[2:]
    return x.gather(1, index.reshape(index.shape + (1,) * (x.dim() - 2)).expand(shape))


def inference_locked(t: torch.Tensor) -> bool:
    """Whether torch refuses to write ``t`` in place: a tensor made under ``torch.inference_mode``, outside it (never
    the case under tracing, where the check itself cannot be traced)."""
    return not tracing() and t.is_inference() and not torch.is_inference_mode_enabled()


def write_rows(buffer: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``buffer[rows, slots] = values``: in place when no gradient flows (decoding), else out of place (autograd, or
    a buffer made under ``torch.inference_mode`` written outside it: [`inference_locked`])."""
    if (torch.is_grad_enabled() and (buffer.requires_grad or values.requires_grad)) or inference_locked(buffer):
        return buffer.index_put((rows, slots), values)
    return buffer.index_put_((rows, slots), values)


def keep_address(*tensors: torch.Tensor | None):
    """Tell ``torch.compile`` that these CUDA state tensors keep their address from step to step (as transformers'
    StaticCache does for its keys/values): CUDA graphs then take them as static inputs, which a step may write in
    place. Unguarded: a new tensor (the next prefill) re-records the graph rather than recompiling. Nothing to do on
    the CPU, under tracing, or for a tensor that takes gradients."""
    if tracing():
        return
    for t in tensors:
        if t is not None and t.is_cuda and not t.requires_grad:
            from torch._dynamo import mark_static_address  # not at import time: only CUDA decoding needs dynamo

            mark_static_address(t, guard=False)


def assign(owner, attr: str, new: torch.Tensor | None):
    """``owner.attr = new``, in place when that is possible and safe: no gradient mode (decoding, evaluation), an old
    tensor of the same shape, dtype and device, contiguous, and ``new`` not a view of its memory. Else the attribute
    takes ``new`` (then marked with [`keep_address`]). See the module docstring, "Fixed addresses"."""
    old = getattr(owner, attr, None)
    if (
        new is not None
        and old is not None
        and new is not old
        and not torch.is_grad_enabled()
        and old.shape == new.shape
        and old.dtype == new.dtype
        and old.device == new.device
        and old.is_contiguous()
        and not old.requires_grad
        and not inference_locked(old)
        and (tracing() or new.untyped_storage().data_ptr() != old.untyped_storage().data_ptr())
    ):
        old.copy_(new)
        return
    setattr(owner, attr, new)
    keep_address(new)


def memoised(store: dict, slot: str, key: tuple, params, compute, max_bytes: int | None = None):
    """``compute()``, reused from ``store[slot]`` while ``key`` and the tensors ``params`` are unchanged.

    The memo keeps a copy of ``params`` and is used only when they are still equal (``torch.equal``): any change
    (optimiser step, ``load_state_dict``, ``p.data`` edits, ``.to()``) recomputes, so reuse is exact. Values over
    ``max_bytes`` are not kept. Callers use it only where no gradient has to flow to ``params``.
    """
    params = list(params)
    memo = store.get(slot)
    if (
        memo is not None
        and memo["key"] == key
        and len(memo["params"]) == len(params)
        and all(
            a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
            for a, b in zip(memo["params"], params)
        )
    ):
        return memo["value"]
    value = compute()
    size = sum(t.numel() * t.element_size() for t in (value if isinstance(value, tuple) else (value,)))
    if max_bytes is None or size <= max_bytes:
        store[slot] = {"key": key, "params": [p.detach().clone() for p in params], "value": value}
    return value


# Entries a module's [`constant_memo`] keeps (index maps and masks of recent shapes).
CONSTANT_MEMO_ENTRIES = 16


def constant_memo(module, key: tuple, compute):
    """``compute()`` for tensors that depend on no parameter (index maps, windows, masks of a shape), built once per
    ``key`` (which names the device and dtype) and kept on ``module`` (not in its state dict). A training or
    prefill forward then does not rebuild them. Under tracing they are computed in the graph (the compiler folds
    them), so a compiled graph holds no stale tensor."""
    if tracing():
        return compute()
    store = module.__dict__.setdefault("_constant_memo", {})
    value = store.get(key)
    if value is None:
        if len(store) >= CONSTANT_MEMO_ENTRIES:
            store.clear()
        value = store[key] = compute()
    return value


def maybe_any(mask: torch.Tensor) -> bool:
    """``bool(mask.any())`` where reading it costs nothing ([`host_can_branch`]), else ``True`` (do the work)."""
    return bool(mask.any()) if host_can_branch(mask) else True


def decode_memo(layer_cache: "BSTLayerCache", slot: str, key: tuple, params, compute, max_bytes: int | None = None):
    """``compute()`` kept in ``layer_cache.step_memo[slot]`` and reused while ``key`` and the tensors ``params`` are
    unchanged (decoding); recomputed every time when gradients flow to ``params`` (the graph must reach them) and
    under tracing (the graph computes them). On the CPU "unchanged" is checked on the values ([`memoised`]); on an
    accelerator, where reading values back is a device sync per step, on each parameter's storage and version
    counter, which every in-place change through autograd's view of it moves (optimiser steps, ``load_state_dict``,
    ``torch.no_grad()`` edits, ``.to()``): an edit through ``p.data`` during one cache's life is not seen there.
    Values over ``max_bytes`` are not kept."""
    params = list(params)
    if not params or tracing() or (torch.is_grad_enabled() and any(p.requires_grad for p in params)):
        return compute()
    if layer_cache.step_memo is None:
        layer_cache.step_memo = {}
    if not host_can_branch(params[0]):
        key = (*key, *((p.data_ptr(), p._version, p.shape, p.dtype, p.device) for p in params))
        params = []
    return memoised(layer_cache.step_memo, slot, key, params, compute, max_bytes)


def ring_from_sequence(x: torch.Tensor, lengths: torch.Tensor, ring: int, offset: torch.Tensor | None = None):
    """Ring buffer (slot = absolute position % ring) of the last ``ring`` real positions of each row.

    ``x`` `(B, T, ...)` aligned (row starts at 0), ``lengths`` `(B,)`, ``offset`` `(B,)` absolute position of ``x[:, 0]``
    (default 0) -> values `(B, ring, ...)`, absolute positions `(B, ring)` (-1: empty slot).
    """
    pos = lengths[:, None] - ring + torch.arange(ring, device=x.device)[None]  # (B, R), relative to x
    valid = pos >= 0
    vals = gather_rows(x, pos.clamp(min=0))
    vals = vals * valid.reshape(valid.shape + (1,) * (x.dim() - 2)).to(vals.dtype)
    absolute = pos if offset is None else pos + offset[:, None]
    slots = absolute.remainder(ring)
    out = torch.zeros_like(vals).scatter(1, slots.reshape(slots.shape + (1,) * (x.dim() - 2)).expand(vals.shape), vals)
    kpos = torch.full_like(pos, -1).scatter(1, slots, torch.where(valid, absolute, -1))
    return out, kpos


def _where_rows(rows: torch.Tensor | None, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` in the rows where ``rows`` (bool `(B,)`) is True, ``old`` elsewhere (all rows when ``rows`` is None)."""
    if rows is not None and old is not None:
        new = torch.where(rows.reshape((-1,) + (1,) * (new.dim() - 1)), new.to(old.dtype), old)
    # Contiguous: a state keeps one memory layout from prefill to step to step (a compiled step is specialised on
    # strides: a layout change recompiles it).
    return new.contiguous()


class StateCache:
    """A typed piece of a layer's cache: named tensors batched along dim 0, saved under ``SAVED_NAMES``.

    ``capture(positions)`` / ``restore(record)`` take back one recurrent step (``BSTCache.crop``): by default the
    record copies every field (a step updates them in place, [`assign`]).
    """

    SAVED_NAMES: dict = {}

    def __init__(self):
        for attr in self.SAVED_NAMES:
            setattr(self, attr, None)

    def tensors(self):
        return [
            (saved, getattr(self, attr)) for attr, saved in self.SAVED_NAMES.items() if getattr(self, attr) is not None
        ]

    def apply(self, fn):
        for attr in self.SAVED_NAMES:
            if getattr(self, attr) is not None:
                setattr(self, attr, fn(getattr(self, attr)))
                keep_address(getattr(self, attr))

    def load(self, saved_name: str, tensor: torch.Tensor):
        attr = {saved: attr for attr, saved in self.SAVED_NAMES.items()}[saved_name]
        setattr(self, attr, tensor)
        keep_address(tensor)

    def capture(self, positions: torch.Tensor) -> dict:
        # A copy: the step updates the state in place ([`assign`]).
        return {attr: None if (t := getattr(self, attr)) is None else t.clone() for attr in self.SAVED_NAMES}

    def restore(self, record: dict):
        for attr, value in record.items():
            assign(self, attr, value)

    def reset(self, rows: torch.Tensor):
        """Forget the state of the rows where ``rows`` is True (a new document starts)."""


class RingCache(StateCache):
    """Keys/values of the last R positions at slot ``position % R``; ``pos`` is -1 at an empty slot.

    ``k``, ``v`` `(B, R, H, d_h)`, ``pos`` `(B, R)`. Steps write one slot in place: a capture copies that slot."""

    def fill(self, k, v, lengths, ring: int, offset: torch.Tensor | None = None):
        """From a full sequence ``k``/``v`` `(B, T, H, d)` (rows aligned, ``lengths`` real): the last ``ring`` real
        positions. With ``offset`` (a continued sequence) slots this chunk does not reach keep their older tokens."""
        new_k, pos = ring_from_sequence(k, lengths, ring, offset)
        new_v, _ = ring_from_sequence(v, lengths, ring, offset)
        if offset is not None and self.pos is not None:
            keep = pos < 0
            new_k = torch.where(keep[..., None, None], self.k, new_k)
            new_v = torch.where(keep[..., None, None], self.v, new_v)
            pos = torch.where(keep, self.pos, pos)
        assign(self, "k", new_k)
        assign(self, "v", new_v)
        assign(self, "pos", pos)

    def write(self, positions: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor):
        """One token per row at ``positions`` `(B,)`: ``k_t``/``v_t`` `(B, H, d)`. Returns the ring ``(k, v, pos)``."""
        rows = torch.arange(positions.shape[0], device=positions.device)
        slot = positions.remainder(self.pos.shape[1])
        self.k = write_rows(self.k, rows, slot, k_t.to(self.k.dtype))
        self.v = write_rows(self.v, rows, slot, v_t.to(self.v.dtype))
        self.pos = write_rows(self.pos, rows, slot, positions)
        return self.k, self.v, self.pos

    def window(self, positions: torch.Tensor, count: int):
        """The ``count`` positions before ``positions`` `(B,)`: keys, values `(B, count, H, d)` and which of them are
        held (a slot that does not hold the expected position is empty: a document start)."""
        pos = positions[:, None] - count + torch.arange(count, device=positions.device)[None]  # (B, count)
        slots = pos.remainder(self.pos.shape[1])
        valid = gather_rows(self.pos[..., None], slots)[..., 0] == pos
        return gather_rows(self.k, slots), gather_rows(self.v, slots), valid

    def capture(self, positions):
        rows = torch.arange(positions.shape[0], device=positions.device)
        slot = positions.remainder(self.pos.shape[1])
        return {
            "slot": slot,
            "k": self.k[rows, slot].clone(),
            "v": self.v[rows, slot].clone(),
            "pos": self.pos[rows, slot],
        }

    def restore(self, record):
        rows = torch.arange(record["slot"].shape[0], device=record["slot"].device)
        for attr in ("k", "v", "pos"):
            getattr(self, attr).index_put_((rows, record["slot"]), record[attr])

    def reset(self, rows):
        if self.pos is not None:
            assign(self, "pos", self.pos.masked_fill(rows[:, None], -1))


class AttentionCache(RingCache):
    """Self-attention keys/values of the last R tokens (R = W + 1; 2W for BRecT layers, which read a whole block)."""

    SAVED_NAMES = {"k": "k", "v": "v", "pos": "kpos"}


class TokenContextCache(RingCache):
    """SH/MH: context keys/values of the current block's tokens, a W-slot ring."""

    SAVED_NAMES = {"k": "ctx_k", "v": "ctx_v", "pos": "ctx_pos"}


class SSMStateCache(StateCache):
    """The SSM kernel's own state (``ssm_bst``): the complex S4D state `(B, Ds, N2)`, or the unstruct input history
    `(B, Ds, Lmax)`, whose step shifts by one (a capture copies only the input that falls out).

    Unstruct SH/MH decoding also keeps the current chunk's ``pending`` outputs `(B, C, Ds, M)` (the share of the
    inputs before the chunk in its M outputs, ``UnstructFilter.pending_outputs``) and ``pending_offset``, the steps of
    the chunk taken. Both are derived from the history, not saved and not pytree leaves: a state set by anything but
    a chunked step ([`set`]: a prefill, a continued chunk, a traced step), a loaded or unflattened cache, have none,
    and the next eager step starts a chunk. Rows are selected, reset and taken back with the history."""

    SAVED_NAMES = {"state": "ssm_state"}

    def __init__(self):
        super().__init__()
        self.pending: torch.Tensor | None = None
        self.pending_offset = 0

    def set(self, state: torch.Tensor, pending: torch.Tensor | None = None, offset: int = 0, contiguous: bool = True):
        """The new state, with the chunk's ``pending`` outputs and ``offset`` if a chunked step kept them (else
        none). ``contiguous``: one layout from prefill to step ([`_where_rows`]); an eager unstruct step keeps its
        history as the view into its slack buffer (``append_history``; a copy would cost O(Lmax) per step)."""
        if contiguous:
            assign(self, "state", state.contiguous())
        else:
            self.state = state
        self.pending, self.pending_offset = pending, offset

    def chunk(self, size: int) -> tuple[torch.Tensor, int] | None:
        """``(pending, offset)`` while the current chunk of ``size`` steps has steps left, else None."""
        if self.pending is None or self.pending_offset >= size:
            return None
        return self.pending, self.pending_offset

    def apply(self, fn):
        super().apply(fn)
        if self.pending is not None:
            self.pending = fn(self.pending)

    def capture(self, positions):
        if self.state.is_complex():
            return {"state": self.state.clone()}  # a copy: the step updates it in place
        # The pending outputs are never written in place: a reference restores them (valid for the older history).
        return {"oldest": self.state[..., 0].clone(), "pending": self.pending, "offset": self.pending_offset}

    def restore(self, record):
        if "oldest" in record:
            assign(self, "state", torch.cat([record["oldest"][..., None], self.state[..., :-1]], -1))
            self.pending, self.pending_offset = record["pending"], record["offset"]
        else:
            assign(self, "state", record["state"])

    def reset(self, rows):
        # A reset row has no input before its new document: its history and its share in the chunk become zero.
        if self.state is not None:
            keep = (~rows).reshape((-1,) + (1,) * (self.state.dim() - 1)).to(self.state.dtype)
            assign(self, "state", (self.state * keep).contiguous())
        if self.pending is not None:
            self.pending = self.pending * (~rows).reshape(-1, 1, 1, 1).to(self.pending.dtype)


class BlockContextCache(StateCache):
    """MF: the current block's S context keys/values ``k``, ``v`` `(B, S, H, d_h)` and the latest SSM outputs
    ``last`` `(B, S, Ds)` (the next block's context)."""

    SAVED_NAMES = {"k": "ctx_k", "v": "ctx_v", "last": "mf_last"}

    def set_context(self, k, v, rows: torch.Tensor | None = None):
        """The block context, in ``rows`` only (bool `(B,)`; None: all rows)."""
        assign(self, "k", _where_rows(rows, k, self.k))
        assign(self, "v", _where_rows(rows, v, self.v))

    def set_last(self, y, rows: torch.Tensor | None = None):
        assign(self, "last", _where_rows(rows, y, self.last))


class RecurrentStateCache(StateCache):
    """BRecT: the recurrent state ``state`` `(B, S, D)` and its keys/values ``k``, ``v`` `(B, S, H, d_h)`."""

    SAVED_NAMES = {"state": "rec_state", "k": "rec_k", "v": "rec_v"}

    def set(self, state, k, v, rows: torch.Tensor | None = None):
        """The state and its keys/values, in ``rows`` only (bool `(B,)`; None: all rows)."""
        assign(self, "state", _where_rows(rows, state, self.state))
        assign(self, "k", _where_rows(rows, k, self.k))
        assign(self, "v", _where_rows(rows, v, self.v))


class BSTLayerCache(CacheLayerMixin):
    """One BST layer's recurrent-mode state, a transformers cache layer.

    Typed parts for what the layer type has (``attention`` ring, ``ssm`` state, ``context`` states, ``recurrent``
    state; None where it has none), and the layer's own copy of the row state: ``positions`` `(B,)` (real tokens each
    row has seen), ``doc_start`` `(B,)` (where each row's current document started; blocks count from it), ``seen``
    (0-d, every position processed, padding included) with its host mirrors, and the rollback records of
    [`crop`]. Every layer of a cache advances together, so their row states agree; each keeps its own, because
    transformers' [`Cache`] applies ``reorder_cache``, ``batch_select_indices``, ``crop``, ... layer by layer.

    One subclass per entry of ``BSTConfig.layer_types``, registered under it (``_layer_type``): transformers'
    ``DynamicCache(config=...)``, which ``generate`` builds, is then made of these layers. A layer takes its
    structure from the model on first use ([`configure`]).
    """

    is_compileable = False
    is_croppable = True
    supports_early_init = False
    PARTS = ("attention", "ssm", "context", "recurrent")
    HAS = ()  # the parts this layer type holds

    def __init__(self, **kwargs):
        CacheLayerMixin.__init__(self)  # not super(): a static twin's next base is StaticLayer, sized by max_cache_len
        self.max_cache_len = kwargs.get("max_cache_len")  # given to static twins; a BST state has no length to size
        self.attention: AttentionCache | None = AttentionCache() if "attention" in self.HAS else None
        self.ssm: SSMStateCache | None = SSMStateCache() if "ssm" in self.HAS else None
        # BST layers: SH/MH a TokenContextCache, MF a BlockContextCache ([`configure`]).
        self.context: TokenContextCache | BlockContextCache | None = None
        self.recurrent: RecurrentStateCache | None = RecurrentStateCache() if "recurrent" in self.HAS else None
        self.signature: tuple | None = None
        self.block_len: int | None = None
        self._empty_rows()
        # Not batched: per-step constants (S4 step matrices, T5 bias per distance, unstruct filter taps), each reused
        # while the parameters it was computed from are unchanged (``ssm_bst.memoised``).
        self.step_memo: dict | None = None

    def _empty_rows(self):
        self.positions: torch.Tensor | None = None
        self.doc_start: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        self.is_initialized = False
        self._seen_tokens = 0
        self._common_position = None
        self._docs_on_grid = True
        self.record_past = False
        # Per recorded position (newest last): what its step overwrote ([`capture`]).
        self._undo: deque = deque(maxlen=MAX_ROLLBACK)

    def configure(self, config, layer_idx: int, signature: tuple | None = None):
        """Take the structure of layer ``layer_idx`` of a model with ``config`` (once; a layer made by transformers'
        ``DynamicCache`` has none until the model first uses it). Raises if the layer was made for another model."""
        signature = cache_signature(config) if signature is None else signature
        if self.signature is not None:
            if self.signature != signature:
                raise ValueError(
                    "The cache (`cache`/`past_key_values`) was made for a different model configuration "
                    f"(layer {layer_idx})."
                )
            return
        if config.layer_types[layer_idx] != self._layer_type:
            raise ValueError(
                f"The cache's layer {layer_idx} is a {self._layer_type!r} layer, but the model's layer_types[{layer_idx}] "
                f"is {config.layer_types[layer_idx]!r}."
            )
        self.signature = signature
        self.block_len = config.block_len
        if self._layer_type == "bst_context" and self.context is None:
            self.context = BlockContextCache() if config.context_mode == "mf" else TokenContextCache()

    # -- transformers' cache-layer interface ---------------------------------------------------------------------------
    def lazy_initialization(self, key_states=None, value_states=None) -> None:
        """Nothing to do: the first forward over a sequence fills the state ([`start`])."""

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError(
            "A BST cache layer is written by its model layer (ring buffers, SSM and context states), not through "
            "Cache.update(keys, values, layer_idx)."
        )

    def get_seq_length(self) -> int:
        """Positions processed so far, padding included (what ``generate`` slices already-processed inputs by)."""
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1  # bounded state: no maximum length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise NotImplementedError("A BST cache layer has no key/value sequence to mask: BST builds its block masks.")

    @property
    def batch_size(self) -> int:
        return -1 if self.positions is None else int(self.positions.shape[0])

    def offload(self):
        pass  # the state is bounded: nothing worth moving off the device

    def prefetch(self):
        pass

    def reset(self) -> None:
        """Forget everything held (the structure stays)."""
        for part in self.parts():
            for attr in part.SAVED_NAMES:
                setattr(part, attr, None)
        if self.ssm is not None:
            self.ssm.pending, self.ssm.pending_offset = None, 0
        self._empty_rows()

    # -- parts ---------------------------------------------------------------------------------------------------------
    def parts(self):
        return [part for part in (getattr(self, name) for name in self.PARTS) if part is not None]

    def tensors(self):
        """``[(saved name, tensor)]`` of every batched state tensor held."""
        return [item for part in self.parts() for item in part.tensors()]

    def load(self, saved_name: str, tensor: torch.Tensor):
        for part in self.parts():
            if saved_name in part.SAVED_NAMES.values():
                part.load(saved_name, tensor)
                return
        raise KeyError(saved_name)

    def capture(self, positions: torch.Tensor) -> dict:
        """What one recurrent step at ``positions`` `(B,)` will overwrite (for [`restore`]): a ring slot is copied, an
        unstruct history keeps the input that falls out, a replaced state is referenced."""
        return {name: getattr(self, name).capture(positions) for name in self.PARTS if getattr(self, name) is not None}

    def restore(self, record: dict):
        for name, part_record in record.items():
            getattr(self, name).restore(part_record)

    # -- row state -------------------------------------------------------------------------------------------------------
    @property
    def is_empty(self) -> bool:
        return self.positions is None

    @property
    def seen_tokens(self) -> int:
        """Positions processed so far, padding included (the host mirror of ``seen``)."""
        if self._seen_tokens is UNKNOWN:
            if self.seen is None:
                return 0
            if tracing():
                raise RuntimeError("BSTCache.seen_tokens is not known while tracing: read the tensor `seen`.")
            self._seen_tokens = int(self.seen)
        return self._seen_tokens

    @property
    def common_position(self) -> int | None:
        """Every row's real-token count when all rows agree, else None."""
        if self._common_position is UNKNOWN:
            if self.positions is None:
                return None
            if tracing():
                return None  # conservative: a continued chunk takes the stepwise form
            same = bool((self.positions == self.positions[0]).all())
            self._common_position = int(self.positions[0]) if same else None
        return self._common_position

    @property
    def docs_on_grid(self) -> bool:
        """Whether every row's current document started on the block grid."""
        if self._docs_on_grid is UNKNOWN:
            if self.doc_start is None:
                return True
            if tracing():
                return False  # conservative, as common_position
            self._docs_on_grid = bool((self.doc_start.remainder(self.block_len) == 0).all())
        return self._docs_on_grid

    def set_rows(self, positions, doc_start, seen, known: bool):
        """The row state as given (fresh memory each, [`keep_address`]); ``known``: derive the host mirrors now from
        a fresh start (``positions`` equal in every row? see [`start`]), else on their next read."""
        self.positions, self.doc_start, self.seen = positions, doc_start, seen
        keep_address(self.positions, self.doc_start, self.seen)
        self.is_initialized = True
        if not known:
            self._seen_tokens = self._common_position = self._docs_on_grid = UNKNOWN

    def start(self, lengths: torch.Tensor, seq_len: int, common_position: int | None):
        """The state after a first forward over ``seq_len`` columns with ``lengths`` `(B,)` real tokens per row
        (``common_position``: their common value if known, else None)."""
        seen = torch.full((), seq_len, dtype=torch.long, device=lengths.device)
        self.set_rows(lengths.clone(), torch.zeros_like(lengths), seen, known=True)
        self._seen_tokens = seq_len
        self._docs_on_grid = True
        self._common_position = common_position

    def advance(self, seq_len: int):
        """``seq_len`` positions more were processed in every row. Under tracing the changing host mirrors become
        unknown (a traced step neither reads nor writes a position as a Python value)."""
        assign(self, "positions", self.positions + seq_len)
        assign(self, "seen", self.seen + seq_len)
        if tracing():
            self._seen_tokens = UNKNOWN
            self._common_position = UNKNOWN
            return
        if self._seen_tokens is not UNKNOWN:
            self._seen_tokens += seq_len
        if self._common_position is not UNKNOWN and self._common_position is not None:
            self._common_position += seq_len

    def reset_rows(self, rows: torch.Tensor):
        """Start a new document in the rows where ``rows`` (bool `(B,)`) is True ([`BSTCache.reset_rows`])."""
        if self.positions is None:
            return
        rows = rows.to(device=self.positions.device, dtype=torch.bool)
        for part in self.parts():
            part.reset(rows)
        assign(self, "doc_start", torch.where(rows, self.positions, self.doc_start))
        common = self.common_position  # derived here if unknown (as a loaded cache's): the same path as before saving
        if common is None or common % self.block_len:
            # A row may now start a document off the block grid (checked without reading ``rows`` back).
            self._docs_on_grid = False

    # -- rows of the batch -------------------------------------------------------------------------------------------
    def _apply(self, fn):
        self._undo.clear()  # recorded states are per row: a batch change drops them
        for part in self.parts():
            part.apply(fn)
        if self.positions is not None:
            self.positions = fn(self.positions)
            self.doc_start = fn(self.doc_start)
            keep_address(self.positions, self.doc_start)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select rows in place (beam search)."""
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices])

    def detach(self):
        self._apply(lambda t: t.detach())

    # -- rollback (assisted / speculative decoding) -----------------------------------------------------------------
    def activate_past_recording(self):
        """Record what each decoded position overwrites, so that [`crop`] can take back up to ``MAX_ROLLBACK`` of the
        latest positions (``generate`` calls this for assisted decoding)."""
        self.record_past = True

    def push_undo(self, records: list):
        """Append the captures of a chunk, one per position."""
        self._undo.extend(records)

    def crop(self, tokens_to_remove: int) -> None:
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
            record = self._undo.pop()
            if record:
                self.restore(record)
        self.advance(-n)


class BlockLayerCache(BSTLayerCache):
    """A Slide (block attention) layer: the keys/values of the last W + 1 tokens."""

    _layer_type = "bst_block"
    HAS = ("attention",)


class BSTContextLayerCache(BSTLayerCache):
    """A BST layer: the attention ring, the SSM state and the context states (SH/MH: the current block's token
    contexts; MF: the block's context keys/values and latest SSM outputs)."""

    _layer_type = "bst_context"
    HAS = ("attention", "ssm", "context")


class RecurrentLayerCache(BSTLayerCache):
    """A Block-Recurrent Transformer layer: the attention ring (2W) and the recurrent state with its keys/values."""

    _layer_type = "bst_recurrent"
    HAS = ("attention", "recurrent")


class GSSLayerCache(BSTLayerCache):
    """A GSS layer (GSS-Hybrid): the SSM state only."""

    _layer_type = "bst_gss"
    HAS = ("ssm",)


class StaticBSTLayerCache(StaticLayer):
    """The static twin of a BST cache layer (``StaticCache(config=bst_config)``, what
    ``generate(..., cache_implementation="static")`` builds): the same state, declared compileable, so that
    ``generate`` compiles its decode step (on an accelerator by default; on the CPU with a ``compile_config`` whose
    ``_compile_all_devices`` is set). A BST state has no length dimension: every tensor is allocated once, by the
    prefill, at a size fixed by the batch and the config (``max_cache_len`` is not needed), and decode steps write it
    in place (see the module docstring, "Fixed addresses"), which is what a compiled or CUDA-graph step needs. A base
    for registration only: each twin below takes its behaviour (``is_compileable`` included) from its BST layer first
    in the method order, so it sets ``is_compileable`` itself."""


class StaticBlockLayerCache(BlockLayerCache, StaticBSTLayerCache):
    is_compileable = True


class StaticBSTContextLayerCache(BSTContextLayerCache, StaticBSTLayerCache):
    is_compileable = True


class StaticRecurrentLayerCache(RecurrentLayerCache, StaticBSTLayerCache):
    is_compileable = True


class StaticGSSLayerCache(GSSLayerCache, StaticBSTLayerCache):
    is_compileable = True


LAYER_CACHE_TYPES = {
    cls._layer_type: cls for cls in (BlockLayerCache, BSTContextLayerCache, RecurrentLayerCache, GSSLayerCache)
}
STATIC_LAYER_CACHE_TYPES = {
    cls._layer_type: cls
    for cls in (StaticBlockLayerCache, StaticBSTContextLayerCache, StaticRecurrentLayerCache, StaticGSSLayerCache)
}


class BSTCache(Cache):
    """Recurrent-mode generation state of a BST model: a transformers [`Cache`] of one [`BSTLayerCache`] per layer
    (returned as ``cache``; ``past_key_values`` before transformers 5.24).

    ``DynamicCache(config=bst_config)`` (what ``generate`` makes) builds the same layers; the model reads any such
    cache through a ``BSTCache`` over its layers ([`BSTCache.of`]). The row state (``positions``, ``doc_start``,
    ``seen``, host mirrors) reads from the first layer: every layer holds the same.

    Args:
        config ([`BSTConfig`]): the model's configuration; a cache only fits the model it was made for.
        batch_size (`int`, *optional*): accepted for compatibility; the first forward sets the rows.
    """

    def __init__(self, config, batch_size: int | None = None, layers: list | None = None):
        if layers is None:
            layers = [LAYER_CACHE_TYPES[kind]() for kind in config.layer_types]
            signature = cache_signature(config)
            for i, layer in enumerate(layers):
                layer.configure(config, i, signature)
        super().__init__(layers=layers)

    @classmethod
    def of(cls, cache: Cache, config) -> "BSTCache":
        """A ``BSTCache`` over the layers of ``cache`` (itself if it is one): a ``DynamicCache(config=...)`` made by
        ``generate``, or an empty ``DynamicCache()`` (given this model's layers). Each layer takes the model's
        structure on first use; a cache of other layers or another model raises, naming the problem."""
        if not isinstance(cache, Cache):
            raise TypeError(
                f"The cache (`cache`/`past_key_values`) must be a transformers Cache of BST layers (a BSTCache, or "
                f"DynamicCache(config=model.config)), got {type(cache).__name__}."
            )
        if not cache.layers and getattr(cache, "layer_class_to_replicate", None) is not None:
            cache.layers = [LAYER_CACHE_TYPES[kind]() for kind in config.layer_types]
            cache.layer_class_to_replicate = None
        for i, (layer, kind) in enumerate(zip(cache.layers, config.layer_types)):
            if not isinstance(layer, BSTLayerCache) and type(layer)._layer_type == kind and not layer.is_initialized:
                # A fresh layer of another copy of this code (transformers' registry holds the last one loaded): this
                # model's own, so that any number of copies work side by side.
                own = (STATIC_LAYER_CACHE_TYPES if isinstance(layer, StaticLayer) else LAYER_CACHE_TYPES)[kind]()
                own.record_past = getattr(layer, "record_past", False)
                cache.layers[i] = own
        if len(cache.layers) != config.num_hidden_layers or not all(
            isinstance(layer, BSTLayerCache) for layer in cache.layers
        ):
            kinds = [f"{type(layer).__module__}.{type(layer).__name__}" for layer in cache.layers]
            raise TypeError(
                f"The cache (`cache`/`past_key_values`) must hold one BST cache layer per model layer "
                f"(num_hidden_layers={config.num_hidden_layers}, layer_types={list(config.layer_types)}) of this "
                f"model's code ({__name__}); got {type(cache).__name__} with layers {kinds}. A cache that another "
                "model or copy of the code (another trust_remote_code folder, the installed package) has used does "
                "not pass to this one: pass a BSTCache(model.config) or DynamicCache(config=model.config)."
            )
        signature = cache_signature(config)
        for i, layer in enumerate(cache.layers):
            layer.configure(config, i, signature)
        return cache if isinstance(cache, BSTCache) else cls(config, layers=cache.layers)

    # -- row state (read from the first layer; every layer holds the same) -------------------------------------------
    @property
    def model_signature(self) -> tuple | None:
        return self.layers[0].signature

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def block_len(self) -> int:
        return self.layers[0].block_len

    @property
    def positions(self) -> torch.Tensor | None:
        return self.layers[0].positions

    @property
    def doc_start(self) -> torch.Tensor | None:
        return self.layers[0].doc_start

    @property
    def seen(self) -> torch.Tensor | None:
        return self.layers[0].seen

    @property
    def is_empty(self) -> bool:
        return self.layers[0].is_empty

    @property
    def seen_tokens(self) -> int:
        return self.layers[0].seen_tokens

    @property
    def common_position(self) -> int | None:
        return self.layers[0].common_position

    @property
    def docs_on_grid(self) -> bool:
        return self.layers[0].docs_on_grid

    @property
    def record_past(self) -> bool:
        return self.layers[0].record_past

    @record_past.setter
    def record_past(self, value: bool):
        for layer in self.layers:
            layer.record_past = value

    def start(self, lengths: torch.Tensor, seq_len: int, common_position: int | None):
        """The state after a first forward over ``seq_len`` columns with ``lengths`` `(B,)` real tokens per row."""
        for layer in self.layers:
            layer.start(lengths, seq_len, common_position)

    def advance(self, seq_len: int):
        for layer in self.layers:
            layer.advance(seq_len)

    # ``get_seq_length``, ``get_mask_sizes``, ``crop``, ``reorder_cache``, ...: transformers' ``Cache``, layer by layer.

    # -- rollback ----------------------------------------------------------------------------------------------------------
    def push_undo(self, entries: list):
        """Append the captures of a chunk: ``entries[t][layer]`` for each of its positions t."""
        for i, layer in enumerate(self.layers):
            layer.push_undo([entry[i] for entry in entries])

    def reset_rows(self, rows: torch.Tensor) -> "BSTCache":
        """Start a new document in the rows where ``rows`` (bool `(B,)`) is True, keeping the other rows' state.

        Used when streaming consecutive segments of documents (Transformer-XL / BRecT training, evaluation): the
        reset rows forget their cached keys/values, SSM state and context, and the BRecT state restarts from the
        learned initial state, exactly as if their next token were the first of a sequence.
        """
        for layer in self.layers:
            layer.reset_rows(rows)
        return self

    def detach(self) -> "BSTCache":
        """Stop gradients through the cache (Transformer-XL / BRecT segment streaming during training)."""
        for layer in self.layers:
            layer.detach()
        return self

    # -- saving ------------------------------------------------------------------------------------------------------------
    def to_tensors(self) -> dict[str, torch.Tensor]:
        """Flat ``{name: tensor}`` of the cache's state (for safetensors; nothing is pickled): copies, which later
        steps (updating the state in place) leave as they are."""
        out = {}
        if self.positions is not None:
            out["positions"] = self.positions.clone()
            out["doc_start"] = self.doc_start.clone()
            out["seen_tokens"] = self.seen.reshape(()).clone()
        for i, layer in enumerate(self.layers):
            for name, tensor in layer.tensors():
                out[f"layers.{i}.{name}"] = tensor.clone(memory_format=torch.contiguous_format)
        return out

    @classmethod
    def from_tensors(cls, config, tensors: dict[str, torch.Tensor]) -> "BSTCache":
        """Inverse of [`to_tensors`] for a model with this ``config``."""
        cache = cls(config)
        for key, tensor in tensors.items():
            if key in ("positions", "doc_start", "seen_tokens"):
                continue
            _, index, name = key.split(".", 2)
            if not 0 <= int(index) < cache.num_layers:
                raise ValueError(f"Unexpected tensor {key!r} in a saved BSTCache.")
            # Fresh memory: decoding writes the ring buffers in place (loaded storage may be shared or read-only).
            tensor = tensor.clone()
            kind = config.layer_kind(int(index))
            s4 = kind == "gss" or (kind == "bst" and config.ssm_kind == "s4")
            if name == "ssm_state" and s4 and not tensor.is_complex():
                tensor = torch.view_as_complex(tensor)  # saved by an older version (a real view)
            if name == "doc_start":  # older versions saved it per layer too
                continue
            try:
                cache.layers[int(index)].load(name, tensor)
            except KeyError:
                raise ValueError(f"Unexpected tensor {key!r} in a saved BSTCache.") from None
        if "positions" in tensors:
            positions = tensors["positions"]
            doc_start = tensors.get("doc_start", torch.zeros_like(positions))
            # saved before seen_tokens existed: the longest row
            seen = tensors["seen_tokens"] if "seen_tokens" in tensors else positions.max()
            for layer in cache.layers:
                # Fresh memory per layer: decoding advances each in place. Mirrors are derived on first read.
                layer.set_rows(positions.clone(), doc_start.clone(), seen.reshape(()).to(torch.long).clone(), False)
        return cache

    def nbytes(self) -> int:
        total = 0 if self.positions is None else self.positions.numel() * self.positions.element_size()
        for layer in self.layers:
            total += sum(t.numel() * t.element_size() for _, t in layer.tensors())
        return total

    # -- pytree node (torch.export / torch.compile of decode steps) -----------------------------------------------------
    def _pytree_flatten(self):
        """Leaves ``[(name, tensor or None)]`` and the structural context (no value that a decode step changes). The
        row state is a leaf once (the first layer's; every layer holds the same)."""
        leaves = [("positions", self.positions), ("doc_start", self.doc_start), ("seen_tokens", self.seen)]
        spec = []
        for i, layer in enumerate(self.layers):
            parts = []
            for part_name in BSTLayerCache.PARTS:
                part = getattr(layer, part_name)
                parts.append(None if part is None else type(part).__name__)
                if part is not None:
                    leaves.extend(
                        (f"layers.{i}.{saved}", getattr(part, attr)) for attr, saved in part.SAVED_NAMES.items()
                    )
            spec.append((layer._layer_type, tuple(parts)))
        context = (self.model_signature, self.block_len)
        return leaves, (context, tuple(spec))

    @classmethod
    def _pytree_unflatten(cls, values, context) -> "BSTCache":
        (signature, block_len), spec = context
        values = iter(values)
        positions, doc_start, seen = next(values), next(values), next(values)
        layers = []
        for i, (kind, parts) in enumerate(spec):
            layer = LAYER_CACHE_TYPES[kind]()
            for part_name, type_name in zip(BSTLayerCache.PARTS, parts):
                part = None
                if type_name is not None:
                    part = PART_TYPES[type_name]()
                    for attr in part.SAVED_NAMES:
                        setattr(part, attr, next(values))
                setattr(layer, part_name, part)
            layer.signature, layer.block_len = signature, block_len
            if positions is not None:
                # The first layer holds the leaves; the others copies (each layer advances its own in place).
                rows = (positions, doc_start, seen) if i == 0 else (positions.clone(), doc_start.clone(), seen.clone())
                layer.set_rows(*rows, known=False)
            layers.append(layer)
        return cls(None, layers=layers)


PART_TYPES = {
    cls.__name__: cls
    for cls in (AttentionCache, SSMStateCache, TokenContextCache, BlockContextCache, RecurrentStateCache)
}


def _flatten(cache: BSTCache):
    leaves, context = cache._pytree_flatten()
    return [tensor for _, tensor in leaves], context


def _flatten_with_keys(cache: BSTCache):
    leaves, context = cache._pytree_flatten()
    return [(pytree.MappingKey(name), tensor) for name, tensor in leaves], context


def _to_dumpable(context) -> str:
    return json.dumps(context)


def _from_dumpable(dumped: str):
    (signature, block_len), spec = json.loads(dumped)

    def tuples(x):
        return tuple(tuples(v) for v in x) if isinstance(x, list) else x

    # Dumped before issue #45 (an exported program saved then): the layer types under their bare names.
    return (tuples(signature), block_len), tuple((LAYER_TYPE_NAMES.get(k, k), parts) for k, parts in tuples(spec))


def register_pytree():
    """Register [`BSTCache`] as a pytree node (once per class object: a Hub copy of this module is its own class).

    ``torch.export`` then takes and returns caches (leaves named ``positions``, ``layers.3.ssm_state``, ...), and
    the exported program's input spec stays the same from step to step."""
    if BSTCache in pytree.SUPPORTED_NODES:
        return
    pytree.register_pytree_node(
        BSTCache,
        _flatten,
        BSTCache._pytree_unflatten,
        serialized_type_name=f"{BSTCache.__module__}.{BSTCache.__qualname__}",
        to_dumpable_context=_to_dumpable,
        from_dumpable_context=_from_dumpable,
        flatten_with_keys_fn=_flatten_with_keys,
    )


register_pytree()


__all__ = [
    "MAX_ROLLBACK",
    "AttentionCache",
    "BSTCache",
    "BSTContextLayerCache",
    "BSTLayerCache",
    "BlockContextCache",
    "BlockLayerCache",
    "GSSLayerCache",
    "LAYER_CACHE_TYPES",
    "RecurrentLayerCache",
    "RecurrentStateCache",
    "SSMStateCache",
    "TokenContextCache",
    "cache_signature",
    "register_pytree",
]
