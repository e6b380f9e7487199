"""Throughput of vLLM serving a BST model against vLLM's own models of the same width, on the CPU, in one run.

Runs in the plugin's venv (``scripts/setup.sh``):

    VLLM_CPU_KVCACHE_SPACE=4 .venv-vllm/bin/python integrations/vllm/scripts/benchmark.py \
        [--models bst llama mamba2 nemotronh swa] [--baseline REV] [--prompt-lens 1024 4096 16384 32768] \
        [--concurrency 1 4 16 64] [--output-len 32] [--table out.md]

Every model is random-initialised (throughput does not depend on the weights) with width 256, vocabulary 4096,
float32, and runs in its own process (its own engine, the same ``VLLM_CPU_KVCACHE_SPACE``, prefix caching off):

* ``bst``: BST:SH:S4, 4 layers (BST layers 0 and 2, block layers 1 and 3), W = 128, 4 heads of 64, MLP 1024, the
  plugin on ``PYTHONPATH`` (or installed); ``--baseline REV`` adds ``bst@REV``, the same checkpoint served by the
  plugin of git revision REV (exported with ``git archive``), for before / after ratios in one run;
* ``llama``: vLLM's Llama, 4 layers, 4 heads of 64, MLP 1024 (full attention: keys/values of every token);
* ``mamba2``: vLLM's native Mamba2, 4 Mamba2 mixers (expand 2: 8 heads of 64, state 128, one group);
* ``nemotronh``: vLLM's NemotronH, a hybrid of Mamba2 mixers (as above) and full attention (4 heads of 64):
  mamba, MLP, attention, MLP, mamba, MLP, attention, MLP (relu^2 MLPs of 1024);
* ``swa``: a sliding-window Transformer, vLLM's Mistral with ``sliding_window`` = W = 128, otherwise as ``llama``.

For every prompt length and concurrency c, c requests of random prompts of that length: one ``LLM.generate`` call
decoding ``--output-len`` tokens each (greedy, ``ignore_eos``) gives the generated and total tokens per second
over the call (prefill included) and the mean / max time to first token of its requests (vLLM's request metrics).
Each engine also reports vLLM's own count of how many requests of its ``max_model_len`` (longest prompt + output)
its state pool holds ("Maximum concurrency" of the engine's start-up log): fixed-size states for BST and Mamba2,
keys/values of every token for Llama and NemotronH's attention layers, of the window for ``swa``.

``--prefix-ttft N`` measures prefix caching instead: the BST model served with prefix caching on, the time to first
token (a one-token ``LLM.generate``) of an N-token prompt, of the same prompt again, and of the prompt extended by
256 tokens (a follow-up turn), with the tokens each found in the prefix cache; and the first prompt's time with
prefix caching off, in another engine.
"""

import argparse
import json
import math
import os
import re
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
MODELS = ("bst", "llama", "mamba2", "nemotronh", "swa")
QUADRATIC = ("llama", "nemotronh")  # full-attention prefill
# Mamba2 mixers of the peers: expand 2 (inner width 512), heads of 64, state 128, one group, kernel 4.
MAMBA = dict(expand=2, n_groups=1, conv_kernel=4)
MAMBA_HEADS, MAMBA_HEAD_DIM, MAMBA_STATE = 8, 64, 128


