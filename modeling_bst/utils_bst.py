"""Tensor helpers shared by the BST modules: whether code is traced, which code path a tensor takes (CPU or
accelerator), row gathers and ring layouts, state writes that keep a tensor's address, and memos of values derived
from parameters or shapes."""

import torch


def tracing() -> bool:
    """Whether the code is being traced (``torch.export``, ``torch.compile``, ``torch.jit``)."""
    return torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch.jit.is_tracing()


class Switch:
    """Context manager setting a module-wide flag (the one-element list ``flag`` of a subclass) for its block."""

    flag: list

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def __enter__(self):
        self.previous = self.flag[0]
        self.flag[0] = self.enabled
        return self

    def __exit__(self, *exc):
        self.flag[0] = self.previous


# Set by [`accelerator_code_path`]: CPU tensors take the code path of an accelerator.
_ACCELERATOR_PATH = [False]


class accelerator_code_path(Switch):
    """Context manager: inside it the model takes, on CPU tensors, the code path it takes on an accelerator (no host
    reads of tensor values, the attention forms chosen for GPU kernels). The results are the same; this is for
    counting and testing that path where no GPU is (``benchmarks/train_ops.py``, the tests)."""

    flag = _ACCELERATOR_PATH


# A host mirror ([`host_mirror`]) that is not known (derived from the tensors on its next eager read).
UNKNOWN = "unknown"


def host_mirror(source: str, empty, traced):
    """A row-state property kept on the host (``_<name>``), so that the model picks its path without reading
    tensors: once ``UNKNOWN`` it is derived by the decorated function on the next eager read; ``empty`` while the
    tensor ``source`` is None, ``traced`` under tracing (raised if an exception)."""

    def wrap(derive):
        attr = "_" + derive.__name__

        def get(self):
            if getattr(self, attr) is UNKNOWN:
                if getattr(self, source) is None:
                    return empty
                if tracing():
                    if isinstance(traced, Exception):
                        raise traced
                    return traced
                setattr(self, attr, derive(self))
            return getattr(self, attr)

        return property(get)

    return wrap


def on_accelerator(t: torch.Tensor) -> bool:
    """Whether ``t`` takes the accelerator code path: it is on an accelerator, or inside [`accelerator_code_path`]."""
    return t.device.type != "cpu" or _ACCELERATOR_PATH[0]


def host_can_branch(t: torch.Tensor) -> bool:
    """Whether Python may read values of ``t``: a CPU tensor in eager mode, where no device sync is involved.

    Under tracing (``torch.export``, ``torch.compile``, ``torch.jit``) or on an accelerator, code must not branch on
    tensor values: the callers then take the branch-free form, which gives the same result.
    """
    return not on_accelerator(t) and not tracing()


