"""Throughput of vLLM serving a BST model vs vLLM serving a Llama of the same size, on the CPU, in one run.

Runs in the plugin's venv (``scripts/setup.sh``):

    VLLM_CPU_KVCACHE_SPACE=2 .venv-vllm/bin/python integrations/vllm/scripts/benchmark.py \
        [--prompt-lens 1024 2048] [--concurrency 1 4 16] [--output-len 64] [--table out.md]

Both models are random-initialised (throughput does not depend on the weights) with the same width, depth, heads,
MLP width and vocabulary; the BST model is BST:SH:S4 with every other layer a BST layer and W = 128. For every
prompt length and concurrency c, c requests of that prompt length decode ``--output-len`` tokens each (greedy,
``ignore_eos``) in one ``LLM.generate`` call; the table gives the wall time, the generated and total (prompt +
generated) tokens per second, the peak resident memory of the engine's processes, and the per-sequence state:
a BST sequence keeps a fixed-size state (W-token attention ring, S4D state, context states) whatever its length,
a Llama sequence keeps its keys/values for every token. Each model runs in its own process (its own engine).

``--prefix-ttft N`` measures prefix caching instead: the BST model served with prefix caching on, the time to first
token (a one-token ``LLM.generate``) of an N-token prompt, of the same prompt again, and of the prompt extended by
256 tokens (a follow-up turn), with the tokens each found in the prefix cache; and the first prompt's time with
prefix caching off, in another engine.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch


SIZE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, head_dim=64, intermediate_size=1024)
VOCAB = 4096
BLOCK_LEN = 128
MAX_LEN = 8192


def write_tokenizer(folder: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(folder)


def write_llama(folder: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        num_key_value_heads=SIZE["num_attention_heads"],
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=True,
        dtype="float32",
        **SIZE,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    write_tokenizer(folder)


def write_bst(folder: Path):
    """A random BST:SH:S4 checkpoint in ``modeling_bst``'s layout, made with the plugin's own layer modules."""
    from bst_vllm.config import BSTServingConfig
    from bst_vllm.layers import BSTLayerMath
    from safetensors.torch import save_file

    torch.manual_seed(0)
    fields = dict(
        vocab_size=VOCAB,
        max_position_embeddings=MAX_LEN,
        block_len=BLOCK_LEN,
        bst_layer_indices=list(range(0, SIZE["num_hidden_layers"], 2)),
        context_mode="sh",
        ssm_kind="s4",
        ssm_state_size=16,
        tie_word_embeddings=True,
        **SIZE,
    )
    config = BSTServingConfig(**fields)
    tensors = {"model.embed_tokens.weight": torch.randn(VOCAB, SIZE["hidden_size"]), "model.norm.weight": None}
    tensors["model.norm.weight"] = torch.ones(SIZE["hidden_size"])
    for i, kind in enumerate(config.bst_layer_types):
        layer = BSTLayerMath(config, kind == "bst")
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):
                value = torch.ones_like(p)
            elif name.endswith("ssm.A_log_real"):
                value = torch.full_like(p, math.log(0.5))
            elif name.endswith("ssm.A_imag"):
                value = math.pi * torch.arange(p.shape[1]).float().expand_as(p).clone()
            elif name.endswith("ssm.log_dt"):
                value = torch.empty_like(p).uniform_(math.log(1e-3), math.log(1e-1))
            elif name.endswith("scale"):
                value = torch.full_like(p, math.sqrt(SIZE["head_dim"]))
            else:
                value = torch.randn_like(p) / math.sqrt(p.shape[-1])
            tensors[f"model.layers.{i}.{name}"] = value.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config_json = {"model_type": "bst", "architectures": ["BSTForCausalLM"], "dtype": "float32", **fields}
    (folder / "config.json").write_text(json.dumps(config_json, indent=1))
    write_tokenizer(folder)


def state_bytes_per_sequence(kind: str, length: int) -> int:
    """Bytes of per-sequence state (float32) a sequence of ``length`` tokens holds."""
    layers, heads, hd, d = (SIZE[k] for k in ("num_hidden_layers", "num_attention_heads", "head_dim", "hidden_size"))
    if kind == "llama":
        return 2 * layers * heads * hd * 4 * length
    ring = 2 * BLOCK_LEN * heads * hd  # attention keys/values of the last W tokens
    bst = ring + (d // 4) * 8 * 2 + 2 * BLOCK_LEN * heads * hd  # + S4D state (N/2 complex modes) + SH context
    return layers * bst * 4  # every layer declares the BST layout (one page size)


def tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0


def run_one(kind: str, folder: Path, prompt_lens, concurrency, output_len) -> list[dict]:
    """One engine for ``kind``; returns a row per (prompt length, concurrency)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], tree_rss(os.getpid()))
            time.sleep(0.2)

    start = time.time()
    llm = LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=max(prompt_lens) + output_len,
        max_num_seqs=max(concurrency),
        enable_prefix_caching=False,
        seed=0,
    )
    startup = time.time() - start
    threading.Thread(target=sample, daemon=True).start()
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    # Warm-up: one short request.
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)
    rows = []
    for length in prompt_lens:
        for c in concurrency:
            prompts = [
                TokensPrompt(prompt_token_ids=torch.randint(1, VOCAB, (length,), generator=g).tolist())
                for _ in range(c)
            ]
            t0 = time.time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.time() - t0
            generated = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append(
                dict(
                    model=kind,
                    prompt_len=length,
                    concurrency=c,
                    seconds=round(seconds, 2),
                    generated_tok_s=round(generated / seconds, 1),
                    total_tok_s=round((generated + c * length) / seconds, 1),
                    peak_rss_gib=round(peak[0] / 2**30, 2),
                    state_mib_per_seq=round(state_bytes_per_sequence(kind, length + output_len) / 2**20, 2),
                    engine_start_s=round(startup, 1),
                )
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    stop.set()
    llm.llm_engine.engine_core.shutdown()
    return rows


def prefix_ttft(folder: Path, length: int, caching: bool) -> dict:
    """Time to first token with prefix caching (``caching``: first prompt, the same again, the prompt extended by
    256 tokens) or without it (the first prompt), in one engine; seconds and prefix-cache hits."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"  # the checkpoint says MAX_LEN; S4 BST runs at any length
    llm = LLM(model=str(folder), dtype="float32", max_model_len=length + 512, max_num_seqs=4,
              enable_prefix_caching=caching, seed=0)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, VOCAB, (length,), generator=g).tolist()
    follow_up = prompt + torch.randint(1, VOCAB, (256,), generator=g).tolist()
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)  # warm-up
    result = {}
    for label, ids in [("first", prompt), ("repeat", prompt), ("follow_up", follow_up)][: 3 if caching else 1]:
        t0 = time.time()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        result[label] = dict(prompt_len=len(ids), ttft_s=round(time.time() - t0, 3), cached=out.num_cached_tokens)
        print(json.dumps({label: result[label]}), file=sys.stderr, flush=True)
    llm.llm_engine.engine_core.shutdown()
    return result


def prefix_report(length: int) -> str:
    """Both engines (prefix caching on and off) in child processes; a Markdown table."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "bst"
        write_bst(folder)
        runs = {}
        for mode in ("on", "off"):
            command = [sys.executable, __file__, "--run", f"prefix-{mode}", "--folder", str(folder)]
            command += ["--prefix-ttft", str(length)]
            out = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True).stdout
            runs[mode] = json.loads(out.strip().splitlines()[-1])
    first = runs["on"]["first"]["ttft_s"]
    lines = [
        "| prefix caching | request | prompt_len | cached_tokens | ttft_s | vs first |",
        "|---|---|---|---|---|---|",
    ]
    for mode, rows in runs.items():
        for label, r in rows.items():
            ratio = round(r["ttft_s"] / first, 3)
            lines.append(f"| {mode} | {label} | {r['prompt_len']} | {r['cached']} | {r['ttft_s']} | {ratio} |")
    return "\n".join(lines) + f"\n\n{os.cpu_count()} CPUs; torch {torch.__version__}.\n"


