"""Tensor helpers of the BST modules: tracing, the code path a tensor takes, row gathers, rings, state writes, memos."""

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
        self.previous, self.flag[0] = self.flag[0], self.enabled
        return self

    def __exit__(self, *exc):
        self.flag[0] = self.previous


class accelerator_code_path(Switch):
    """Context manager: inside it the model takes, on CPU tensors, the code path of an accelerator (same results)."""

    flag = [False]


UNKNOWN = "unknown"  # a host mirror to derive from the tensors on its next eager read


def host_mirror(source: str, empty, traced):
    """A property kept on the host (``_<name>``): ``empty`` while ``source`` is None, ``traced`` under tracing (raised
    if an exception), derived by the decorated function when ``UNKNOWN``."""

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
    return t.device.type != "cpu" or accelerator_code_path.flag[0]


def host_can_branch(t: torch.Tensor) -> bool:
    """Whether Python may read values of ``t`` (a CPU tensor in eager mode); else callers take a branch-free form."""
    return not on_accelerator(t) and not tracing()


def maybe_any(mask: torch.Tensor) -> bool:
    """``bool(mask.any())`` where reading it costs nothing ([`host_can_branch`]), else ``True`` (do the work)."""
    return bool(mask.any()) if host_can_branch(mask) else True


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` `(B, T, ...)`, ``index`` `(B, K)` -> `(B, K, ...)`."""
    shape = index.shape + x.shape[2:]
    return x.gather(1, index.reshape(index.shape + (1,) * (x.dim() - 2)).expand(shape))


def memoised(store: dict, slot, key: tuple, params, compute, max_bytes: int | None = None):
    """``compute()``, reused from ``store[slot]`` while ``key`` and the values of the tensors ``params`` are unchanged
    (values over ``max_bytes`` are not kept); only where no gradient has to flow to ``params``."""
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
    """[`memoised`] in a decoding run's memo ``store`` (docs/architecture.md, "Memos and code paths"): on an accelerator keyed on
    each parameter's storage and version counter; without a store, with gradients or under tracing, computed."""
    params = list(params)
    if store is None or not params or tracing() or (torch.is_grad_enabled() and any(p.requires_grad for p in params)):
        return compute()
    if not host_can_branch(params[0]):
        key = (*key, *((p.data_ptr(), p._version, p.shape, p.dtype, p.device) for p in params))
        params = []
    return memoised(store, slot, key, params, compute, max_bytes)


CONSTANT_MEMO_ENTRIES = 16  # entries a module's [`constant_memo`] keeps


def constant_memo(module, key: tuple, compute):
    """``compute()`` for tensors that depend on no parameter, once per ``key`` (naming device and dtype), kept on
    ``module``; under tracing computed in the graph."""
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
    """Mark CUDA state tensors as static addresses for ``torch.compile``'s CUDA graphs (unguarded: a new one re-records)."""
    if tracing():
        return
    for t in tensors:
        if t is not None and t.is_cuda and not t.requires_grad:
            from torch._dynamo import mark_static_address  # only CUDA decoding needs dynamo

            mark_static_address(t, guard=False)


def assign(owner, attr: str, new: torch.Tensor | None):
    """``owner.attr = new``: copied into the old tensor where that is safe, else the attribute takes ``new``."""
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
    """``new`` in the rows where ``rows`` (bool `(B,)`; None: all) is True, ``old`` elsewhere; contiguous."""
    if rows is not None and old is not None:
        new = torch.where(rows.reshape((-1,) + (1,) * (new.dim() - 1)), new.to(old.dtype), old)
    return new.contiguous()


def ring_from_sequence(x: torch.Tensor, lengths: torch.Tensor, ring: int, offset: torch.Tensor | None = None):
    """The last ``ring`` real positions of ``x`` `(B, T, ...)` at slot position % ``ring`` (``offset``: position of
    ``x[:, 0]``) -> values `(B, ring, ...)`, positions `(B, ring)` (-1: empty)."""
    pos = lengths[:, None] - ring + torch.arange(ring, device=x.device)[None]  # (B, R), relative to x
    valid = pos >= 0
    vals = gather_rows(x, pos.clamp(min=0))
    vals = vals * valid.reshape(valid.shape + (1,) * (x.dim() - 2)).to(vals.dtype)
    absolute = pos if offset is None else pos + offset[:, None]
    slots = absolute.remainder(ring)
    out = torch.zeros_like(vals).scatter(1, slots.reshape(slots.shape + (1,) * (x.dim() - 2)).expand(vals.shape), vals)
    return out, torch.full_like(pos, -1).scatter(1, slots, torch.where(valid, absolute, -1))
