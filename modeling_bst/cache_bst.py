"""Bounded recurrent-mode cache of the Block-State Transformer.

A [`BSTCache`] holds, per layer, only state whose size does not depend on how many tokens were decoded, in typed
parts that layers use through their methods ([`BSTLayerCache`]; saved names in brackets):

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

``positions`` `(B,)` counts the real tokens each row has seen (rows of a padded batch differ); ``seen`` (a 0-d
tensor) counts every position processed, padding included: what ``generate`` slices already-processed inputs by
(``get_seq_length()``, a Python int).

Host mirrors. ``seen_tokens`` (int), ``common_position`` (every row's real-token count when all rows agree, else
None) and ``docs_on_grid`` (every row's document started on the block grid) let ``BSTModel.forward`` choose its path
without reading tensors back to the host. They are kept up to date in eager mode; under tracing (``torch.export``,
``torch.compile``) a step marks the first two unknown instead of reading or writing a changing Python value (which
would fix a traced graph to one position), and a cache rebuilt from its pytree leaves has all three unknown. An
unknown mirror is derived from the tensors once, on its next read in eager mode (one host read), and is conservative
under tracing (``common_position`` None, ``docs_on_grid`` False: a continued chunk takes the stepwise form).

``BSTCache`` is a registered pytree node ([`register_pytree`]): its leaves are ``positions``, ``doc_start``,
``seen``, then every layer part's tensors in ``SAVED_NAMES`` order, named as in [`BSTCache.to_tensors`]; its context
is the structure only (layer parts, model signature, batch size), which no decode step changes, so one exported or
compiled decode step serves every position.

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


def tracing() -> bool:
    """Whether the code is being traced (``torch.export``, ``torch.compile``, ``torch.jit``)."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.jit.is_tracing()


def host_can_branch(t: torch.Tensor) -> bool:
    """Whether Python may read values of ``t``: a CPU tensor in eager mode, where no device sync is involved.

    Under tracing (``torch.export``, ``torch.compile``, ``torch.jit``) or on an accelerator, code must not branch on
    tensor values: the callers then take the branch-free form, which gives the same result.
    """
    return t.device.type == "cpu" and not tracing()


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


class BSTLayerCache:
    """One layer's cache: typed parts for what the layer type has (``attention`` ring, ``ssm`` state, ``context``
    states, ``recurrent`` state; None where the layer has none)."""

    PARTS = ("attention", "ssm", "context", "recurrent")

    def __init__(self, attention=None, ssm=None, context=None, recurrent=None):
        self.attention: AttentionCache | None = attention
        self.ssm: SSMStateCache | None = ssm
        self.context: TokenContextCache | BlockContextCache | None = context
        self.recurrent: RecurrentStateCache | None = recurrent
        # Position at which each row's current document started (a view of BSTCache.doc_start); blocks count from it.
        self.doc_start: torch.Tensor | None = None
        # Not batched: per-step constants (S4 step matrices, T5 bias per distance, unstruct filter taps), each reused
        # while the parameters it was computed from are unchanged (``ssm_bst.memoised``).
        self.step_memo: dict | None = None

    @classmethod
    def for_layer(cls, config, layer_idx: int) -> "BSTLayerCache":
        kind = config.layer_kind(layer_idx)
        context = None
        if kind == "bst":
            context = BlockContextCache() if config.context_mode == "mf" else TokenContextCache()
        return cls(
            attention=AttentionCache() if kind != "gss" else None,
            ssm=SSMStateCache() if kind in ("bst", "gss") else None,
            context=context,
            recurrent=RecurrentStateCache() if kind == "recurrent" else None,
        )

    def parts(self):
        return [part for part in (getattr(self, name) for name in self.PARTS) if part is not None]

    def tensors(self):
        """``[(saved name, tensor)]`` of every batched tensor held."""
        return [item for part in self.parts() for item in part.tensors()]

    def apply(self, fn):
        for part in self.parts():
            part.apply(fn)

    def load(self, saved_name: str, tensor: torch.Tensor):
        for part in self.parts():
            if saved_name in part.SAVED_NAMES.values():
                part.load(saved_name, tensor)
                return
        raise KeyError(saved_name)

    def capture(self, positions: torch.Tensor) -> dict:
        """What one recurrent step at ``positions`` will overwrite (for [`restore`])."""
        return {name: getattr(self, name).capture(positions) for name in self.PARTS if getattr(self, name) is not None}

    def restore(self, record: dict):
        for name, part_record in record.items():
            getattr(self, name).restore(part_record)

    def reset(self, rows: torch.Tensor):
        for part in self.parts():
            part.reset(rows)


