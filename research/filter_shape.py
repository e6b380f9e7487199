"""How an SSM's filters look beyond the attention window (issue #13: why BST:SH:unstruct stays at chance on MQAR).

    python -m research.filter_shape                                   # MQAR's BST models at initialisation
    python -m research.filter_shape --models bst-sh-unstruct --set unstruct_sin_freq=1
    python -m research.filter_shape --checkpoint RUN.ckpt.safetensors --models bst-sh-unstruct --set ...

A BST layer's context state at a block boundary is the SSM output there: ``sum_l k[c, l] * z[t - l]`` per channel
``c``. For a model to read a key-value pair from ``l`` tokens back, where the query's distance to its pair varies from
sequence to sequence, the filter ``k[c, l]`` must weigh the pair alike over the range of distances: a filter that
changes sign from one lag to the next adds the pair with a sign that depends on where the query happens to fall.

For every BST layer of each model (built as ``research.mqar`` builds it: width, depth, W, length, vocabulary and
``--set`` overrides), this prints per layer the median over its filter channels, over lags ``--from-lag`` .. L-1
(default: the Slide receptive field ``layers x W``, where MQAR's pairs lie):

- ``flips``: the fraction of adjacent lags where the tap changes sign (white noise: ~0.5; a smooth decay: ~0);
- ``coherence``: ``|mean tap| / mean |tap|`` (1: one sign throughout; ~0: the signs cancel);
- ``far/near``: mean ``|tap|`` over those lags over mean ``|tap|`` at lags 0-7;
- ``grad SSM / rest``: on one MQAR training batch (``--pairs`` pairs, ``--batch-size`` sequences, MQAR's gap), the
  norm of the gradient of the layer's SSM parameters over the norm of the gradient of every parameter outside the
  SSMs. Training clips the norm of the whole gradient at 1: where one SSM's share dominates it, clipping shrinks
  every update by that norm, and the filter's loss surface is rough (a small change of its weights changes the taps
  a lot);
- ``pairs / spread``: how much of the layer's SSM output where a query reads it comes from the pairs' values. On
  the same batch, the value of every pair is drawn anew (keys, positions and everything else unchanged); the RMS of
  the change of the SSM output at the last token of the block before each query's block (the newest context state
  the query's block reads) over the spread of that output across queries and sequences (RMS over channels of the
  standard deviation). Near 1: the pairs' values move the state as much as everything else does; near 0: the state
  varies mostly with what lies between the pairs and the query (the filler and the other queries, at the query's
  position), and the pairs are a small part of it;
- ``position share``: the share of that spread's variance left when every sequence has the first one's pairs and no
  query slots (filler up to each query's read position): what the read position alone accounts for.

Weights are those at initialisation (seed ``--seed``: the seed MQAR's runs use), or those of an MQAR checkpoint
(``--checkpoint``, a ``<run>.ckpt.safetensors`` that ``research.mqar`` keeps while a run is in progress; its one
model must be given with the run's ``--set``).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from research import mqar


def layer_taps(module: torch.nn.Module, length: int) -> torch.Tensor:
    """Filter taps of one SSM (``S4DKernel`` or ``UnstructFilter``) over ``length`` lags: `(channels, length)`."""
    with torch.no_grad():
        taps = module.filters(length) if hasattr(module, "filters") else module.kernel(length)
    return taps.reshape(-1, length).double()


def shape_stats(taps: torch.Tensor, from_lag: int) -> dict:
    """Median over channels of ``flips``, ``coherence`` and ``far/near`` (module docstring) of ``taps``
    `(channels, L)` over lags ``from_lag`` .. L-1."""
    if not 8 <= from_lag < taps.shape[-1] - 1:
        raise ValueError(f"from_lag must be in 8 .. {taps.shape[-1] - 2} (the filter has {taps.shape[-1]} lags)")
    far, near = taps[:, from_lag:], taps[:, :8]
    flips = ((far[:, 1:] * far[:, :-1]) < 0).double().mean(-1)
    coherence = far.mean(-1).abs() / far.abs().mean(-1).clamp_min(1e-300)
    ratio = far.abs().mean(-1) / near.abs().mean(-1).clamp_min(1e-300)
    return {name: statistics.median(v.tolist()) for name, v in (("flips", flips), ("coherence", coherence),
                                                                 ("far/near", ratio))}  # fmt: skip


def layer_ssms(net) -> dict[int, torch.nn.Module]:
    """``{layer index: SSM}`` for every BST layer of ``net`` (a ``BSTForCausalLM``)."""
    out = {}
    for i, layer in enumerate(net.model.layers):
        if hasattr(layer, "context"):  # a BST layer (BSTContextLayer): its SSM kernel is ``layer.ssm``
            out[i] = layer.ssm
    return out


def model_stats(net, length: int, from_lag: int) -> list[tuple[int, dict]]:
    """``(layer index, shape_stats)`` for every BST layer of ``net`` (a ``BSTForCausalLM``)."""
    return [(i, shape_stats(layer_taps(ssm, length), from_lag)) for i, ssm in layer_ssms(net).items()]


def ssm_gradient_ratios(net, ids: torch.Tensor, labels: torch.Tensor) -> dict[int, float]:
    """``{layer index: |grad of that layer's SSM parameters| / |grad of all non-SSM parameters|}`` for one batch."""

    def sq(params) -> float:
        return sum(float(q.grad.double().pow(2).sum()) for q in params if q.grad is not None)

    net.zero_grad(set_to_none=True)
    net(ids, labels=labels).loss.backward()
    ssms = layer_ssms(net)
    in_ssm = {id(q) for ssm in ssms.values() for q in ssm.parameters()}
    rest = sq(q for q in net.parameters() if id(q) not in in_ssm)
    ratios = {i: (sq(ssm.parameters()) / rest) ** 0.5 if rest > 0 else float("inf") for i, ssm in ssms.items()}
    net.zero_grad(set_to_none=True)
    return ratios


def ssm_outputs(net, *batches: torch.Tensor) -> dict[int, list[torch.Tensor]]:
    """``{layer index: [SSM output (B, L, C * Ds) in float64 for each batch]}`` of every BST layer of ``net``."""
    ssms = layer_ssms(net)
    outputs: dict[int, list[torch.Tensor]] = {i: [] for i in ssms}
    hooks = [
        ssm.register_forward_hook(lambda _m, _in, y, i=i: outputs[i].append(y.flatten(2).double()))
        for i, ssm in ssms.items()
    ]
    try:
        with torch.no_grad():
            for ids in batches:
                net(ids)
    finally:
        for h in hooks:
            h.remove()
    return outputs


def _read_positions(net, query_pos: torch.Tensor, num_pairs: int) -> torch.Tensor:
    """The last token of the block before each query's block (the newest context state that block reads)."""
    block = net.config.block_len
    read = (query_pos // block) * block - 1
    if (read < 2 * num_pairs).any():
        raise ValueError("every query must lie at least one block after the pairs")
    return read


def _spread(at: torch.Tensor) -> torch.Tensor:
    """Variance across queries and sequences of ``at`` `(B, N, F)`, averaged over channels."""
    return at.flatten(0, 1).var(0).mean()


def pair_signal(
    net,
    ids: torch.Tensor,
    query_pos: torch.Tensor,
    num_pairs: int,
    values: tuple[int, int],
    generator: torch.Generator,
) -> dict[int, float]:
    """``{layer index: pairs / spread}`` (module docstring) of every BST layer of ``net`` on one MQAR batch
    (``ids``, ``query_pos`` from ``mqar.make_batch``); ``values`` is the range ``[first, last)`` of the value ids."""
    read = _read_positions(net, query_pos, num_pairs)
    changed = ids.clone()
    changed[:, 1 : 2 * num_pairs : 2] = torch.randint(*values, (ids.shape[0], num_pairs), generator=generator)
    rows = torch.arange(ids.shape[0])[:, None]
    ratios = {}
    for i, (y, y_changed) in ssm_outputs(net, ids, changed).items():
        at = y[rows, read]  # (B, N, F)
        signal = (y_changed[rows, read] - at).pow(2).mean().sqrt()
        spread = _spread(at).sqrt()
        ratios[i] = float(signal / spread) if spread > 0 else float("inf")
    return ratios


def position_share(net, ids: torch.Tensor, query_pos: torch.Tensor, num_pairs: int) -> dict[int, float]:
    """``{layer index: position share}`` (module docstring): the variance across queries and sequences of each BST
    layer's SSM output at the read positions when only the read position differs (the first sequence's pairs in
    every row, filler everywhere else), over its variance on the batch itself."""
    read = _read_positions(net, query_pos, num_pairs)
    bare = torch.full_like(ids, mqar.FILLER)
    bare[:, : 2 * num_pairs] = ids[0, : 2 * num_pairs]
    rows = torch.arange(ids.shape[0])[:, None]
    shares = {}
    for i, (y, y_bare) in ssm_outputs(net, ids, bare).items():
        total = _spread(y[rows, read])
        shares[i] = float(_spread(y_bare[rows, read]) / total) if total > 0 else float("nan")
    return shares


def load_weights(net, checkpoint: Path) -> None:
    """The model weights of an ``research.mqar`` checkpoint (saved under ``model.``) into ``net``."""
    from safetensors import safe_open

    from training.convert_checkpoint import current_name

    types = [net.config.layer_kind(i) for i in range(net.config.num_hidden_layers)]
    with safe_open(str(checkpoint), "pt") as f:  # names of any layout of the package, as current names
        state = {current_name(k[len("model.") :], types): f.get_tensor(k) for k in f.keys() if k.startswith("model.")}
    missing, unexpected = net.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{checkpoint} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bst = [m for m in mqar.MODELS if m.startswith("bst")]
    p.add_argument("--models", nargs="+", default=bst, choices=bst)
    p.add_argument("--length", type=int, default=256)
    mqar.add_model_arguments(p)
    p.add_argument("--from-lag", type=int, default=None, help="first lag looked at (default: layers x W)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", type=Path, default=None, help="a research.mqar run checkpoint (one model)")
    p.add_argument("--pairs", type=int, default=8, help="key-value pairs of the gradient batch")
    p.add_argument("--batch-size", type=int, default=mqar.BATCH, help="sequences of the gradient batch")
    args = p.parse_args(argv)
    try:
        overrides = mqar.parse_overrides(args.overrides)
    except ValueError as e:
        p.error(str(e))
    if args.checkpoint is not None and len(args.models) != 1:
        p.error("--checkpoint holds one model's weights: give that model alone in --models")
    from_lag = args.layers * args.block_len if args.from_lag is None else args.from_lag
    vocab = mqar.vocab_size(args.num_keys, args.num_values)
    lines = [
        f"Filters beyond lag {from_lag} (L = {args.length}; median over channels; "
        + (f"weights of {args.checkpoint})" if args.checkpoint else f"initialisation, seed {args.seed})"),
        "",
        "| model | layer | flips | coherence | far/near | grad SSM / rest | pairs / spread | position share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    # One MQAR training batch (MQAR's gap: the Slide receptive field), the same for every model.
    ids, labels, query_pos = mqar.make_batch(
        args.batch_size, args.length, args.pairs, args.layers * args.block_len, torch.Generator().manual_seed(args.seed),
        num_keys=args.num_keys, num_values=args.num_values,
    )  # fmt: skip
    for model in args.models:
        torch.manual_seed(args.seed)
        config = mqar.build_config(
            model, args.hidden, args.layers, args.block_len, args.length, vocab, overrides=overrides
        )
        net = mqar.build_model(config, model)
        if args.checkpoint is not None:
            load_weights(net, args.checkpoint)
        label = mqar.variant_label(mqar.MODELS[model][0], overrides)
        try:
            rows = model_stats(net, args.length, from_lag)
        except ValueError as e:
            p.error(str(e))
        grads = ssm_gradient_ratios(net, ids, labels)
        values = (1 + args.num_keys, 1 + args.num_keys + args.num_values)
        signal = pair_signal(net, ids, query_pos, args.pairs, values, torch.Generator().manual_seed(args.seed + 1))
        shares = position_share(net, ids, query_pos, args.pairs)
        for i, s in rows:
            lines.append(
                f"| {label} | {i} | {s['flips']:.2f} | {s['coherence']:.2f} | {s['far/near']:.3f} | {grads[i]:.3g} "
                f"| {signal[i]:.3g} | {shares[i]:.2f} |"
            )
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