def maybe_any(mask: torch.Tensor) -> bool:
    """``bool(mask.any())`` where reading it costs nothing ([`host_can_branch`]), else ``True`` (do the work)."""
    return bool(mask.any()) if host_can_branch(mask) else True


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` `(B, T, ...)`, ``index`` `(B, K)` -> `(B, K, ...)`."""
    shape = index.shape + x.shape[2:]
    return x.gather(1, index.reshape(index.shape + (1,) * (x.dim() - 2)).expand(shape))


def memoised(store: dict, slot, key: tuple, params, compute, max_bytes: int | None = None):
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


def step_memo(store: dict | None, slot, key: tuple, params, compute, max_bytes: int | None = None):
    """``compute()`` kept in ``store[slot]`` (a decoding run's memo, [`StepPlan.memo`]) and reused while ``key`` and
    the tensors ``params`` are unchanged; recomputed every time without a store, when gradients flow to ``params``
    (the graph must reach them) and under tracing (the graph computes them). On the CPU "unchanged" is checked on
    the values ([`memoised`]); on an accelerator, where reading values back is a device sync per step, on each
    parameter's storage and version counter, which every in-place change through autograd's view of it moves
    (optimiser steps, ``load_state_dict``, ``torch.no_grad()`` edits, ``.to()``): an edit through ``p.data`` during
    one decoding run is not seen there. Values over ``max_bytes`` are not kept."""
    params = list(params)
    if store is None or not params or tracing() or (torch.is_grad_enabled() and any(p.requires_grad for p in params)):
        return compute()
    if not host_can_branch(params[0]):
        key = (*key, *((p.data_ptr(), p._version, p.shape, p.dtype, p.device) for p in params))
        params = []
    return memoised(store, slot, key, params, compute, max_bytes)


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


def inference_locked(t: torch.Tensor) -> bool:
    """Whether torch refuses to write ``t`` in place: made under ``torch.inference_mode``, used outside it."""
    return not tracing() and t.is_inference() and not torch.is_inference_mode_enabled()


def write_rows(buffer: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``buffer[rows, slots] = values``: in place when no gradient flows (decoding), else out of place."""
    if (torch.is_grad_enabled() and (buffer.requires_grad or values.requires_grad)) or inference_locked(buffer):
        return buffer.index_put((rows, slots), values)
    return buffer.index_put_((rows, slots), values)


def keep_address(*tensors: torch.Tensor | None):
    """Mark CUDA state tensors as static addresses for ``torch.compile`` (CUDA graphs take them as static inputs,
    which a step may write in place); unguarded, so a new tensor re-records rather than recompiles."""
    if tracing():
        return
    for t in tensors:
        if t is not None and t.is_cuda and not t.requires_grad:
            from torch._dynamo import mark_static_address  # only CUDA decoding needs dynamo

            mark_static_address(t, guard=False)


def assign(owner, attr: str, new: torch.Tensor | None):
    """``owner.attr = new``: copied into the old tensor when that is possible and safe (no gradient mode, same
    shape, dtype and device, contiguous, not a view of ``new``'s memory), else the attribute takes ``new`` (marked
    with [`keep_address`])."""
    old = getattr(owner, attr, None)
    if (
        new is not None
        and old is not None
        and new is not old
        and not torch.is_grad_enabled()
        and (old.shape, old.dtype, old.device) == (new.shape, new.dtype, new.device)
        and old.is_contiguous()
        and not old.requires_grad
        and not inference_locked(old)
        and (tracing() or new.untyped_storage().data_ptr() != old.untyped_storage().data_ptr())
    ):
        old.copy_(new)
        return
    setattr(owner, attr, new)
    keep_address(new)


def where_rows(rows: torch.Tensor | None, new: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
    """``new`` in the rows where ``rows`` (bool `(B,)`) is True, ``old`` elsewhere (all rows when ``rows`` is None);
    contiguous (a compiled step is specialised on strides)."""
    if rows is not None and old is not None:
        new = torch.where(rows.reshape((-1,) + (1,) * (new.dim() - 1)), new.to(old.dtype), old)
    return new.contiguous()


def ring_from_sequence(x: torch.Tensor, lengths: torch.Tensor, ring: int, offset: torch.Tensor | None = None):
    """Ring (slot = absolute position % ``ring``) of the last ``ring`` real positions of each row of ``x``
    `(B, T, ...)` (rows start at 0; ``offset`` `(B,)` absolute position of ``x[:, 0]``) -> values `(B, ring, ...)`,
    absolute positions `(B, ring)` (-1: empty slot)."""
    pos = lengths[:, None] - ring + torch.arange(ring, device=x.device)[None]  # (B, R), relative to x
    valid = pos >= 0
    vals = gather_rows(x, pos.clamp(min=0))
    vals = vals * valid.reshape(valid.shape + (1,) * (x.dim() - 2)).to(vals.dtype)
    absolute = pos if offset is None else pos + offset[:, None]
    slots = absolute.remainder(ring)
    out = torch.zeros_like(vals).scatter(1, slots.reshape(slots.shape + (1,) * (x.dim() - 2)).expand(vals.shape), vals)
    return out, torch.full_like(pos, -1).scatter(1, slots, torch.where(valid, absolute, -1))
