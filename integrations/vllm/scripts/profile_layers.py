"""Op counts and times of the plugin's layer maths without an engine: one decode step and one prefill of the
benchmark's BST:SH:S4 model (``benchmark.py``: 4 layers, BST layers 0 and 2, W = 128, width 256), random weights.

Runs in the plugin's venv (or any env with torch; the layer maths imports no vLLM):

    PYTHONPATH=integrations/vllm .venv-vllm/bin/python integrations/vllm/scripts/profile_layers.py \
        [--decode-batch 1 4] [--prefill-len 4096] [--position 4096] [--repeat 20] [--top 15]

For each case it prints the number of aten ops dispatched (counted by a ``TorchDispatchMode``: deterministic, the
ops that reach a kernel, nested ones included) per layer kind and in all, the median wall time over ``--repeat``
runs, and torch.profiler's top ops by self CPU time.

``--scheduled R L`` replays a whole ``LLM.generate`` call of R requests of L-token prompts (``--output-len`` new
tokens each) step by step as vLLM's scheduler runs it on the CPU (``max_num_batched_tokens`` 4,096, the ``LLM``
default there, chunked prefill on, ``max_num_seqs`` R): each step the running requests first (a decode: one token;
a prompt begun earlier: the rest of it, within the budget), then waiting requests, each prompt chunked to what the
budget leaves; the decodes (one-token queries) first in the batch, the prefill chunks packed. It prints the steps,
the time of the whole call and of its mixers (``prefill_mix`` / ``decode_mix``: the stateful part, which stays eager
in the engine while vLLM compiles the rest) and the ops of its busiest step.
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


def schedule(requests: int, prompt_len: int, output_len: int, budget: int = 4096):
    """The steps of vLLM's scheduler (v1, chunked prefill) for ``requests`` prompts of ``prompt_len`` tokens arriving
    together: per step ``(decodes [(slot, position)], prefills [(slot, first position, length)])``."""
    done = [0] * requests  # tokens computed (prompt, then generated tokens fed back)
    total = prompt_len + output_len - 1  # the last generated token is not fed back
    running, waiting, steps = [], list(range(requests)), []
    while running or waiting:
        left, chunks = budget, []
        for r in running:
            n = min(max(prompt_len - done[r], 1), left)
            if n:
                chunks.append((r, done[r], n))
                left -= n
        while waiting and left:
            r = waiting.pop(0)
            running.append(r)
            chunks.append((r, 0, min(prompt_len, left)))
            left -= chunks[-1][2]
        for r, p0, n in chunks:
            done[r] = p0 + n
        running = [r for r in running if done[r] < total]
        steps.append(
            ([(r + 1, p0) for r, p0, n in chunks if n == 1], [(r + 1, p0, n) for r, p0, n in chunks if n > 1])
        )
    return steps


def run_step(layers, states, x, step, config):
    """One engine step of [`schedule`]: the decodes, then the prefill chunks packed in runs ([`Prefill.groups`])."""
    decodes, prefills = step
    outs = []
    if decodes:
        slots, positions = (torch.tensor(c) for c in zip(*decodes))
        outs.append(run_decode(layers, states, x[: len(decodes)], positions, slots, config))
    if prefills:
        slots, p0, lengths = (torch.tensor(c) for c in zip(*prefills))
        starts = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        positions = torch.cat([torch.arange(a, a + n) for a, n in zip(p0.tolist(), lengths.tolist())])
        prefill = x[len(decodes) :]
        for a, b, batch in Prefill.groups(starts, positions, slots, BLOCK_LEN):
            outs.append(run_prefill(layers, states, prefill[a:b], batch))
    return torch.cat(outs)


class MixTimer:
    """Wall and process CPU time spent in the layers' stateful parts (``prefill_mix``, ``decode_mix``) while it is
    entered."""

    def __enter__(self):
        self.wall, self.cpu, self.saved = 0.0, 0.0, {}
        for name in ("prefill_mix", "decode_mix"):
            fn = self.saved[name] = getattr(BSTLayerMath, name)

            def timed(*args, fn=fn, **kwargs):
                t0, c0 = time.perf_counter(), time.process_time()
                out = fn(*args, **kwargs)
                self.wall += time.perf_counter() - t0
                self.cpu += time.process_time() - c0
                return out

            setattr(BSTLayerMath, name, timed)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(BSTLayerMath, name, fn)


def scheduled(requests, prompt_len, output_len, repeat, top):
    """[`schedule`]'s whole call through the layers: its wall and mixer time (min over ``repeat``), and the ops and
    top ops of its step with the most tokens."""
    steps = schedule(requests, prompt_len, output_len)
    sizes = [len(d) + sum(n for _, _, n in p) for d, p in steps]
    busiest = steps[sizes.index(max(sizes))]
    print(
        f"\n== {requests} requests x {prompt_len} tokens + {output_len} new, as vLLM schedules them: {len(steps)} steps"
    )
    print("   steps (decodes, prefill chunk lengths):", [(len(d), [n for _, _, n in p]) for d, p in steps[:4]], "...")
    config, layers, states = build(requests + 1)
    x = torch.randn(max(sizes), SIZE["hidden_size"])
    runs = []  # (wall, CPU time, mixers' wall, mixers' CPU time) of each run
    with torch.inference_mode():
        for _ in range(repeat + 1):  # the first run computes the constants (S4D tables per chunk count)
            with MixTimer() as mix:
                t0, c0 = time.perf_counter(), time.process_time()
                for step in steps:
                    run_step(layers, states, x, step, config)
            runs.append((time.perf_counter() - t0, time.process_time() - c0, mix.wall, mix.cpu))
    best = [min(r[i] for r in runs[1:]) for i in range(4)]
    print(
        f"   whole call, min of {repeat}: wall {best[0]:.3f} s, CPU {best[1]:.3f} s; mixers: wall {best[2]:.3f} s, "
        f"CPU {best[3]:.3f} s (first run: wall {runs[0][0]:.3f} s)"
    )
    report(
        f"its busiest step ({len(busiest[0])} decodes, prefill chunks {[n for _, _, n in busiest[1]]})",
        partial(run_step, layers, states, x, busiest, config),
        max(1, repeat),
        top,
    )


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
    parser.add_argument("--scheduled", type=int, nargs=2, metavar=("REQUESTS", "PROMPT_LEN"), action="append")
    parser.add_argument("--output-len", type=int, default=32)
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
    for requests, prompt_len in args.scheduled or []:
        scheduled(requests, prompt_len, args.output_len, max(1, args.repeat // 10), args.top)


if __name__ == "__main__":
    main()
