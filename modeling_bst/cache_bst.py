"""Bounded recurrent-mode cache of the Block-State Transformer: one transformers cache layer per layer type."""

import ast
from collections import deque
from types import SimpleNamespace

import torch
import torch.utils._pytree as pytree
from transformers.cache_utils import STATIC_LAYER_TYPE_MAPPING, Cache, CacheLayerMixin

from .utils_bst import gather_rows, tracing


# Positions a recording cache can take back (``crop``): assisted decoding verifies at most this many drafted tokens.
MAX_ROLLBACK = 64
# The two rings a layer may hold: (keys, values, positions).
ATTENTION_RING = ("k", "v", "kpos")
CONTEXT_RING = ("ctx_k", "ctx_v", "ctx_pos")


SIGNATURE_FIELDS = """num_hidden_layers hidden_size num_attention_heads head_dim block_len context_mode ssm_kind ssm_channels
ssm_state_size num_context_states layer_types num_recurrent_states mf_independent_filters max_position_embeddings""".split()
# Per layer type: its cache layer's class name and the states it holds (a BST layer adds its context in ``configure``).
LAYER_STATES = {
    "bst_block": ("BlockLayerCache", ATTENTION_RING),
    "bst_context": ("BSTContextLayerCache", (*ATTENTION_RING, "ssm_state")),
    "bst_recurrent": ("RecurrentLayerCache", (*ATTENTION_RING, "rec_state", "rec_k", "rec_v")),
    "bst_gss": ("GSSLayerCache", ("ssm_state",)),
}


def cache_signature(config) -> tuple:
    """The structural fields a cache depends on: a cache only fits models with the same signature."""
    return tuple(tuple(v) if isinstance(v, list) else v for v in (getattr(config, n, None) for n in SIGNATURE_FIELDS))


def _locked(t: torch.Tensor) -> bool:
    """Whether torch refuses to write ``t`` in place: made under ``torch.inference_mode``, used outside it."""
    return not tracing() and t.is_inference() and not torch.is_inference_mode_enabled()


def keep_address(*tensors: torch.Tensor | None):
    """Mark CUDA states as static addresses for ``torch.compile``'s CUDA graphs (unguarded: a new one re-records)."""
    if tracing():
        return
    for t in tensors:
        if t is not None and t.is_cuda and not t.requires_grad:
            from torch._dynamo import mark_static_address  # only CUDA decoding needs dynamo

            mark_static_address(t, guard=False)


def assign(owner, attr: str, new: torch.Tensor):
    """``owner.attr = new``: copied into the old tensor where that is safe, else the attribute takes ``new``."""
    old = getattr(owner, attr, None)
    if (
        old is not None
        and new is not old
        and not torch.is_grad_enabled()
        and (old.shape, old.dtype, old.device) == (new.shape, new.dtype, new.device)
        and old.is_contiguous()
        and not old.requires_grad
        and not _locked(old)
        and (tracing() or new.untyped_storage().data_ptr() != old.untyped_storage().data_ptr())
    ):
        old.copy_(new)
        return
    setattr(owner, attr, new)
    keep_address(new)


