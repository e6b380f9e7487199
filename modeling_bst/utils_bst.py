"""Tensor helpers of the BST modules: tracing, the code path a tensor takes, row gathers, memos."""

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
    """``compute()``, reused from ``store[slot]`` while ``key`` and the values of the tensors ``params`` are equal."""
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
    sizes = (t.numel() * t.element_size() for t in (value if isinstance(value, tuple) else (value,)))  # lazy
    if max_bytes is None or sum(sizes) <= max_bytes:
        store[slot] = {"key": key, "params": [p.detach().clone() for p in params], "value": value}
    return value


def step_memo(store: dict | None, slot, key: tuple, params, compute, max_bytes: int | None = None):
    """[`memoised`] in a decoding run's memo ``store`` (docs/architecture.md, "Memos and code paths")."""
    params = list(params)
    if store is None or not params or tracing() or (torch.is_grad_enabled() and any(p.requires_grad for p in params)):
        return compute()
    if not host_can_branch(params[0]):
        key = (*key, *((p.data_ptr(), p._version, p.shape, p.dtype, p.device) for p in params))
        params = []
    return memoised(store, slot, key, params, compute, max_bytes)


CONSTANT_MEMO_ENTRIES = 16  # entries a module's [`constant_memo`] keeps


def constant_memo(module, key: tuple, compute):
    """``compute()`` for tensors that depend on no parameter, once per ``key`` (naming device and dtype) [`memoised`]."""
    if tracing():
        return compute()
    store = module.__dict__.setdefault("_constant_memo", {})
    if key not in store and len(store) >= CONSTANT_MEMO_ENTRIES:
        store.clear()
    return memoised(store, key, (), (), compute)
