"""A/B of two revisions of ``modeling_bst`` on the CPU: a training step and a decode step, alternated in one run.

    python -m benchmarks.ab_revisions --base HEAD~1            # the working tree against HEAD~1
    python -m benchmarks.ab_revisions --base v0.1 --head main  # two revisions

Each revision runs in its own worker process (``git worktree`` checkouts of the revisions, or the working tree for
``--head .``) with the same seed, model and inputs; the workers take turns, ``--rounds`` times each, so that a
change in the machine's load hits both alike. Prints the median milliseconds of each and the ratio head / base with
the range over rounds. For refactors that must not change speed: a ratio within the rounds' spread is noise.
``--cpu-allocation-threshold-mib N`` runs both workers with ``training/host.py``'s malloc settings (what
``training.train`` applies on the CPU); the default 0 leaves malloc as it is.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_common import positive_int


REPO = Path(__file__).resolve().parents[1]

WORKER = r"""
import importlib.util, json, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
from modeling_bst import BSTConfig, BSTForCausalLM
spec = json.loads(sys.argv[1])
if spec["allocation_threshold_mib"]:  # the lead tree's training/host.py, the same settings for both revisions
    found = importlib.util.spec_from_file_location("host", spec["host_py"])
    host = importlib.util.module_from_spec(found)
    found.loader.exec_module(host)
    assert host.keep_large_allocations(spec["allocation_threshold_mib"])
torch.manual_seed(0)
config = BSTConfig(**spec["config"])
model = BSTForCausalLM(config)
ids = torch.randint(1, config.vocab_size, (spec["batch"], spec["seq_len"]), generator=torch.Generator().manual_seed(1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step():
    model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def decode_steps():
    model.eval()
    with torch.no_grad():
        cache = model(ids[:, : spec["prefill"]], use_cache=True).past_key_values
        token = ids[:, spec["prefill"] : spec["prefill"] + 1]
        start = time.perf_counter()
        for _ in range(spec["decode_steps"]):
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        return (time.perf_counter() - start) / spec["decode_steps"]


train_step()  # warm-up
decode_steps()
start = time.perf_counter()
for _ in range(spec["train_steps"]):
    train_step()
train_ms = (time.perf_counter() - start) / spec["train_steps"] * 1e3
print(json.dumps({"train_ms": train_ms, "decode_ms": decode_steps() * 1e3}))
"""


def checkout(rev: str, scratch: Path) -> Path:
    """A path holding revision ``rev`` (``.``: the working tree)."""
    if rev == ".":
        return REPO
    path = scratch / rev.replace("/", "_").replace("~", "-")
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
    return path


def run_worker(tree: Path, spec: dict, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(spec), str(threads)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the worker on {tree} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--head", default=".", help="git revision, or . for the working tree (default)")
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--seq-len", type=positive_int, default=512)
    parser.add_argument("--batch", type=positive_int, default=2)
    parser.add_argument("--hidden-size", type=positive_int, default=128)
    parser.add_argument("--layers", type=positive_int, default=4)
    parser.add_argument("--block-len", type=positive_int, default=64)
    parser.add_argument("--train-steps", type=positive_int, default=3)
    parser.add_argument("--decode-steps", type=positive_int, default=64)
    parser.add_argument("--cpu-allocation-threshold-mib", type=int, default=0, help="training/host.py; 0: unchanged")
    args = parser.parse_args(argv)
    config = dict(
        vocab_size=512,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        head_dim=args.hidden_size // 4,
        intermediate_size=4 * args.hidden_size,
        block_len=args.block_len,
        bst_layer_indices=list(range(1, args.layers, 2)),
        max_position_embeddings=max(1024, args.seq_len),
    )
    spec = dict(
        config=config,
        batch=args.batch,
        seq_len=args.seq_len,
        prefill=args.seq_len - 1,
        train_steps=args.train_steps,
        decode_steps=args.decode_steps,
        allocation_threshold_mib=args.cpu_allocation_threshold_mib,
        host_py=str(REPO / "training" / "host.py"),
    )
    with tempfile.TemporaryDirectory() as scratch:
        trees = {"base": checkout(args.base, Path(scratch)), "head": checkout(args.head, Path(scratch))}
        rows = {"base": [], "head": []}
        try:
            for r in range(args.rounds):
                for name in ("base", "head") if r % 2 == 0 else ("head", "base"):
                    rows[name].append(run_worker(trees[name], spec, args.threads))
                    print(f"round {r + 1}/{args.rounds} {name}: {rows[name][-1]}", flush=True)
        finally:
            for tree in trees.values():
                if tree != REPO:
                    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    malloc = (
        f"malloc threshold {args.cpu_allocation_threshold_mib} MiB"
        if args.cpu_allocation_threshold_mib
        else "malloc as is"
    )
    print(f"\n{time.strftime('%Y-%m-%d')}, {args.threads} thread(s), {malloc}, base {args.base}, head {args.head}")
    print("| measure | base ms (median) | head ms (median) | head / base (min-max over rounds) |")
    print("|---|---|---|---|")
    for key in ("train_ms", "decode_ms"):
        base, head = [row[key] for row in rows["base"]], [row[key] for row in rows["head"]]
        ratios = [h / b for h, b in zip(head, base)]
        print(
            f"| {key[:-3]} step | {statistics.median(base):.2f} | {statistics.median(head):.2f} | "
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) |"
        )


if __name__ == "__main__":
    main()
