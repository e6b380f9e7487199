"""Backend op counts and CPU time of one S4D SSM's full-sequence map, forward and backward (the training path).

An op is every aten call a ``TorchDispatchMode`` sees, except views (any return whose ``alias_info`` is not a write)
and ``_unsafe_view``: what an eager GPU step launches (or dispatches) once each. Usage::

    python -m benchmarks.ssm_ops [--length 4096] [--channels 128] [--state 64] [--out-channels 1] [--time]

``--time``: forward + backward in float32 on one thread, min over rounds (``--rounds``).
"""

import argparse
import collections
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def is_view(func) -> bool:
    """Whether an aten op returns a view of an input (an alias that is not written)."""
    if func is torch.ops.aten._unsafe_view.default:
        return True
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class OpCounter(TorchDispatchMode):
    """Counts the non-view aten ops dispatched inside it (``counts``: op name -> calls); with ``forbid_complex``,
    raises on any op that returns a complex tensor."""

    def __init__(self, forbid_complex: bool = False):
        super().__init__()
        self.counts = collections.Counter()
        self.forbid_complex = forbid_complex

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not is_view(func):
            self.counts[str(func.overloadpacket.__name__)] += 1
        if self.forbid_complex:
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.is_complex():
                    raise AssertionError(f"{func} returned a complex tensor")
        return out

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def make_kernel(channels=128, out_channels=1, state_size=64, dtype=torch.float32):
    from modeling_bst import BSTConfig
    from modeling_bst.ssm_bst import S4DKernel

    config = BSTConfig(
        vocab_size=97, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=8, block_len=4,
        bst_layer_indices=[0], ssm_state_size=state_size,
    )  # fmt: skip
    kernel = S4DKernel(channels, out_channels, state_size, config).to(dtype)
    kernel.reset_parameters()
    return kernel.train()


def count(kernel, z, state=None):
    """Ops of ``kernel(z, state)`` forward and of its backward: ``(forward Counter, backward Counter)``."""
    z = z.detach().requires_grad_(True)
    with OpCounter() as fwd:
        y = kernel(z, state)
    grad = torch.randn_like(y)
    with OpCounter() as bwd:
        y.backward(grad)
    return fwd, bwd


def fwd_bwd_ms(kernel, z, rounds=7):
    z = z.detach().requires_grad_(True)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        y = kernel(z)
        y.sum().backward()
        best = min(best, time.perf_counter() - t0)
    return 1000 * best


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--channels", type=int, default=128)
    parser.add_argument("--state", type=int, default=64)
    parser.add_argument("--out-channels", type=int, default=1)
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    kernel = make_kernel(args.channels, args.out_channels, args.state)
    z = torch.randn(1, args.length, args.channels)
    kernel(z).sum().backward()  # warm-up (and the exponent constants' first build)
    fwd, bwd = count(kernel, z)
    print(f"ops: forward {fwd.total}, backward {bwd.total}")
    if args.verbose:
        print("forward", dict(fwd.counts.most_common()))
        print("backward", dict(bwd.counts.most_common()))
    if args.time:
        torch.set_num_threads(1)
        print(f"forward+backward: {fwd_bwd_ms(kernel, z, args.rounds):.1f} ms (min of {args.rounds}, 1 thread)")


if __name__ == "__main__":
    main()