def table(rows: list[dict]) -> str:
    head = [
        "model",
        "prompt_len",
        "concurrency",
        "seconds",
        "generated_tok_s",
        "total_tok_s",
        "peak_rss_gib",
        "state_mib_per_seq",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r[h]) for h in head) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--table", type=Path, help="also write the Markdown table here")
    parser.add_argument(
        "--prefix-ttft", type=int, metavar="N", help="time to first token of a repeated N-token prompt"
    )
    parser.add_argument("--run", choices=["llama", "bst", "prefix-on", "prefix-off"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)  # --run: one engine, in a child process
    args = parser.parse_args(argv)
    if args.run in ("prefix-on", "prefix-off"):
        print(json.dumps(prefix_ttft(args.folder, args.prefix_ttft, args.run == "prefix-on")))
        return 0
    if args.prefix_ttft:
        text = prefix_report(args.prefix_ttft)
        print(text)
        if args.table:
            args.table.write_text(text)
        return 0
    if args.run:
        rows = run_one(args.run, args.folder, args.prompt_lens, args.concurrency, args.output_len)
        print(json.dumps(rows))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, write in (("llama", write_llama), ("bst", write_bst)):
            folder = Path(tmp) / kind
            write(folder)
            command = [
                sys.executable,
                __file__,
                "--run",
                kind,
                "--folder",
                str(folder),
                "--output-len",
                str(args.output_len),
            ]
            command += ["--prompt-lens", *map(str, args.prompt_lens), "--concurrency", *map(str, args.concurrency)]
            out = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True).stdout
            rows += json.loads(out.strip().splitlines()[-1])
    order = sorted(rows, key=lambda r: (r["prompt_len"], r["concurrency"], r["model"]))
    text = table(order)
    starts = {r["model"]: r["engine_start_s"] for r in rows}
    text += f"\n\nEngine start (s): {starts}; {os.cpu_count()} CPUs; torch {torch.__version__}.\n"
    print(text)
    if args.table:
        args.table.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