class BSTLayerCache(CacheLayerMixin):
    """One BST layer's recurrent-mode state (docs/architecture.md, "The cache"); a subclass per layer type."""

    is_croppable = True
    supports_early_init = False
    NAMES: tuple = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)  # the dynamic map
        if cls._layer_type is not None:
            STATIC_LAYER_TYPE_MAPPING[cls._layer_type] = cls  # the same class, static when given max_cache_len

    def __init__(self, max_cache_len: int | None = None, **kwargs):
        super().__init__()
        self.is_compileable = max_cache_len is not None  # a state has no length to size: only "static"
        self.signature = self.block_len = None
        self.names, self.rows = self.NAMES, self  # ``rows``: the layer holding the row state ([`configure`])
        self.reset()

    def reset(self) -> None:
        """Forget everything held (the structure stays)."""
        for name in self.names:
            setattr(self, name, None)
        self.pending, self.pending_offset = None, 0
        self.positions = self.doc_start = self.seen = None
        self.is_initialized = False
        self.host = {}  # host copies of row-state values ([`host_value`])
        self.record_past = False
        self._undo: deque = deque(maxlen=MAX_ROLLBACK)  # per recorded position, newest last: what its step overwrote

    def configure(self, config, signature: tuple, rows: "BSTLayerCache"):
        """Take the structure of a model with ``config`` and ``signature`` (once; checked in [`own_layers`])."""
        self.rows = rows
        if self.signature is None:
            self.signature, self.block_len = signature, config.block_len
            if self._layer_type == "bst_context":
                self.names += ("ctx_k", "ctx_v", "mf_last") if config.context_mode == "mf" else CONTEXT_RING
                for name in self.names:
                    setattr(self, name, getattr(self, name, None))

    def lazy_initialization(self, key_states=None, value_states=None) -> None:
        """Nothing to do: the model layer fills the state on its first forward."""

    def update(self, key_states, value_states, *args, **kwargs):
        raise NotImplementedError("A BST cache layer is written by its model layer, not through Cache.update.")

    def get_seq_length(self) -> int:
        """Positions processed so far, padding included (what ``generate`` slices already-processed inputs by)."""
        return self.rows.seen_tokens

    def get_max_length(self) -> int:
        return -1  # bounded state

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise NotImplementedError("A BST cache layer has no key/value sequence to mask: BST builds its block masks.")

    @property
    def batch_size(self) -> int:
        return -1 if self.rows.positions is None else int(self.rows.positions.shape[0])

    def tensors(self) -> list:
        """``[(name, tensor)]`` of every batched state tensor held."""
        return [(name, getattr(self, name)) for name in self.names if getattr(self, name) is not None]

    def set(self, rows: torch.Tensor | None = None, **states):
        """New states (in ``rows`` only: bool `(B,)`; None: all rows), written over the old ones ([`assign`])."""
        for name, new in states.items():
            old = getattr(self, name)
            if rows is not None and old is not None:
                new = torch.where(rows.reshape((-1,) + (1,) * (new.dim() - 1)), new.to(old.dtype), old)
            assign(self, name, new.contiguous())  # contiguous: a compiled step is specialised on strides

    def set_ssm(self, state: torch.Tensor, pending: torch.Tensor | None = None, offset: int = 0, contiguous=True):
        """The new SSM state, with a chunked step's ``pending`` outputs (``contiguous`` False: keep a view)."""
        if contiguous:
            assign(self, "ssm_state", state.contiguous())
        else:
            self.ssm_state = state
        self.pending, self.pending_offset = pending, offset

    def chunk(self, size: int):
        """``(pending, offset)`` while the current unstruct decoding chunk of ``size`` steps has steps left."""
        return None if self.pending is None or self.pending_offset >= size else (self.pending, self.pending_offset)

    def fill_ring(self, ring: tuple, k, v, lengths, size: int, offset: torch.Tensor | None = None):
        """Ring ``ring`` of ``size`` slots from the last ``lengths`` `(B,)` positions of ``k``/``v`` `(B, T, H, d)`."""
        pos = lengths[:, None] - size + torch.arange(size, device=k.device)[None]  # (B, R), relative to k
        valid = pos >= 0
        absolute = pos if offset is None else pos + offset[:, None]
        slots = absolute.remainder(size)
        new_pos = torch.full_like(pos, -1).scatter(1, slots, torch.where(valid, absolute, -1))
        keep = new_pos < 0 if offset is not None and getattr(self, ring[2]) is not None else None
        states = {ring[2]: new_pos if keep is None else torch.where(keep, getattr(self, ring[2]), new_pos)}
        for name, x in zip(ring, (k, v)):
            x = gather_rows(x, pos.clamp(min=0)) * valid[..., None, None].to(x.dtype)
            x = torch.zeros_like(x).scatter(1, slots[..., None, None].expand(x.shape), x)
            states[name] = x if keep is None else torch.where(keep[..., None, None], getattr(self, name), x)
        self.set(**states)

    def write_ring(self, ring: tuple, rows, slot, positions, k_t, v_t):
        """One token per row at ``positions`` `(B,)` (``slot`` = positions % R) into ring ``ring``; returns it."""
        for name, value in zip(ring, (k_t, v_t, positions)):
            buffer, value = getattr(self, name), value.to(getattr(self, name).dtype)
            if (torch.is_grad_enabled() and (buffer.requires_grad or value.requires_grad)) or _locked(buffer):
                setattr(self, name, buffer.index_put((rows, slot), value))  # out of place: gradients flow
            else:
                buffer.index_put_((rows, slot), value)
        return tuple(getattr(self, name) for name in ring)

    def window(self, positions: torch.Tensor, count: int):
        """Keys, values `(B, count, H, d)` of the ``count`` positions before ``positions`` and which are held."""
        pos = positions[:, None] - count + torch.arange(count, device=positions.device)[None]
        slots = pos.remainder(self.kpos.shape[1])
        valid = self.kpos.gather(1, slots) == pos
        return gather_rows(self.k, slots), gather_rows(self.v, slots), valid

    def rings(self) -> list:
        return [ring for ring in (ATTENTION_RING, CONTEXT_RING) if ring[2] in self.names]

    def capture(self, positions: torch.Tensor) -> dict:
        """What one step at ``positions`` `(B,)` will overwrite (steps write in place), for [`restore`]."""
        rows = torch.arange(positions.shape[0], device=positions.device)
        record, in_rings = {}, set()
        for ring in self.rings():
            in_rings.update(ring)
            slot = positions.remainder(getattr(self, ring[2]).shape[1])
            record[ring] = (slot, *(getattr(self, name)[rows, slot].clone() for name in ring))
        for name, t in self.tensors():
            if name == "ssm_state" and t.dim() == 3:  # an unstruct history (B, Ds, Lmax), not an S4D (B, Ds, N2, 2)
                record[name] = (t[..., 0].clone(), self.pending, self.pending_offset)
            elif name not in in_rings:
                record[name] = t.clone()
        return record

    def restore(self, record: dict):
        for key, value in record.items():
            if isinstance(key, tuple):
                rows = torch.arange(value[0].shape[0], device=value[0].device)
                for name, old in zip(key, value[1:]):
                    getattr(self, name).index_put_((rows, value[0]), old)
            elif key == "ssm_state" and isinstance(value, tuple):
                assign(self, key, torch.cat([value[0][..., None], self.ssm_state[..., :-1]], -1))
                self.pending, self.pending_offset = value[1], value[2]
            else:
                assign(self, key, value)

    def reset_rows(self, rows: torch.Tensor):
        """Start a new document in the rows where ``rows`` (bool `(B,)`) is True ([`BSTCache.reset_rows`])."""
        for ring in self.rings():
            assign(self, ring[2], getattr(self, ring[2]).masked_fill(rows[:, None], -1))
        if "ssm_state" in self.names and self.ssm_state is not None:
            keep = (~rows).reshape((-1,) + (1,) * (self.ssm_state.dim() - 1)).to(self.ssm_state.dtype)
            assign(self, "ssm_state", (self.ssm_state * keep).contiguous())
        if self.pending is not None:
            self.pending = self.pending * (~rows).reshape(-1, 1, 1, 1).to(self.pending.dtype)
        if self.rows is self:
            assign(self, "doc_start", torch.where(rows, self.positions, self.doc_start))
            common = self.common_position  # derived here if unknown
            if common is None or common % self.block_len:
                self.host["docs_on_grid"] = False  # a row may now start a document off the block grid

    @property
    def is_empty(self) -> bool:
        return self.positions is None

    def host_value(self, name: str, derive, empty, traced):
        """A row-state value kept on the host: ``empty``, ``traced`` (raised if an exception) or ``derive()``d."""
        if name not in self.host:
            if self.positions is None:
                return empty
            if tracing():
                if isinstance(traced, Exception):
                    raise traced
                return traced
            self.host[name] = derive()
        return self.host[name]

    @property
    def seen_tokens(self) -> int:
        error = RuntimeError("seen_tokens is not known while tracing: read the tensor `seen`.")
        return self.host_value("seen_tokens", lambda: int(self.seen), 0, error)

    @property
    def common_position(self) -> int | None:  # under tracing a continued chunk takes the stepwise form
        p = self.positions
        return self.host_value("common_position", lambda: int(p[0]) if bool((p == p[0]).all()) else None, None, None)

    @property
    def docs_on_grid(self) -> bool:
        w = self.block_len
        return self.host_value("docs_on_grid", lambda: bool((self.doc_start.remainder(w) == 0).all()), True, False)

    def set_rows(self, positions, doc_start, seen, known: bool):
        self.positions, self.doc_start, self.seen = positions, doc_start, seen
        keep_address(positions, doc_start, seen)
        self.is_initialized = True
        if not known:
            self.host = {}

    def start(self, lengths: torch.Tensor, seq_len: int, common_position: int | None):
        """The row state after a first forward over ``seq_len`` columns with ``lengths`` `(B,)` real tokens."""
        seen = torch.full((), seq_len, dtype=torch.long, device=lengths.device)
        self.set_rows(lengths.clone(), torch.zeros_like(lengths), seen, known=True)
        self.host = {"seen_tokens": seq_len, "docs_on_grid": True, "common_position": common_position}

    def advance(self, seq_len: int):
        """``seq_len`` positions more in every row (under tracing the changing mirrors become unknown)."""
        assign(self, "positions", self.positions + seq_len)
        assign(self, "seen", self.seen + seq_len)
        if tracing():  # unknown: derived on the next eager read (a traced step reads no host value)
            self.host = {}
            return
        for name in ("seen_tokens", "common_position"):
            if self.host.get(name) is not None:
                self.host[name] += seq_len

    def _apply(self, fn):
        self._undo.clear()  # records are per row
        for name, t in self.tensors():
            setattr(self, name, fn(t))
            keep_address(getattr(self, name))
        if self.pending is not None:
            self.pending = fn(self.pending)
        if self.positions is not None:  # the host values stay true (or on the safe side)
            self.set_rows(fn(self.positions), fn(self.doc_start), self.seen, known=True)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices])

    def detach(self):
        self._apply(lambda t: t.detach())

    def activate_past_recording(self):
        """Record what each decoded position overwrites, so that [`crop`] can take back up to ``MAX_ROLLBACK``."""
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Take back the last ``-tokens_to_remove`` positions (transformers' convention: a negative count)."""
        n = -tokens_to_remove
        if not 0 <= n <= len(self._undo):
            raise ValueError(f"crop(-n) can take back 0 <= n <= {len(self._undo)} recorded positions, got n = {n}.")
        for _ in range(n):
            self.restore(self._undo.pop())
        if n and self.rows is self:
            self.advance(-n)


LAYER_CACHE_TYPES = {  # registered in transformers' layer maps by ``__init_subclass__``
    kind: type(name, (BSTLayerCache,), {"_layer_type": kind, "NAMES": names, "__module__": __name__})
    for kind, (name, names) in LAYER_STATES.items()
}
BSTContextLayerCache = LAYER_CACHE_TYPES["bst_context"]


def own_layers(cache: Cache, config) -> Cache:
    """``cache``, checked to hold this model's layers (fresh ones of another copy of this code replaced), configured."""
    if not isinstance(cache, Cache):
        raise TypeError(f"The cache must be a BSTCache or DynamicCache(config=...), got {type(cache).__name__}.")
    if not cache.layers and getattr(cache, "layer_class_to_replicate", None) is not None:  # DynamicCache()
        cache.layers, cache.layer_class_to_replicate = [LAYER_CACHE_TYPES[kind]() for kind in config.layer_types], None
    for i, (layer, kind) in enumerate(zip(cache.layers, config.layer_types)):
        if not isinstance(layer, BSTLayerCache) and type(layer)._layer_type == kind and not layer.is_initialized:
            cache.layers[i] = LAYER_CACHE_TYPES[kind](max_cache_len=0 if layer.is_compileable else None)
            cache.layers[i].record_past = getattr(layer, "record_past", False)
    signature = cache_signature(config)
    if any(isinstance(layer, BSTLayerCache) and layer.signature not in (None, signature) for layer in cache.layers):
        raise ValueError("The cache was made for a different model configuration.")
    if [isinstance(layer, BSTLayerCache) and layer._layer_type for layer in cache.layers] != list(config.layer_types):
        kinds = [f"{type(layer).__module__}.{type(layer).__name__}" for layer in cache.layers]
        raise TypeError(
            f"The cache must hold one BST cache layer per model layer ({list(config.layer_types)}, of {__name__}); "
            f"got {type(cache).__name__} with layers {kinds}. Pass BSTCache(model.config) or DynamicCache(config=...)."
        )
    for layer in cache.layers:
        layer.configure(config, signature, cache.layers[0])
    return cache


class BSTCache(Cache):
    """Recurrent-mode generation state of a BST model: a [`Cache`] of one [`BSTLayerCache`] per layer of ``config``."""

    def __init__(self, config, batch_size: int | None = None):
        super().__init__(layers=[LAYER_CACHE_TYPES[kind]() for kind in config.layer_types])
        own_layers(self, config)

    def reset_rows(self, rows: torch.Tensor) -> "BSTCache":
        """Start a new document in the rows where ``rows`` (bool `(B,)`) is True, keeping the other rows' state."""
        if not self.layers[0].is_empty:
            rows = rows.to(device=self.layers[0].positions.device, dtype=torch.bool)
            for layer in self.layers[::-1]:  # the first layer's row state last: the others read it
                layer.reset_rows(rows)
        return self

    def detach(self) -> "BSTCache":
        """Stop gradients through the cache (Transformer-XL / BRecT segment streaming during training)."""
        for layer in self.layers:
            layer.detach()
        return self


def _flatten(cache, keys=False):  # leaves: the row state, then each layer's states; context: the model's signature
    rows = cache.layers[0]
    leaves = [("positions", rows.positions), ("doc_start", rows.doc_start), ("seen_tokens", rows.seen)]
    leaves += [(f"layers.{i}.{n}", getattr(layer, n)) for i, layer in enumerate(cache.layers) for n in layer.names]
    return [(pytree.MappingKey(name), t) if keys else t for name, t in leaves], rows.signature


def _unflatten(values, signature) -> BSTCache:
    cache, values = BSTCache(SimpleNamespace(**dict(zip(SIGNATURE_FIELDS, signature)))), iter(values)
    rows = [next(values) for _ in range(3)]  # positions, doc_start, seen
    for layer in cache.layers:
        for name in layer.names:
            setattr(layer, name, next(values))
    if rows[0] is not None:
        cache.layers[0].set_rows(*rows, known=False)
    return cache


pytree.register_pytree_node(  # for torch.export / torch.compile of decode steps
    BSTCache,
    _flatten,
    _unflatten,
    serialized_type_name=f"{__name__}.BSTCache",
    to_dumpable_context=repr,  # tuples, strings, numbers, booleans and None: read back equal
    from_dumpable_context=ast.literal_eval,
    flatten_with_keys_fn=lambda cache: _flatten(cache, keys=True),
)


__all__ = ["MAX_ROLLBACK", "BSTCache", "BSTLayerCache", "LAYER_CACHE_TYPES", "cache_signature", "own_layers"]