def write_tokenizer(folder: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(folder)


# The BST:SH:S4 model's configuration fields (BST layers 0 and 2), shared with profile_layers.py.
BST_FIELDS = dict(
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


def write_hf(folder: Path, family: str, **fields):
    """A random float32 checkpoint of transformers' ``<family>Config`` / ``<family>ForCausalLM`` with ``fields``."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB, tie_word_embeddings=True, dtype="float32", **fields
    )
    getattr(transformers, f"{family}ForCausalLM")(config).save_pretrained(folder)
    write_tokenizer(folder)


# Llama and the sliding-window Mistral rotate by position: vLLM's cos / sin cache has max_position_embeddings rows,
# and a position beyond it fails in the compiled kernel ("index out of bounds"), so they get room for the longest
# prompts the script runs (64k positions).
ROPE_LEN = 65536
ATTENTION = dict(num_key_value_heads=SIZE["num_attention_heads"], max_position_embeddings=ROPE_LEN, **SIZE)
MAMBA2 = dict(hidden_size=SIZE["hidden_size"], num_heads=MAMBA_HEADS, head_dim=MAMBA_HEAD_DIM, state_size=MAMBA_STATE)
NEMOTRONH = dict(
    hidden_size=SIZE["hidden_size"],
    layers_block_type=["mamba", "mlp", "attention", "mlp"] * 2,
    num_attention_heads=SIZE["num_attention_heads"],
    num_key_value_heads=SIZE["num_attention_heads"],
    head_dim=SIZE["head_dim"],
    intermediate_size=SIZE["intermediate_size"],
    max_position_embeddings=MAX_LEN,
    mamba_num_heads=MAMBA_HEADS,
    mamba_head_dim=MAMBA_HEAD_DIM,
    ssm_state_size=MAMBA_STATE,
)


def write_llama(folder: Path):
    write_hf(folder, "Llama", **ATTENTION)


def write_mistral_swa(folder: Path):
    write_hf(folder, "Mistral", sliding_window=BLOCK_LEN, **ATTENTION)


def write_mamba2(folder: Path):
    write_hf(folder, "Mamba2", num_hidden_layers=SIZE["num_hidden_layers"], **MAMBA2, **MAMBA)


def write_nemotronh(folder: Path):
    write_hf(folder, "NemotronH", **NEMOTRONH, **MAMBA)


def write_bst(folder: Path):
    """A random BST:SH:S4 checkpoint in ``modeling_bst``'s layout, made with the plugin's own layer modules."""
    from bst_vllm.config import BSTServingConfig
    from bst_vllm.layers import BSTLayerMath
    from safetensors.torch import save_file

    torch.manual_seed(0)
    fields = dict(BST_FIELDS)
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
    """Bytes of per-sequence state (float32) a sequence of ``length`` tokens holds (the model's arithmetic; vLLM
    rounds attention to whole blocks and gives every layer of a hybrid the same page)."""
    layers, heads, hd, d = (SIZE[k] for k in ("num_hidden_layers", "num_attention_heads", "head_dim", "hidden_size"))
    kv = 2 * heads * hd  # one token's keys and values in one attention layer
    inner = MAMBA["expand"] * d
    mamba = (inner + 2 * MAMBA["n_groups"] * MAMBA_STATE) * (MAMBA["conv_kernel"] - 1)
    mamba += MAMBA_HEADS * MAMBA_HEAD_DIM * MAMBA_STATE  # conv state + SSM state of one Mamba2 layer
    floats = {
        "llama": layers * kv * length,
        "swa": layers * kv * min(length, BLOCK_LEN),
        "mamba2": layers * mamba,
        "nemotronh": 2 * mamba + 2 * kv * length,
    }.get(kind)
    if floats is None:  # BST: every layer declares the BST layout (one page size)
        ring = kv * BLOCK_LEN  # attention keys/values of the last W tokens
        floats = layers * (ring + (d // 4) * 8 * 2 + kv * BLOCK_LEN)  # + S4D state (N/2 complex modes) + SH context
    return floats * 4


def tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0


def run_one(kind: str, folder: Path, prompt_lens, concurrency, output_len, max_cell_tokens=None) -> list[dict]:
    """One engine for ``kind``; returns a row per (prompt length, concurrency) it runs ([`skipped`])."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], tree_rss(os.getpid()))
            time.sleep(0.2)

    start = time.time()
    if max(prompt_lens) + output_len > MAX_LEN:
        os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"  # the random checkpoints say MAX_LEN
    llm = LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=max(prompt_lens) + output_len,
        max_num_seqs=max(concurrency),
        enable_prefix_caching=False,
        disable_log_stats=False,  # per-request metrics (time to first token)
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
            if skipped(kind, length, c, max_cell_tokens):
                continue
            prompts = [
                TokensPrompt(prompt_token_ids=torch.randint(1, VOCAB, (length,), generator=g).tolist())
                for _ in range(c)
            ]
            t0 = time.time()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.time() - t0
            generated = sum(len(o.outputs[0].token_ids) for o in outs)
            ttft = [o.metrics.first_token_latency for o in outs if getattr(o, "metrics", None) is not None]
            rows.append(
                dict(
                    model=kind,
                    prompt_len=length,
                    concurrency=c,
                    seconds=round(seconds, 2),
                    generated_tok_s=round(generated / seconds, 1),
                    total_tok_s=round((generated + c * length) / seconds, 1),
                    ttft_mean_s=round(sum(ttft) / len(ttft), 2) if ttft else None,
                    ttft_max_s=round(max(ttft), 2) if ttft else None,
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
        "ttft_mean_s",
        "ttft_max_s",
        "state_mib_per_seq",
        "max_concurrency",
        "peak_rss_gib",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r[h]) for h in head) + " |" for r in rows]
    return "\n".join(lines)


WRITERS = dict(bst=write_bst, llama=write_llama, mamba2=write_mamba2, nemotronh=write_nemotronh, swa=write_mistral_swa)
CONCURRENCY_LOG = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def export_plugin(rev: str, into: Path) -> Path:
    """The plugin of git revision ``rev`` (and the maths file it loads) under ``into``: its import path."""
    root = Path(__file__).resolve().parents[3]
    paths = ["integrations/vllm/bst_vllm", "modeling_bst/functional_bst.py"]
    archive = subprocess.run(["git", "-C", str(root), "archive", rev, *paths], stdout=subprocess.PIPE, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "integrations" / "vllm"


def skipped(kind: str, length: int, concurrency: int, max_cell_tokens: int | None) -> bool:
    """Whether ``--max-cell-tokens`` skips a cell: a model whose prefill grows quadratically with the prompt (full
    attention: ``llama``, ``nemotronh``) over more than that many prompt tokens (on 2 cores 16 x 32k takes hours)."""
    return max_cell_tokens is not None and kind in QUADRATIC and length * concurrency > max_cell_tokens


def run_engine(kind: str, folder: Path, args, pythonpath: Path | None = None) -> list[dict]:
    """One engine in a child process (``--run``): its rows, with vLLM's "Maximum concurrency" from its log."""
    command = [sys.executable, __file__, "--run", kind, "--folder", str(folder), "--output-len", str(args.output_len)]
    command += ["--prompt-lens", *map(str, args.prompt_lens), "--concurrency", *map(str, args.concurrency)]
    if args.max_cell_tokens:
        command += ["--max-cell-tokens", str(args.max_cell_tokens)]
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    log = []
    for line in child.stderr:  # the engine's log, passed on as it comes
        sys.stderr.write(line)
        log.append(line)
    out = child.stdout.read()
    if child.wait():
        raise RuntimeError(f"{kind}: the engine's process failed (exit {child.returncode}); its log is above.")
    rows = json.loads(out.strip().splitlines()[-1])
    found = CONCURRENCY_LOG.findall("".join(log) + out)  # vLLM logs to stdout
    for row in rows:
        row["max_concurrency"] = f"{float(found[-1][1]):.1f} @ {found[-1][0]}" if found else None
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--baseline", metavar="REV", help="also serve the BST model with the plugin of git REV")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--table", type=Path, help="also write the Markdown table here")
    parser.add_argument(
        "--max-cell-tokens", type=int, metavar="N", help="skip llama / nemotronh cells of more than N prompt tokens"
    )
    parser.add_argument(
        "--prefix-ttft", type=int, metavar="N", help="time to first token of a repeated N-token prompt"
    )
    parser.add_argument("--run", choices=[*MODELS, "prefix-on", "prefix-off"], help=argparse.SUPPRESS)
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
        rows = run_one(
            args.run, args.folder, args.prompt_lens, args.concurrency, args.output_len, args.max_cell_tokens
        )
        print(json.dumps(rows))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(kind, kind, None) for kind in args.models]
        if args.baseline:  # served first, then the plugin being measured
            (Path(tmp) / "baseline").mkdir()
            runs.insert(0, (f"bst@{args.baseline}", "bst", export_plugin(args.baseline, Path(tmp) / "baseline")))
        for label, kind, pythonpath in runs:
            folder = Path(tmp) / kind
            if not folder.exists():
                WRITERS[kind](folder)
            for row in run_engine(kind, folder, args, pythonpath):
                rows.append({**row, "model": label})
    order = sorted(rows, key=lambda r: (r["prompt_len"], r["concurrency"]))
    text = table(order)
    starts = {r["model"]: r["engine_start_s"] for r in rows}
    text += f"\n\nEngine start (s): {starts}; {os.cpu_count()} CPUs; torch {torch.__version__}.\n"
    print(text)
    if args.table:
        args.table.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