class BSTCache:
    """Recurrent-mode generation state of a BST model (returned as ``cache``; ``past_key_values`` before transformers 5.24).

    Args:
        config ([`BSTConfig`]): the model's configuration; a cache only fits the model it was made for.
        batch_size (`int`): number of rows.
    """

    # ``generate`` would compile the forward on its own for a compileable cache (and build 4-D masks for it): BST
    # builds its own block masks; compile one decode step explicitly instead (``torch.compile(model)``).
    is_compileable = False
    # ``crop`` takes back the last positions processed while recording (``activate_past_recording``).
    is_croppable = True

    def __init__(self, config, batch_size: int):
        self._setup(
            config.num_hidden_layers,
            config.block_len,
            config.hidden_size,
            cache_signature(config),
            batch_size,
            [BSTLayerCache.for_layer(config, i) for i in range(config.num_hidden_layers)],
        )
        self._seen_tokens = 0
        self._common_position = None
        self._docs_on_grid = True

    def _setup(self, num_layers, block_len, hidden_size, signature, batch_size, layers):
        self.num_layers = num_layers
        self.block_len = block_len
        self.hidden_size = hidden_size
        self.model_signature = signature
        self.batch_size = batch_size
        self.layers = layers
        self.positions: torch.Tensor | None = None
        self.doc_start: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        self.record_past = False
        # Per recorded position (newest last): per layer, what its step overwrote ([`capture`]).
        self._undo: deque = deque(maxlen=MAX_ROLLBACK)

    def __len__(self):
        return self.num_layers

    @property
    def is_empty(self) -> bool:
        return self.positions is None

    # -- host mirrors (see the module docstring) ----------------------------------------------------------------------
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

    def start(self, lengths: torch.Tensor, seq_len: int, common_position: int | None):
        """The state after a first forward over ``seq_len`` columns with ``lengths`` `(B,)` real tokens per row
        (``common_position``: their common value if known, else None)."""
        self.positions = lengths.clone()
        self.doc_start = torch.zeros_like(self.positions)
        self.seen = torch.full((), seq_len, dtype=torch.long, device=lengths.device)
        keep_address(self.positions, self.doc_start, self.seen)
        for layer in self.layers:
            layer.doc_start = self.doc_start
        self.batch_size = int(lengths.shape[0])
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

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions processed so far, padding included (what ``generate`` slices already-processed inputs by)."""
        return self.seen_tokens

    @property
    def is_linear(self) -> list[bool]:
        """Per layer, whether it is a recurrent state only (transformers' "linear attention" layers, for which
        ``generate`` from 5.24 on does not slice the inputs already processed): no BST layer is, so ``generate``
        passes the tokens after ``get_seq_length()``."""
        return [False] * self.num_layers

    def get_mask_sizes(self, *args, **kwargs):
        raise NotImplementedError("BSTCache builds its own block masks.")

    def _apply(self, fn):
        self._undo.clear()  # recorded states are per row: a batch change drops them
        for layer in self.layers:
            layer.apply(fn)
        if self.positions is not None:
            self.positions = fn(self.positions)
            self.doc_start = fn(self.doc_start)
            keep_address(self.positions, self.doc_start)
            for layer in self.layers:
                layer.doc_start = self.doc_start

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
        """What one recurrent step of ``layer`` at ``positions`` `(B,)` will overwrite ([`BSTLayerCache.capture`]):
        a ring slot is copied, an unstruct history keeps the input that falls out, a replaced state is referenced."""
        return layer.capture(positions)

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
            for layer, record in zip(self.layers, self._undo.pop()):
                if record:
                    layer.restore(record)
        self.advance(-n)

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
            layer.reset(rows)
        assign(self, "doc_start", torch.where(rows, self.positions, self.doc_start))
        for layer in self.layers:
            layer.doc_start = self.doc_start
        common = self.common_position  # derived here if unknown (as a loaded cache's): the same path as before saving
        if common is None or common % self.block_len:
            # A row may now start a document off the block grid (checked without reading ``rows`` back).
            self._docs_on_grid = False
        return self

    def detach(self) -> "BSTCache":
        """Stop gradients through the cache (Transformer-XL / BRecT segment streaming during training)."""
        self._apply(lambda t: t.detach())
        return self

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
        batch = int(tensors["positions"].shape[0]) if "positions" in tensors else 0
        cache = cls(config, batch)
        for key, tensor in tensors.items():
            if key in ("positions", "doc_start"):
                setattr(cache, key, tensor.clone())  # fresh memory, as below: decoding advances it in place
                keep_address(getattr(cache, key))
                continue
            if key == "seen_tokens":
                cache.seen = tensor.reshape(()).to(torch.long).clone()
                keep_address(cache.seen)
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
            if name == "doc_start":  # older versions saved it per layer too; BSTCache holds it
                continue
            try:
                cache.layers[int(index)].load(name, tensor)
            except KeyError:
                raise ValueError(f"Unexpected tensor {key!r} in a saved BSTCache.") from None
        for layer in cache.layers:
            layer.doc_start = cache.doc_start
        if cache.positions is not None:
            if "seen_tokens" not in tensors:  # saved before seen_tokens existed: the longest row
                cache.seen = cache.positions.max().clone()
            cache._seen_tokens = cache._common_position = cache._docs_on_grid = UNKNOWN  # derived on first read
        return cache

    def nbytes(self) -> int:
        total = 0 if self.positions is None else self.positions.numel() * self.positions.element_size()
        for layer in self.layers:
            total += sum(t.numel() * t.element_size() for _, t in layer.tensors())
        return total

    # -- pytree node (torch.export / torch.compile of decode steps) -----------------------------------------------------
    def _pytree_flatten(self):
        """Leaves ``[(name, tensor or None)]`` and the structural context (no value that a decode step changes)."""
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
            spec.append(tuple(parts))
        context = (self.num_layers, self.block_len, self.hidden_size, self.model_signature, self.batch_size)
        return leaves, (context, tuple(spec))

    @classmethod
    def _pytree_unflatten(cls, values, context) -> "BSTCache":
        (num_layers, block_len, hidden_size, signature, batch_size), spec = context
        values = iter(values)
        cache = cls.__new__(cls)
        positions, doc_start, seen = next(values), next(values), next(values)
        layers = []
        for parts in spec:
            built = {}
            for part_name, type_name in zip(BSTLayerCache.PARTS, parts):
                if type_name is not None:
                    part = PART_TYPES[type_name]()
                    for attr in part.SAVED_NAMES:
                        setattr(part, attr, next(values))
                    built[part_name] = part
            layer = BSTLayerCache(**built)
            layer.doc_start = doc_start
            layers.append(layer)
        cache._setup(num_layers, block_len, hidden_size, signature, batch_size, layers)
        cache.positions, cache.doc_start, cache.seen = positions, doc_start, seen
        cache._seen_tokens = cache._common_position = cache._docs_on_grid = UNKNOWN
        return cache


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
    (num_layers, block_len, hidden_size, signature, batch_size), spec = json.loads(dumped)

    def tuples(x):
        return tuple(tuples(v) for v in x) if isinstance(x, list) else x

    return (num_layers, block_len, hidden_size, tuples(signature), batch_size), tuples(spec)


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
    "BSTLayerCache",
    "BlockContextCache",
    "RecurrentStateCache",
    "SSMStateCache",
    "TokenContextCache",
    "cache_signature",
    "register_pytree",
]
