"""Op counts and times of the plugin's layer maths without an engine: one decode step and one prefill of the
benchmark's BST:SH:S4 model (``benchmark.py``: 4 layers, BST layers 0 and 2, W = 128, width 256), random weights.

Runs in the plugin's venv (or any env with torch; the layer maths imports no vLLM):

    PYTHONPATH=integrations/vllm .venv-vllm/bin/python integrations/vllm/scripts/profile_layers.py \
        [--decode-batch 1 4] [--prefill-len 4096] [--position 4096] [--repeat 20] [--top 15]

For each case it prints the number of aten ops dispatched (counted by a ``TorchDispatchMode``: deterministic, the
ops that reach a kernel, nested ones included) per layer kind and in all, the median wall time over ``--repeat``
runs, and torch.profiler's top ops by self CPU time.
"""

import argparse
import math
import statistics
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark import BLOCK_LEN, BST_FIELDS, SIZE  # noqa: E402
from bst_vllm.config import BSTServingConfig  # noqa: E402
from bst_vllm.layers import BSTLayerMath, Decode, Prefill  # noqa: E402


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it, by name."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def build(slots: int):
    """The benchmark's model's layers (random weights of the benchmark's scales) and a state pool of ``slots``."""
    torch.manual_seed(0)
    config = BSTServingConfig(**BST_FIELDS)
    layers = []
    for kind in config.bst_layer_types:
        layer = BSTLayerMath(config, kind)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if name.endswith("ssm.A_log_real"):
                    p.fill_(math.log(0.5))
                elif name.endswith("ssm.log_dt"):
                    p.uniform_(math.log(1e-3), math.log(1e-1))
                elif not name.endswith("norm.weight"):
                    p.normal_(0, 1 / math.sqrt(p.shape[-1]))
        layers.append(layer)
    shapes = BSTLayerMath.state_shapes(config)
    states = [tuple(torch.zeros(slots, *s) for s in shapes) for _ in layers]
    return config, layers, states


def run_decode(layers, states, x, positions, slots, config):
    batch = Decode(positions, slots, config)  # once per engine step, as the engine does
    for layer, state in zip(layers, states):
        x = layer.decode(x, batch, state)
    return x


def run_prefill(layers, states, x, batch):
    for layer, state in zip(layers, states):
        x = layer.prefill(x, batch, state)
    return x


def decode_layer(layers, states, x, batch, i):
    return layers[i].decode(x, batch, states[i])


def prefill_layer(layers, states, x, batch, i):
    return layers[i].prefill(x, batch, states[i])


def report(title, fn, repeat, top):
    with torch.inference_mode():
        fn()  # warm-up: constants computed once (S4D tables, decode bias)
        with OpCounter() as counter:
            fn()
        total = counter.counts
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
    print(f"\n== {title}: {sum(total.values())} aten ops, median {1e3 * statistics.median(times):.2f} ms")
    print("   most frequent:", ", ".join(f"{k.split('.')[-1]} {v}" for k, v in total.most_common(top)))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    return sum(total.values())


def per_layer_counts(layers, call):
    """Ops of each layer kind (the first layer of each kind)."""
    out = {}
    with torch.inference_mode():
        for i, layer in enumerate(layers):
            if layer.kind in out:
                continue
            with OpCounter() as counter:
                call(i)
            out[layer.kind] = sum(counter.counts.values())
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--prefill-len", type=int, nargs="*", default=[4096])
    parser.add_argument("--position", type=int, default=4096, help="the decode step's position")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hidden = SIZE["hidden_size"]
    for bsz in args.decode_batch:
        config, layers, states = build(bsz + 1)
        x = torch.randn(bsz, hidden)
        positions = torch.full((bsz,), args.position, dtype=torch.long)
        slots = torch.arange(1, bsz + 1)
        n = report(
            f"decode step, {bsz} request(s) at position {args.position}",
            partial(run_decode, layers, states, x, positions, slots, config),
            args.repeat,
            args.top,
        )
        kinds = per_layer_counts(layers, partial(decode_layer, layers, states, x, Decode(positions, slots, config)))
        print(f"   per layer: {kinds}; {n} in all")
    for length in args.prefill_len:
        config, layers, states = build(2)
        x = torch.randn(length, hidden)
        query_start = torch.tensor([0, length])
        batch = Prefill.groups(query_start, torch.arange(length), torch.tensor([1]), BLOCK_LEN)
        assert len(batch) == 1
        batch = batch[0][2]
        n = report(
            f"prefill of one {length}-token prompt",
            partial(run_prefill, layers, states, x, batch),
            max(1, args.repeat // 10),
            args.top,
        )
        kinds = per_layer_counts(layers, partial(prefill_layer, layers, states, x, batch))
        print(f"   per layer: {kinds}; {n} in all")


if __name__ == "__main__":
    main()
