"""A Block-State Transformer layer for serving, in plain PyTorch (no vLLM import).

The tensor maths (norms, T5 buckets, the window and context mask rules, the S4D discretisation, chunked form and
recurrent step in real arithmetic, the FFT convolution and the unstruct filter's taps, the Block-Recurrent gate) is
``modeling_bst/functional_bst.py``, the file the model itself uses: it imports only torch, so it runs under the
older transformers vLLM pins, and this module loads it by its path in the repository ([`load_functional`]; the
plugin is installed editable from the repository, ``scripts/setup.sh``). What is here is the serving layout:
parameter names of ``modeling_bst`` (a saved checkpoint loads as it is), one request's chunk or a batch of decode
steps over fixed-size per-request states. Per-position parity with ``modeling_bst``'s forward is tested in the main
suite (``tests/integrations/test_vllm_layers.py``), greedy parity with ``generate()`` in the plugin's own tests.

A layer processes one request's chunk of ``T`` consecutive tokens at positions ``p0 .. p0 + T - 1`` (a whole
prompt, a piece of a chunked prefill, or one decoded token) and advances that request's state in place. Every part
of the state has a fixed size, whatever the length of the sequence ([`state_layout`]; every layer of a model
declares the same tuple, the parts of all its layer kinds, and uses its own):

* ``attn_k``, ``attn_v`` `(R, H, d_h)`: the keys/values of the last R tokens (token at position p in slot p % R;
  R = W, or 2W in a model with Block-Recurrent layers, whose state update reads the previous and current block):
  the block self-attention of a token reads exactly the W tokens before it (the W most recent with
  ``attend_self``);
* BST layers, ``ssm_kind="s4"``: ``ssm`` `(D_s, N/2, 2)` the S4D state (real and imaginary parts;
  ``mf_independent_filters``: `(S * D_s, N/2, 2)`, one S4D per MF filter); ``ssm_kind="unstruct"``: ``history``
  `(D_s, L)` the last L = ``max_position_embeddings`` SSM inputs (the filter has L taps), oldest first;
* SH / MH: ``ctx_k``, ``ctx_v`` `(W, H, d_h)`: the context keys/values of the current block's tokens (slot p % W);
* MF: ``mf_last`` `(S, D_s)`: the SSM's S read-outs at the last block end, from which the current block's context
  states come;
* Block-Recurrent layers: ``rec`` `(S_r, D)` the recurrent state before the current block and ``rec_k``, ``rec_v``
  `(S_r, H, d_h)` the keys/values the block's tokens read from it;
* GSS layers: ``gss`` `(D/4, N/2, 2)` the S4D state.

A decode step is the chunk of one token; ``BSTLayerMath.decode`` runs the steps of many requests at once. The maths
runs in the parameters' dtype (float32 when served; float64 in the parity test), the SSM in at least float32.
"""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


FUNCTIONAL = Path(__file__).resolve().parents[3] / "modeling_bst" / "functional_bst.py"
LAYER_KINDS = ("block", "bst", "recurrent", "gss")


def load_functional():
    """``modeling_bst/functional_bst.py`` of the repository this plugin is installed from, as the module
    ``bst_vllm.functional_bst`` (loaded by path: ``modeling_bst``'s package needs a newer transformers)."""
    name = "bst_vllm.functional_bst"
    if name not in sys.modules:
        if not FUNCTIONAL.is_file():
            raise ImportError(
                f"BST serving: {FUNCTIONAL} not found. The plugin uses the model's own maths file: install it from "
                "the BST repository (pip install --no-deps -e <repo>/integrations/vllm, scripts/setup.sh)."
            )
        spec = importlib.util.spec_from_file_location(name, FUNCTIONAL)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


fb = load_functional()


rms_norm = fb.rms_norm  # torch's fused rms_norm where the device has one


# S4D outputs of a prefill chunk are computed in pieces of this many tokens (the model's chunk length).
S4D_CHUNK_LEN = 64


def state_layout(config) -> dict[str, tuple[int, ...]]:
    """The per-request state tensors every layer of the model declares, by name, in order: the parts of each layer
    kind the model has (see the module docstring)."""
    kinds = set(config.bst_layer_types)
    w, heads, hd = config.block_len, config.num_attention_heads, config.head_dim
    layout = {}
    if kinds - {"gss"}:
        layout["attn_k"] = layout["attn_v"] = (ring_len(config), heads, hd)
    if "bst" in kinds:
        ds, n2 = config.ssm_channels, config.ssm_state_size // 2
        if config.ssm_kind == "unstruct":
            layout["history"] = (ds, config.max_position_embeddings)
        elif config.context_mode == "mf" and config.mf_independent_filters:
            layout["ssm"] = (config.num_context_states * ds, n2, 2)
        else:
            layout["ssm"] = (ds, n2, 2)
        if config.context_mode == "mf":
            layout["mf_last"] = (config.num_context_states, ds)
        else:
            layout["ctx_k"] = layout["ctx_v"] = (w, heads, hd)
    if "recurrent" in kinds:
        layout["rec"] = (config.num_recurrent_states, config.hidden_size)
        layout["rec_k"] = layout["rec_v"] = (config.num_recurrent_states, heads, hd)
    if "gss" in kinds:
        layout["gss"] = (config.hidden_size // 4, config.ssm_state_size // 2, 2)
    return layout


def ring_len(config) -> int:
    """R, the attention ring's slots: W, or 2W in a model with Block-Recurrent layers (their state update reads the
    previous and current block)."""
    return 2 * config.block_len if "recurrent" in config.bst_layer_types else config.block_len


def ring_positions(newest: torch.Tensor, ring: int) -> torch.Tensor:
    """The position each of the ``ring`` slots holds when the newest token written is at ``newest`` `(B,)`: slot j
    the latest position = j (mod R) up to it; negative: none yet. `(B, R)`."""
    j = torch.arange(ring, device=newest.device)
    return newest[:, None] - (newest[:, None] - j) % ring


class Decode:
    """The decode steps of one engine step: one token per request at ``positions`` `(B,)`, its state in row
    ``slots[i]`` of every state tensor. What the layers read of the positions is computed here once per step (every
    layer reads the same positions), with no host read:

    * ``write``: the token's ring slot (position mod R); ``held`` `(B, 1, 1, R)`: the ring slots that hold a token
      the query may see (all slots of a request past its first R tokens); ``sees_self``: which queries see a key
      (all but a sequence's first token without ``attend_self``; True: all);
    * ``ctx_write``: the token's context slot (position mod W), its context mask ([`context_mask`]);
    * ``fresh``: new requests (position 0; a one-token prompt is scheduled as a decode, and its slot may hold an
      earlier request's state), ``first_block`` (position < W), ``block_end`` (the token ends a block), and the
      ring slots that hold a token after the token's write, ``held_after`` `(B, R)` (Block-Recurrent)."""

    def __init__(self, positions: torch.Tensor, slots: torch.Tensor, config):
        self.positions, self.slots, self.config = positions, slots, config
        w, self.ring = config.block_len, ring_len(config)
        self.write = positions % self.ring
        newest = positions - (0 if config.attend_self else 1)
        self.held = (ring_positions(newest, self.ring) >= 0)[:, None, None]
        self.sees_self = True if config.attend_self else (positions > 0)[:, None, None, None]
        self.ctx_write = positions % w
        self.fresh = positions == 0
        self.first_block = positions < w
        self.block_end = self.ctx_write == w - 1
        self.held_after = ring_positions(positions, self.ring) >= 0
        self._context_masks = {}

    def context_mask(self, dtype: torch.dtype):
        """SH / MH: the additive mask of the decode queries over the W context slots of their block `(B, 1, 1, W)`
        (``cross_mask``) and which queries see a context key (a block's first token under the strict mask does
        not); built once per dtype."""
        if dtype not in self._context_masks:
            cross = self.config.cross_mask
            j = torch.arange(self.config.block_len, device=self.positions.device)
            mask = fb.additive_mask(fb.context_valid(j[None], self.ctx_write[:, None], cross), dtype)
            seen = True if cross == "inclusive" else (self.ctx_write > 0)[:, None, None, None]
            self._context_masks[dtype] = mask[:, None, None], seen
        return self._context_masks[dtype]


class Prefill:
    """The prefill chunks of one engine step, packed: request i's ``lengths[i]`` tokens at positions ``p0[i] ..``
    follow each other in the ``num_tokens`` packed tokens from ``starts[i]``, its state in row ``slots[i]`` of every
    state tensor. Built once per step (every layer reads it); index tensors only, no Python loop over requests.

    ``max_len`` (a host int, the longest chunk) sizes the padded layouts the layers use per request: ``by_token``
    `(P, max_len)` (token t of the chunk at column t) and the block canvas `(P, num_blocks * W)` (position p at
    column ``p - W * (p0 // W)``: the canvas's blocks are the model's blocks)."""

    def __init__(self, starts, p0, lengths, slots, num_tokens: int, max_len: int, block_len: int):
        self.starts, self.p0, self.lengths, self.slots = starts, p0, lengths, slots
        self.num_tokens, self.max_len, self.block_len = num_tokens, max_len, block_len
        self.num = starts.shape[0]
        device = starts.device
        self.rows = torch.arange(self.num, device=device)
        # The request of every packed token and the token's offset in the request's chunk.
        idx = torch.arange(num_tokens, device=device)
        self.req = torch.searchsorted(starts, idx, right=True) - 1
        self.offset = idx - starts[self.req]
        self.fresh = p0 == 0  # a new request: its slot may hold an earlier request's state
        self.first_block = torch.div(p0, block_len, rounding_mode="floor")
        first_col = p0 - self.first_block * block_len  # canvas column of each chunk's first token
        self.first_col = first_col
        self.col = first_col[self.req] + self.offset  # canvas column of every packed token
        self.last = p0 + lengths - 1  # position of each chunk's last token
        self.num_blocks = -(-(block_len - 1 + max_len) // block_len)  # canvas blocks (enough for every chunk)
        self._row_cache = {}

    @classmethod
    def from_query_starts(cls, query_start_loc, positions, slots, block_len: int):
        """From vLLM's ``query_start_loc`` `(P + 1,)` (packed offsets from 0), the packed tokens' ``positions`` and
        the requests' state ``slots``. ``max_len`` is read from ``query_start_loc`` (a host read; on the CPU the
        tensor is a host tensor)."""
        starts = query_start_loc[:-1]
        lengths = query_start_loc[1:] - starts
        return cls(starts, positions[starts], lengths, slots, positions.shape[0], int(lengths.max()), block_len)

    @classmethod
    def groups(cls, query_start_loc, positions, slots, block_len: int, padding: float = 1.25):
        """The step's chunks in runs of consecutive requests whose padded layouts waste little: a run grows while
        its requests times its longest chunk stays within ``padding`` times its tokens (chunks of equal length:
        one run; a long chunk beside short ones: separate runs). ``[(first token, end token, Prefill), ...]``. Reads
        the chunk lengths on the host (``query_start_loc`` is a host tensor on the CPU)."""
        bounds = query_start_loc.tolist()
        lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        runs, first = [], 0
        for i in range(1, len(lengths)):
            run = lengths[first : i + 1]
            if max(run) * len(run) > padding * sum(run):  # request i starts a new run
                runs.append((first, i))
                first = i
        runs.append((first, len(lengths)))
        out = []
        for a, b in runs:
            starts = query_start_loc[a : b + 1] - bounds[a]
            tokens = positions[bounds[a] : bounds[b]]
            out.append((bounds[a], bounds[b], cls.from_query_starts(starts, tokens, slots[a:b], block_len)))
        return out

    def _rows(self, layout) -> torch.Tensor:
        """The row of every packed token in ``layout`` flattened `(P * width,)`: "token" ([`by_token`]), "left"
        ([`left_aligned`]) or ("canvas", before) ([`canvas`]); computed once per step."""
        if layout not in self._row_cache:
            if layout == "token":
                cols = self.offset
            elif layout == "left":
                cols = self.max_len - self.lengths[self.req] + self.offset
            else:
                cols = layout[1] + self.col
            self._row_cache[layout] = self.req * self._width(layout) + cols
        return self._row_cache[layout]

    def _width(self, layout) -> int:
        return self.max_len if layout in ("token", "left") else layout[1] + self.num_blocks * self.block_len

    def _lay_out(self, x: torch.Tensor, layout) -> torch.Tensor:
        """Packed ``x`` `(N, ...)` -> `(P, width, ...)` in ``layout``, zeros where no token is: one row gather from
        ``x`` (a gather of whole rows is several times faster than the scatter on the CPU), then the rows without a
        token zeroed."""
        key = ("source", layout)
        if key not in self._row_cache:
            rows = self._rows(layout)
            source = torch.zeros(self.num * self._width(layout), dtype=torch.long, device=x.device)
            source[rows] = torch.arange(self.num_tokens, device=x.device)
            empty = torch.ones_like(source, dtype=torch.bool).index_fill_(0, rows, False)
            self._row_cache[key] = source, empty.nonzero().squeeze(1)
        source, empty = self._row_cache[key]
        return x.index_select(0, source).index_fill_(0, empty, 0).view(self.num, -1, *x.shape[1:])

    def by_token(self, x: torch.Tensor) -> torch.Tensor:
        """Packed ``x`` `(N, ...)` -> `(P, max_len, ...)`, token t of request i at ``[i, t]``, zeros after."""
        return self._lay_out(x, "token")

    def left_aligned(self, x: torch.Tensor) -> torch.Tensor:
        """Packed ``x`` `(N, ...)` -> `(P, max_len, ...)`, each chunk ending at the last column, zeros before."""
        return self._lay_out(x, "left")

    def canvas(self, x: torch.Tensor, before: int = 0) -> torch.Tensor:
        """Packed ``x`` `(N, ...)` -> the block canvas `(P, before + num_blocks * W, ...)`, token at ``before +
        col``, zeros elsewhere."""
        return self._lay_out(x, ("canvas", before))

    def tokens(self, y: torch.Tensor, layout="token") -> torch.Tensor:
        """The packed tokens `(N, ...)` of ``y`` `(P, width, ...)` in ``layout`` ("token": [`by_token`]'s,
        ("canvas", 0): [`canvas`]'s)."""
        return y.reshape(-1, *y.shape[2:]).index_select(0, self._rows(layout))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, seen=None) -> torch.Tensor:
    """Softmax attention with an additive ``mask`` and no further scaling (queries carry the learned scale), by torch's
    fused ``scaled_dot_product_attention`` (on the CPU a flash kernel: no score tensor is written; the keys and
    values may be strided views).

    ``q`` `(..., H, Tq, d)`, ``k``/``v`` `(..., H, Tk, d)` with the same leading dimensions, ``mask`` (finite large
    negative where masked; None: every key) `(..., H or 1, Tq, Tk)` with those leading dimensions or none (one mask
    for all) -> `(..., H, Tq, d)`. A query that sees no key gets zeros: ``seen`` (broadcastable to the output, True
    where a query sees a key; True: all do) says which do, read from the mask when not given."""
    if seen is None and mask is not None:
        seen = (mask > fb.masked_fill_value(mask.dtype)).any(-1, keepdim=True)
    seen = None if seen is True else seen
    if mask is not None and mask.dim() in (3, 5):  # 4-D (or 2-D): the shapes torch's CPU flash kernel takes
        mask = mask.reshape(-1, *mask.shape[-3:])
    if q.dim() == 4:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
    else:
        q4, k4, v4 = (t.reshape(-1, *t.shape[-3:]) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, scale=1.0).view(q.shape)
    return out if seen is None else out * seen


def compute_dtype(param: torch.Tensor) -> torch.dtype:
    """SSM maths in float32, float64 for a float64 model."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


class S4D:
    """The S4D maths of one layer's SSM parameters (``log_dt``, ``A_log_real``, ``A_imag``, ``B``, ``C``, ``D``),
    with what depends only on them computed once (serving never changes the parameters): the chunked form's tables
    per number of chunks and the step constants. States are real `(..., D_s, N/2, 2)`."""

    def __init__(self, ssm: nn.Module):
        self.params = ssm.log_dt, ssm.A_log_real, ssm.A_imag, ssm.B, ssm.C, ssm.D
        self.dtype = compute_dtype(ssm.log_dt)
        self.discrete = fb.s4d_discretize(*self.params[:4], self.dtype)
        self.step_pairs = fb.s4d_step_constants(*self.params, self.dtype)
        self._tables = {}

    def tables(self, chunk: int, num_chunks: int):
        key = (chunk, num_chunks)
        if key not in self._tables:
            groups, _ = fb.chunk_groups(num_chunks)
            exps, mask, offsets = fb.chunk_exponents_layout(chunk, groups, True)
            exps = torch.tensor([exps, mask], dtype=self.dtype, device=self.params[0].device)
            self._tables[key] = fb.s4d_chunk_tables(self.params, exps, offsets, chunk, num_chunks)
        return self._tables[key]

    def scan(self, z: torch.Tensor, state: torch.Tensor, p0: int = 0):
        """Outputs ``y`` `(T, C, Ds)` for the inputs ``z`` `(T, Ds)` from ``state`` `(Ds, N2, 2)`, and the state
        after the last input."""
        z = z.to(self.dtype)[None]
        chunk = min(S4D_CHUNK_LEN, z.shape[1])
        tables = self.tables(chunk, -(-z.shape[1] // chunk))
        y = fb.s4d_chunked_forward(z, chunk, tables, state[None])
        return y[0], fb.s4d_final_state(z, *self.discrete, state[None])[0]

    def scan_packed(self, z: torch.Tensor, state: torch.Tensor, batch: Prefill):
        """The chunks of many requests: ``z`` `(N, Ds)` packed as in ``batch``, ``state`` `(P, Ds, N2, 2)` the
        requests' states -> ``y`` `(N, C, Ds)` and the states after each chunk. The outputs come from one chunked
        form over the chunks padded at their ends (zeros after a chunk change none of its outputs); the end states
        from the zero-state end state of the chunks aligned at their ends (zeros before a chunk add nothing) plus
        each entering state carried over its chunk, ``Abar^T x0``."""
        z, state = z.to(self.dtype), state.to(self.dtype)
        padded = batch.by_token(z)  # (P, max_len, Ds)
        chunk = min(S4D_CHUNK_LEN, batch.max_len)
        y = fb.s4d_chunked_forward(padded, chunk, self.tables(chunk, -(-batch.max_len // chunk)), state)
        dt_a, b_bar = self.discrete
        final = fb.s4d_final_state(batch.left_aligned(z), dt_a, b_bar)  # (P, Ds, N2, 2)
        decay = fb.pair_powers(dt_a, batch.lengths)  # (Ds, N2, P)
        carried = fb.pair_mul((decay[0].permute(2, 0, 1), decay[1].permute(2, 0, 1)), state.unbind(-1))
        return batch.tokens(y), final + torch.stack(carried, -1)

    def step(self, z: torch.Tensor, state: torch.Tensor):
        """One token of many requests: ``z`` `(B, Ds)`, ``state`` `(B, Ds, N2, 2)` -> ``y`` `(B, C, Ds)` and the new
        state ([`fb.s4d_step`] on the pairs as they are stored)."""
        return fb.s4d_step(z.to(self.dtype), state.to(self.dtype), self.step_pairs)


class PerFilterS4D:
    """MF with ``mf_independent_filters``: one S4D per filter, as ``modeling_bst``'s ``PerFilterS4D`` holds them (one
    S4D over S * Ds channels, ``ssm.kernel``, every filter reading the same input): outputs `(..., S, Ds)`."""

    def __init__(self, kernel: nn.Module, filters: int):
        self.inner, self.filters = S4D(kernel), filters

    def _split(self, y):
        return y[..., 0, :].unflatten(-1, (self.filters, -1))  # (..., 1, S * Ds) -> (..., S, Ds), filter-major

    def scan(self, z, state, p0: int = 0):
        y, state = self.inner.scan(z.repeat(1, self.filters), state)
        return self._split(y), state

    def scan_packed(self, z, state, batch: Prefill):
        y, state = self.inner.scan_packed(z.repeat(1, self.filters), state, batch)
        return self._split(y), state

    def step(self, z, state):
        y, state = self.inner.step(z.repeat(1, self.filters), state)
        return self._split(y), state


class Unstruct:
    """The Hyena-style filter of ``ssm_kind="unstruct"`` (``modeling_bst``'s ``UnstructFilter``): its L =
    ``max_position_embeddings`` taps (bias folded into lag 0) computed once, ``y_t = sum_{j < L} h_j z_{t-j}``. The
    state is the input history `(Ds, L)`, oldest first (zeros before the sequence): the filter has no taps beyond
    lag L - 1, so the last L inputs are all a step needs."""

    def __init__(self, ssm: nn.Module, config):
        self.dtype = compute_dtype(ssm.pos_emb)
        self.max_len = config.max_position_embeddings
        decay = (config.unstruct_decay_target, config.unstruct_decay_fast, config.unstruct_decay_slow)
        taps = fb.unstruct_filters(
            ssm.pos_emb[0].to(self.dtype),
            list(ssm.mlp),
            ssm.out,
            ssm.sin.freq,
            self.max_len,
            decay,
            config.ssm_output_channels,
            config.ssm_channels,
        )[0]
        self.taps = fb.fold_skip(taps, ssm.bias.to(self.dtype))  # (C, Ds, L), lag order
        self.reversed = self.taps.flip(-1)  # lag L - 1 - j at j, as the history is laid out

    def scan(self, z: torch.Tensor, history: torch.Tensor, p0: int = 0):
        """Outputs `(T, C, Ds)` of ``z`` `(T, Ds)` after the history `(Ds, L)` of a request at ``p0``, by one FFT
        convolution over the earlier inputs that reach the chunk and the chunk; and the new history."""
        z = z.to(self.dtype).t()  # (Ds, T)
        n_prev = min(p0, self.max_len - 1)  # earlier inputs within reach of the chunk's first token
        u = torch.cat([history[:, self.max_len - n_prev :].to(self.dtype), z], -1)  # (Ds, n)
        n = u.shape[-1]
        k = F.pad(self.taps[..., : min(n, self.max_len)], (0, max(0, n - self.max_len)))
        y = fb.spectrum_conv(u[None], fb.causal_spectrum(k))[0, ..., n_prev:]  # (C, Ds, T)
        return y.permute(2, 0, 1), torch.cat([history.to(self.dtype), z[:, -self.max_len :]], -1)[:, -self.max_len :]

    def scan_packed(self, z: torch.Tensor, history: torch.Tensor, batch: Prefill):
        """The chunks of many requests: ``z`` `(N, Ds)` packed as in ``batch``, ``history`` `(P, Ds, L)` ->
        `(N, C, Ds)` and the new histories, by one FFT convolution of [history ; chunk] per request (the history
        holds zeros before a sequence's start, and the filter has L taps: it is all a chunk reaches)."""
        length = self.max_len
        u = torch.cat([history.to(self.dtype), batch.by_token(z.to(self.dtype)).transpose(1, 2)], -1)  # (P, Ds, n)
        k = F.pad(self.taps, (0, u.shape[-1] - length))
        y = fb.spectrum_conv(u, fb.causal_spectrum(k))[..., length:]  # (P, C, Ds, max_len)
        keep = (batch.lengths[:, None] + torch.arange(length, device=u.device))[:, None].expand(-1, u.shape[1], -1)
        return batch.tokens(y.permute(0, 3, 1, 2)), u.gather(-1, keep)

    def step(self, z: torch.Tensor, history: torch.Tensor):
        """One token of many requests: ``z`` `(B, Ds)`, ``history`` `(B, Ds, L)` -> `(B, C, Ds)` and the history
        with ``z`` appended (the oldest input dropped)."""
        history = torch.cat([history[..., 1:].to(self.dtype), z.to(self.dtype)[..., None]], -1)
        return torch.einsum("bsl,csl->bcs", history, self.reversed), history


class BSTLayerMath(nn.Module):
    """One decoder layer of a BST model (``kind``): a block ("Slide") layer; a BST layer with an S4D (one state, or
    one per MF filter) or unstruct SSM and SH / MH / MF context states; a Block-Recurrent layer; or a GSS layer.
    Parameters are named as in ``modeling_bst`` (``self_attn``, ``o_proj``, ``mlp``, ``ssm``, ``context``,
    ``cross_attn``, ``recurrent``, the GSS projections, the norms). ``kind`` True / False reads as "bst" / "block"."""

    def __init__(self, config, kind):
        super().__init__()
        kind = {True: "bst", False: "block"}.get(kind, kind) if isinstance(kind, bool) else kind
        if kind not in LAYER_KINDS:
            raise ValueError(f"BST serving: unknown layer kind {kind!r}.")
        self.config = config
        self.kind = kind
        self.is_bst = kind == "bst"
        d, heads, hd = config.hidden_size, config.num_attention_heads, config.head_dim
        self.heads, self.head_dim, self.block_len = heads, hd, config.block_len
        self.eps = config.rms_norm_eps
        self.index = {name: i for i, name in enumerate(state_layout(config))}
        self.input_norm = _Norm(d)
        self.mode = config.context_mode
        self._constants = None
        self._decode_bias = None
        self._canvas_bias = None
        self._mf_initial = None
        self._stacked = None
        if kind == "gss":
            ds, width = d // 4, config.gss_expansion * d
            self.u_proj = nn.Linear(d, ds, bias=False)
            self.v_proj = nn.Linear(d, width, bias=False)
            self.ssm = _s4d_parameters(ds, 1, config.ssm_state_size)
            self.y_proj = nn.Linear(ds, width, bias=False)
            self.o_proj = nn.Linear(width, d, bias=False)
            return
        self.post_attention_norm = _Norm(d)
        self.self_attn = _Module(
            q_proj=nn.Linear(d, heads * hd, bias=False),
            k_proj=nn.Linear(d, heads * hd, bias=False),
            v_proj=nn.Linear(d, heads * hd, bias=False),
            relative_bias=nn.Embedding(config.relative_attention_num_buckets, heads),
        )
        self.self_attn.scale = nn.Parameter(torch.ones(heads))
        self.o_proj = nn.Linear(heads * hd * (1 if kind == "block" else 2), d, bias=False)
        self.mlp = _Module(
            up_proj=nn.Linear(d, config.intermediate_size, bias=False),
            down_proj=nn.Linear(config.intermediate_size, d, bias=False),
        )
        if kind != "block":
            self.cross_attn = _Module(q_proj=nn.Linear(d, heads * hd, bias=False))
            self.cross_attn.scale = nn.Parameter(torch.ones(heads))
        if kind == "recurrent":
            s = config.num_recurrent_states
            self.recurrent = _Module(
                norm=_Norm(d),
                q_proj=nn.Linear(d, heads * hd, bias=False),
                k_proj=nn.Linear(d, heads * hd, bias=False),
                v_proj=nn.Linear(d, heads * hd, bias=False),
                q2_proj=nn.Linear(d, heads * hd, bias=False),
                o_proj=nn.Linear(2 * heads * hd, d, bias=False),
            )
            for name, shape in (
                ("initial_state", (s, d)),
                ("state_pos", (s, d)),
                ("self_scale", (heads,)),
                ("cross_scale", (heads,)),
                ("gate_bias", (d,)),
            ):
                self.recurrent.register_parameter(name, nn.Parameter(torch.zeros(shape)))
        if kind == "bst":
            ds = config.ssm_channels
            outs = config.ssm_output_channels
            if config.ssm_kind == "unstruct":
                self.ssm = _unstruct_parameters(config, ds, outs)
            elif self.mode == "mf" and config.mf_independent_filters:
                self.ssm = _Module(kernel=_s4d_parameters(outs * ds, 1, config.ssm_state_size))
            else:
                self.ssm = _s4d_parameters(ds, outs, config.ssm_state_size)
            self.context = _Module(down_proj=nn.Linear(d, ds, bias=False), norm=_Norm(d))
            s = config.num_context_states
            if self.mode == "sh":
                self.context.up_proj = nn.Linear(ds, d, bias=False)
                self.context.k_proj = nn.Linear(d, heads * hd, bias=False)
                self.context.v_proj = nn.Linear(d, heads * hd, bias=False)
            elif self.mode == "mh":
                self.context.up_proj = nn.Parameter(torch.zeros(heads, ds, d))
                self.context.k_proj = nn.Parameter(torch.zeros(heads, d, hd))
                self.context.v_proj = nn.Parameter(torch.zeros(heads, d, hd))
            else:
                self.context.up_proj = nn.Parameter(torch.zeros(s, ds, d))
                self.context.context_ids = nn.Parameter(torch.zeros(s, d))
                width = d if config.mf_initial_context == "lifted" else ds
                self.context.initial_context = nn.Parameter(torch.zeros(s, width))
                self.context.k_proj = nn.Linear(d, heads * hd, bias=False)
                self.context.v_proj = nn.Linear(d, heads * hd, bias=False)

    # -- state layout ---------------------------------------------------------------------------------------------
    @staticmethod
    def state_shapes(config) -> tuple[tuple[int, ...], ...]:
        """The per-request state tensors of every layer of the model, in the order of [`forward_chunk`]'s
        ``state`` ([`state_layout`])."""
        return tuple(state_layout(config).values())

    def part(self, state, name: str) -> torch.Tensor:
        """The state tensor ``name`` of [`state_layout`] in ``state``."""
        return state[self.index[name]]

    def ssm_math(self):
        """The SSM's maths, its constants computed once (serving never changes the parameters): [`S4D`],
        [`PerFilterS4D`] or [`Unstruct`]."""
        if self._constants is None:
            cfg = self.config
            if self.kind == "gss":
                self._constants = S4D(self.ssm)
            elif cfg.ssm_kind == "unstruct":
                self._constants = Unstruct(self.ssm, cfg)
            elif self.mode == "mf" and cfg.mf_independent_filters:
                self._constants = PerFilterS4D(self.ssm.kernel, cfg.num_context_states)
            else:
                self._constants = S4D(self.ssm)
        return self._constants

    def ssm_state(self, state) -> torch.Tensor:
        if self.kind == "gss":
            return self.part(state, "gss")
        return self.part(state, "history" if self.config.ssm_kind == "unstruct" else "ssm")

    # -- pieces ---------------------------------------------------------------------------------------------------
    def _heads(self, x):
        return x.unflatten(-1, (self.heads, self.head_dim))

    def _input_weight(self) -> torch.Tensor:
        """The projections of the normed input stacked (queries, keys, values; the cross-attention queries of BST
        and Block-Recurrent layers): one matmul instead of three or four. Rebuilt when a weight changes."""
        weights = [self.self_attn.q_proj.weight, self.self_attn.k_proj.weight, self.self_attn.v_proj.weight]
        if self.kind != "block":
            weights.append(self.cross_attn.q_proj.weight)
        key = tuple((w.data_ptr(), w._version, w.dtype) for w in weights)
        if self._stacked is None or self._stacked[0] != key:
            self._stacked = key, torch.cat([w.detach() for w in weights])
        return self._stacked[1]

    def project(self, xn):
        """Self-attention queries (scaled), keys, values `(..., H, d_h)`, and the cross-attention queries (None in a
        block layer), from one matmul."""
        a = self.self_attn
        parts = F.linear(xn, self._input_weight()).unflatten(-1, (-1, self.heads, self.head_dim)).unbind(-3)
        q, k, v = parts[:3]
        if self.config.qk_norm:
            q, k = fb.l2_normalize(q), fb.l2_normalize(k)
        qc = self._scale_cross_query(parts[3]) if len(parts) > 3 else None
        return q * a.scale[:, None], k, v, qc

    def _scale_cross_query(self, q):
        if self.config.qk_norm:
            q = fb.l2_normalize(q)
        return q * self.cross_attn.scale[:, None]

    def cross_query(self, xn):
        return self._scale_cross_query(self._heads(self.cross_attn.q_proj(xn)))

    def self_bias(self, rel):
        """Scaled T5 bias where the window lets a query see a key, a large negative number elsewhere: `(H, ...)`."""
        cfg = self.config
        bucket = fb.t5_relative_bucket(
            rel, False, cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance
        )
        bias = self.self_attn.relative_bias(bucket) * self.self_attn.scale  # (..., H)
        valid = fb.window_valid(rel, self.block_len, cfg.attend_self)
        bias = torch.where(valid[..., None], bias, fb.masked_fill_value(bias.dtype))
        return bias.movedim(-1, 0)

    def lift_tokens(self, y):
        """SH / MH: SSM outputs ``y`` `(T, C, Ds)` -> context keys, values `(T, H, d_h)`."""
        ctx = self.context
        if self.mode == "sh":
            c = rms_norm(ctx.up_proj(y[:, 0].to(ctx.up_proj.weight.dtype)), ctx.norm.weight, self.eps)
            k, v = self._heads(ctx.k_proj(c)), self._heads(ctx.v_proj(c))
        else:
            y = y.to(ctx.up_proj.dtype)
            c = rms_norm(torch.einsum("ths,hsd->thd", y, ctx.up_proj), ctx.norm.weight, self.eps)  # (T, H, D)
            k = torch.einsum("thd,hde->the", c, ctx.k_proj)
            v = torch.einsum("thd,hde->the", c, ctx.v_proj)
        return (fb.l2_normalize(k) if self.config.qk_norm else k), v

    def mf_context(self, y_prev):
        """MF: context keys, values `(..., S, H, d_h)` of a block from the previous block's last SSM outputs
        ``y_prev`` `(..., S, Ds)`; None: the first block (the learned initial context)."""
        ctx, cfg = self.context, self.config
        if y_prev is None and cfg.mf_initial_context == "lifted":
            c = ctx.initial_context
        else:
            y_prev = ctx.initial_context if y_prev is None else y_prev
            c = torch.einsum("...sc,scd->...sd", y_prev.to(ctx.up_proj.dtype), ctx.up_proj)
        if cfg.mf_context_ids_after_norm:
            c = rms_norm(c, ctx.norm.weight, self.eps) + ctx.context_ids
        else:
            c = rms_norm(c + ctx.context_ids, ctx.norm.weight, self.eps)
        k, v = self._heads(ctx.k_proj(c)), self._heads(ctx.v_proj(c))
        return (fb.l2_normalize(k) if cfg.qk_norm else k), v

    def mf_initial(self):
        """MF: the first block's context keys, values `(S, H, d_h)` ([`mf_context`] of None), computed once."""
        if self._mf_initial is None:
            self._mf_initial = self.mf_context(None)
        return self._mf_initial

    def recurrent_keys_values(self, rec):
        """Block-Recurrent: the keys, values `(..., S_r, H, d_h)` the tokens read from the state ``rec``
        `(..., S_r, D)`."""
        r = self.recurrent
        sn = rms_norm(rec, r.norm.weight, self.eps) + r.state_pos
        k = self._heads(r.k_proj(sn))
        return (fb.l2_normalize(k) if self.config.qk_norm else k), self._heads(r.v_proj(sn))

    def recurrent_update(self, rec, rec_kv, token_k, token_v, valid):
        """Block-Recurrent: the state after a block, ``rec`` `(B, S_r, D)` with its keys/values ``rec_kv``, from the
        previous and current block's token keys/values `(B, 2W, H, d_h)` (``valid`` `(B, 2W)`: the positions that
        exist): the state attends to itself and to the tokens, one projection, the fixed gate."""
        r = self.recurrent
        sn = rms_norm(rec, r.norm.weight, self.eps) + r.state_pos
        q, q2 = self._heads(r.q_proj(sn)), self._heads(r.q2_proj(sn))
        if self.config.qk_norm:
            q, q2 = fb.l2_normalize(q), fb.l2_normalize(q2)
        q, q2 = q * r.self_scale[:, None], q2 * r.cross_scale[:, None]
        k, v = rec_kv
        r_self = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B, H, S_r, d)
        mask = fb.additive_mask(valid, q2.dtype)[:, None, None, :]
        r_cross = attend(q2.transpose(1, 2), token_k.transpose(1, 2), token_v.transpose(1, 2), mask)
        z = r.o_proj(torch.cat([r_self.transpose(1, 2).flatten(2), r_cross.transpose(1, 2).flatten(2)], -1))
        return fb.gated_state_update(rec, z, r.gate_bias)

    def finish(self, x, a_self, a_second):
        """Concatenation of the attention outputs, output projection and residual, then MLP and residual."""
        a = a_self if a_second is None else torch.cat([a_self, a_second], -1)
        h = x + self.o_proj(a)
        m = self.post_attention_norm.weight
        return h + self.mlp.down_proj(F.relu(self.mlp.up_proj(rms_norm(h, m, self.eps))))

    def gss(self, x, xn, y_of):
        """GSS: ``x + ((SSM(gelu(x_n W_u)) W_y) * gelu(x_n W_v)) W_o``; ``y_of(u)`` runs the SSM."""
        u, v = F.gelu(self.u_proj(xn)), F.gelu(self.v_proj(xn))
        y = y_of(u)[..., 0, :]
        return x + self.o_proj(self.y_proj(y.to(v.dtype)) * v)

    # -- the prefill chunks of many requests --------------------------------------------------------------------
    def prefill(self, x: torch.Tensor, batch: Prefill, state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``x`` `(N, D)`: the layer input of the packed chunks of ``batch``; ``state``: the state tensors of all
        slots `(num_slots, ...)`, the rows ``batch.slots`` read and advanced (a new request's from zeros). The
        projections and MLP run over all tokens at once, the block self-attention and SH / MH / MF context
        attention over the requests' blocks at once (the block canvas of [`Prefill`]), the SSM over the padded
        chunks. Block-Recurrent layers run request by request ([`forward_chunk`]: their state changes block by
        block). Returns `(N, D)`."""
        if self.kind == "recurrent":
            return self._prefill_per_request(x, batch, state)
        xn = rms_norm(x, self.input_norm.weight, self.eps)
        if self.kind == "gss":
            return self.gss(x, xn, lambda u: self._ssm_packed(u, batch, state))
        return self.finish(x, *self.prefill_mix(x, xn, *self.project(xn), batch, state))

    def prefill_mix(self, x, xn, q, k, v, qc, batch: Prefill, state):
        """The stateful part of [`prefill`] in a block or BST layer: the block self-attention and the context
        attention (None in a block layer) of the packed tokens from their input ``x``, normed input ``xn`` and
        projections ``q``, ``k``, ``v``, ``qc`` `(N, H, d_h)`; the state advanced. Returns the two attention
        outputs `(N, H d_h)`."""
        a_self = self._self_attention_packed(q, k, v, batch, state).flatten(1)
        a_second = self._context_packed(x, xn, qc, batch, state) if self.kind == "bst" else None
        return a_self, a_second

    def _prefill_per_request(self, x, batch: Prefill, state):
        out = torch.empty_like(x)
        starts, p0s, lengths, slots = (t.tolist() for t in (batch.starts, batch.p0, batch.lengths, batch.slots))
        for s, p0, n, slot in zip(starts, p0s, lengths, slots):
            request_state = tuple(t[slot] for t in state)
            if p0 == 0:
                for t in request_state:
                    t.zero_()
            out[s : s + n] = self.forward_chunk(x[s : s + n], p0, request_state)
        return out

    def _gather_fresh(self, all_slots: torch.Tensor, batch: Prefill) -> torch.Tensor:
        """Rows ``batch.slots`` of a state tensor, zeros for new requests."""
        rows = all_slots.index_select(0, batch.slots)
        return torch.where(batch.fresh.view(-1, *[1] * (rows.dim() - 1)), 0, rows)

    def _ssm_packed(self, z, batch: Prefill, state):
        """The SSM over the packed chunks: `(N, C, Ds)`; the requests' SSM states advanced."""
        all_states = self.ssm_state(state)
        y, new_state = self.ssm_math().scan_packed(z, self._gather_fresh(all_states, batch), batch)
        all_states.index_copy_(0, batch.slots, new_state.to(all_states.dtype))
        return y

    def _self_attention_packed(self, q, k, v, batch: Prefill, state):
        """Block self-attention of the packed chunks, block by block of the canvas at once: the queries of a block
        see the keys of that block and the one before (from the ring before the chunk's first token), through one
        relative-position bias shared by all blocks. `(N, H, d)`; the rings advanced."""
        w, rows, slots = self.block_len, batch.rows[:, None], batch.slots
        attn_k, attn_v = self.part(state, "attn_k"), self.part(state, "attn_v")
        ring = attn_k.shape[1]  # W, or 2W with Block-Recurrent layers
        old_k, old_v = attn_k.index_select(0, slots), attn_v.index_select(0, slots)  # (P, R, H, d)
        # Key canvas: one block (the W positions before the chunk's first block) + the query canvas; the ring's
        # tokens at positions p0 - W .. p0 - 1 sit at columns first_col .. first_col + W - 1.
        j = torch.arange(w, device=q.device)
        ring_pos = batch.p0[:, None] - w + j  # (P, W)
        exists = (ring_pos >= 0)[..., None, None]
        keys, values = batch.canvas(k, before=w), batch.canvas(v, before=w)  # (P, W + Lq, H, d)
        cols = batch.first_col[:, None] + j
        keys[rows, cols] = torch.where(exists, old_k[rows, ring_pos % ring], 0)
        values[rows, cols] = torch.where(exists, old_v[rows, ring_pos % ring], 0)
        # Queries in sub-blocks of S = W / g tokens: sub-block u (canvas columns u S ..) sees the W + S key columns
        # from u S (a query sees at most W keys before it, or W up to itself): the W + S keys of the window, against
        # 2W for a whole block's queries, through one relative-position bias shared by all sub-blocks.
        sub, g = self.canvas_sub_block()
        n = batch.num_blocks * g
        queries = batch.canvas(q).view(batch.num, n, sub, *q.shape[1:]).transpose(2, 3)  # (P, n, H, S, d)
        keys = keys.unfold(1, w + sub, sub).transpose(-1, -2)  # (P, n, H, W + S, d)
        values = values.unfold(1, w + sub, sub).transpose(-1, -2)
        # The first block's g sub-blocks of a new request's chunk (its first block is the sequence's) mask the keys
        # before the sequence (their own masks, P g sub-blocks); every other sub-block shares one mask.
        bias, first_bias, seen, first_seen = self.canvas_bias()
        new = (batch.first_block == 0)[:, None, None, None, None]  # (P, 1, 1, 1, 1)
        first = torch.where(new, first_bias, bias)  # (P, g, H, S, W + S)
        first_seen = True if first_seen is True else torch.where(new, first_seen, seen)
        out = torch.cat(
            [
                attend(queries[:, :g], keys[:, :g], values[:, :g], first, first_seen),
                attend(queries[:, g:], keys[:, g:], values[:, g:], bias, seen),
            ],
            1,
        )  # (P, n, H, S, d)
        out = batch.tokens(out.transpose(2, 3).reshape(batch.num, -1, *q.shape[1:]), ("canvas", 0))
        # The ring keeps the last R tokens: slot s holds the latest position = s (mod R) up to the chunk's end.
        s = torch.arange(ring, device=q.device)
        last = batch.last[:, None]
        pos = last - (last - s) % ring  # (P, R)
        new = (pos >= batch.p0[:, None])[..., None, None]
        take = (batch.starts[:, None] + pos - batch.p0[:, None]).clamp(0, k.shape[0] - 1)
        attn_k.index_copy_(0, slots, torch.where(new, k[take], old_k))
        attn_v.index_copy_(0, slots, torch.where(new, v[take], old_v))
        return out

    def canvas_sub_block(self) -> tuple[int, int]:
        """The prefill canvas's query sub-blocks: ``(S, g)``, g = 4 sub-blocks of S = W / 4 tokens per block (one
        when 4 does not divide W)."""
        g = 4 if self.block_len % 4 == 0 else 1
        return self.block_len // g, g

    def canvas_bias(self):
        """The prefill canvas's self-attention masks ([`canvas_sub_block`]), computed once (serving never changes the
        weights): the scaled T5 bias of a sub-block's S queries over its W + S keys `(H, S, W + S)` (key c at
        relative position c - W - query r), the g masks of the first block's sub-blocks in a sequence's first block
        (keys before the sequence masked) `(g, H, S, W + S)`, and which queries see a key under each (True: all)."""
        if self._canvas_bias is None:
            (sub, g), w, device = self.canvas_sub_block(), self.block_len, self.self_attn.scale.device
            r, c = torch.arange(sub, device=device), torch.arange(w + sub, device=device)
            bias = self.self_bias(c[None] - w - r[:, None])
            # Sub-block u of block 0: key c is at position u S + c - W.
            before = (torch.arange(g, device=device)[:, None] * sub + c < w)[:, None, None]  # (g, 1, 1, W + S)
            first = torch.where(before, fb.masked_fill_value(bias.dtype), bias)
            seen = [(m > fb.masked_fill_value(m.dtype)).any(-1, keepdim=True) for m in (bias, first)]
            self._canvas_bias = bias, first, *(True if bool(s.all()) else s for s in seen)
        return self._canvas_bias

    def _context_packed(self, x, xn, qc, batch: Prefill, state):
        """The SSM, context states and cross-attention of a BST layer over the packed chunks: `(N, H d_h)`."""
        w, cfg, nb, rows, slots = self.block_len, self.config, batch.num_blocks, batch.rows, batch.slots
        z = self.context.down_proj(x if cfg.ssm_input == "raw" else xn)  # (N, Ds)
        y = self._ssm_packed(z, batch, state)  # (N, C, Ds)
        queries = batch.canvas(qc).view(batch.num, nb, w, *qc.shape[1:]).transpose(2, 3)  # (P, nb, H, W, d)
        if self.mode == "mf":
            mf_last = self.part(state, "mf_last")
            last = mf_last.index_select(0, slots)  # (P, S, Ds)
            ys = batch.canvas(y)  # (P, Lq, S, Ds)
            # Block m's context comes from the SSM outputs at the end of block m - 1: for m = 0 the saved read-outs
            # (the chunk starts inside or at that block), the learned initial context in a sequence's first block.
            prev = torch.cat([last[:, None].to(ys.dtype), ys[:, w - 1 : nb * w - 1 : w]], 1)  # (P, nb, S, Ds)
            ck, cv = self.mf_context(prev)  # (P, nb, S, H, d)
            k0, v0 = self.mf_initial()
            first = (batch.first_block == 0)[:, None] & (torch.arange(nb, device=x.device) == 0)  # (P, nb)
            first = first[..., None, None, None]
            ck, cv = torch.where(first, k0, ck), torch.where(first, v0, cv)
            out = attend(queries, ck.permute(0, 1, 3, 2, 4), cv.permute(0, 1, 3, 2, 4))  # (P, nb, H, W, d)
            # The read-outs at the chunk's last block end, if it has one.
            end = torch.div(batch.last + 1, w, rounding_mode="floor") * w - 1
            at_end = ys[batch.rows, (end - batch.first_block * w).clamp(min=0)]
            mf_last.index_copy_(0, slots, torch.where((end >= batch.p0)[:, None, None], at_end.to(last.dtype), last))
            return batch.tokens(out.transpose(2, 3).reshape(batch.num, -1, *qc.shape[1:]), ("canvas", 0)).flatten(1)
        ck, cv = self.lift_tokens(y)  # (N, H, d)
        ctx_k, ctx_v = self.part(state, "ctx_k"), self.part(state, "ctx_v")
        # Context canvas aligned with the queries; the first block's tokens before the chunk from the state.
        keys, values = batch.canvas(ck), batch.canvas(cv)  # (P, Lq, H, d)
        j = torch.arange(w, device=x.device)
        before = (j[None] < batch.first_col[:, None])[..., None, None]
        keys[:, :w] = torch.where(before, ctx_k.index_select(0, slots), keys[:, :w])
        values[:, :w] = torch.where(before, ctx_v.index_select(0, slots), values[:, :w])
        mask = fb.additive_mask(fb.context_valid(j[None], j[:, None], cfg.cross_mask), qc.dtype)  # (W, W)
        kb = keys.view(batch.num, nb, w, *ck.shape[1:]).transpose(2, 3)  # (P, nb, H, W, d)
        vb = values.view(batch.num, nb, w, *cv.shape[1:]).transpose(2, 3)
        out = attend(queries, kb, vb, mask)
        # Keep the context states of the last block's tokens (slot p % W).
        cols = (torch.div(batch.last, w, rounding_mode="floor") - batch.first_block)[:, None] * w + j
        ctx_k.index_copy_(0, slots, keys[rows[:, None], cols])
        ctx_v.index_copy_(0, slots, values[rows[:, None], cols])
        return batch.tokens(out.transpose(2, 3).reshape(batch.num, -1, *qc.shape[1:]), ("canvas", 0)).flatten(1)

    # -- one request's chunk --------------------------------------------------------------------------------------
    def forward_chunk(self, x: torch.Tensor, p0: int, state: tuple[torch.Tensor, ...], query_block: int = 256):
        """``x`` `(T, D)`: the layer input of one request's tokens at positions ``p0 .. p0 + T - 1``; ``state``:
        that request's state tensors ([`state_shapes`]), read and advanced in place. Returns `(T, D)`."""
        w = self.block_len
        t = x.shape[0]
        xn = rms_norm(x, self.input_norm.weight, self.eps)
        if self.kind == "gss":
            ssm_state = self.part(state, "gss")

            def scan(u):
                y, new_state = self.ssm_math().scan(u, ssm_state, p0)
                ssm_state.copy_(new_state)
                return y

            return self.gss(x, xn, scan)
        q, k, v, _ = self.project(xn)  # (T, H, d)
        attn_k, attn_v = self.part(state, "attn_k"), self.part(state, "attn_v")
        ring = attn_k.shape[0]  # W, or 2W (Block-Recurrent)
        # The cached tokens before p0 (those of the ring), then the chunk's.
        n_ring = min(p0, ring)
        prev_pos = torch.arange(p0 - n_ring, p0, device=x.device)
        all_k = torch.cat([attn_k[prev_pos % ring], k])
        all_v = torch.cat([attn_v[prev_pos % ring], v])
        # Block self-attention over [the W cached tokens before p0 ; the chunk].
        n_prev = min(p0, w)
        keys, values = all_k[n_ring - n_prev :], all_v[n_ring - n_prev :]
        outs = []
        for s in range(0, t, query_block):
            e = min(t, s + query_block)
            lo = max(0, s + n_prev - w)  # the first key any of these queries can see
            kp = torch.arange(p0 - n_prev + lo, p0 + e, device=x.device)
            qp = torch.arange(p0 + s, p0 + e, device=x.device)
            bias = self.self_bias(kp[None] - qp[:, None]).to(q.dtype)  # (H, Tq, Tk)
            o = attend(
                q[s:e].transpose(0, 1),
                keys[lo : n_prev + e].transpose(0, 1),
                values[lo : n_prev + e].transpose(0, 1),
                bias,
            )
            outs.append(o.transpose(0, 1))
        a_self = torch.cat(outs).flatten(1)  # (T, H d)
        keep = min(t, ring)  # the ring keeps the last R tokens
        slots = torch.arange(p0 + t - keep, p0 + t, device=x.device) % ring
        attn_k[slots], attn_v[slots] = k[t - keep :], v[t - keep :]
        if self.kind == "bst":
            a_second = self.context_chunk(x, xn, p0, state)
        elif self.kind == "recurrent":
            a_second = self.recurrent_chunk(xn, p0, state, all_k, all_v, p0 - n_ring)
        else:
            a_second = None
        return self.finish(x, a_self, a_second)

    def context_chunk(self, x, xn, p0, state):
        """The SSM, context states and cross-attention of a BST layer over one request's chunk: `(T, H d_h)`."""
        w, cfg = self.block_len, self.config
        t = x.shape[0]
        src = x if cfg.ssm_input == "raw" else xn
        z = self.context.down_proj(src)  # (T, Ds)
        ssm_state = self.ssm_state(state)
        y, new_state = self.ssm_math().scan(z, ssm_state, p0)  # (T, C, Ds)
        ssm_state.copy_(new_state)
        qc = self.cross_query(xn)  # (T, H, d)
        pos = torch.arange(p0, p0 + t, device=x.device)
        if self.mode == "mf":
            last = self.part(state, "mf_last")
            b0, b1 = p0 // w, (p0 + t - 1) // w
            ks, vs = [], []
            for b in range(b0, b1 + 1):
                if b == 0:
                    y_prev = None
                elif b * w - 1 >= p0:
                    y_prev = y[b * w - 1 - p0]
                else:
                    y_prev = last
                kb, vb = self.mf_context(y_prev)
                ks.append(kb)
                vs.append(vb)
            blk = pos // w - b0
            keys, values = torch.stack(ks)[blk], torch.stack(vs)[blk]  # (T, S, H, d)
            out = attend(qc[:, :, None], keys.transpose(1, 2), values.transpose(1, 2))  # (T, H, 1, d)
            ends = torch.nonzero((pos + 1) % w == 0)
            if len(ends):
                last.copy_(y[int(ends[-1])])
            return out.flatten(1)
        ck, cv = self.lift_tokens(y)  # (T, H, d)
        ctx_k, ctx_v = self.part(state, "ctx_k"), self.part(state, "ctx_v")
        m = p0 % w  # tokens of the current block before the chunk
        keys = torch.cat([ctx_k[:m], ck]).transpose(0, 1)  # (H, m + T, d), positions p0 - m ..
        values = torch.cat([ctx_v[:m], cv]).transpose(0, 1)
        qc = qc.transpose(0, 1)
        outs = []
        for start in range(p0 - m, p0 + t, w):  # block by block: a block's queries see only its own states
            a, b = max(p0, start), min(p0 + t, start + w)
            qpos = torch.arange(a, b, device=x.device)[:, None]
            kpos = torch.arange(start, b, device=x.device)[None]
            mask = fb.additive_mask(fb.context_valid(kpos, qpos, cfg.cross_mask), qc.dtype)
            k0 = start - (p0 - m)
            outs.append(
                attend(qc[:, a - p0 : b - p0], keys[:, k0 : b - start + k0], values[:, k0 : b - start + k0], mask)
            )
        out = torch.cat(outs, 1).transpose(0, 1)  # (T, H, d)
        # Keep the context states of the current (last) block's tokens.
        first = max(p0, ((p0 + t - 1) // w) * w)
        idx = torch.arange(first, p0 + t, device=x.device)
        ctx_k[idx % w], ctx_v[idx % w] = ck[idx - p0], cv[idx - p0]
        return out.flatten(1)

    def recurrent_chunk(self, xn, p0, state, all_k, all_v, k0):
        """A Block-Recurrent layer's cross-attention over one request's chunk, block by block: each block's tokens
        read the state before the block, which absorbs the previous and current block's token keys/values at the
        block's end. ``all_k``/``all_v``: the token keys/values from position ``k0`` to the chunk's end. `(T, H d_h)`."""
        w = self.block_len
        t = xn.shape[0]
        rec, rec_k, rec_v = self.part(state, "rec"), self.part(state, "rec_k"), self.part(state, "rec_v")
        if p0 == 0:  # a new request starts from the learned initial state
            rec.copy_(self.recurrent.initial_state)
            init_k, init_v = self.recurrent_keys_values(rec)
            rec_k.copy_(init_k)
            rec_v.copy_(init_v)
        current, kv = rec[None], (rec_k[None], rec_v[None])
        qc = self.cross_query(xn).transpose(0, 1)  # (H, T, d)
        outs = []
        for b in range(p0 // w, (p0 + t - 1) // w + 1):
            a, e = max(p0, b * w), min(p0 + t, (b + 1) * w)
            outs.append(attend(qc[:, a - p0 : e - p0], kv[0][0].transpose(0, 1), kv[1][0].transpose(0, 1)))
            if e == (b + 1) * w:  # the block ends in the chunk: the state absorbs blocks b - 1 and b
                lo = max(0, (b - 1) * w)
                n_missing = lo - (b - 1) * w  # positions before the sequence (block 0's previous block)
                tk = F.pad(all_k[lo - k0 : e - k0], (0, 0, 0, 0, n_missing, 0))[None]
                tv = F.pad(all_v[lo - k0 : e - k0], (0, 0, 0, 0, n_missing, 0))[None]
                valid = (torch.arange(2 * w, device=xn.device) >= n_missing)[None]
                current = self.recurrent_update(current, kv, tk, tv, valid)
                kv = self.recurrent_keys_values(current)
        rec.copy_(current[0])
        rec_k.copy_(kv[0][0])
        rec_v.copy_(kv[1][0])
        return torch.cat(outs, 1).transpose(0, 1).flatten(1)

    # -- one token of many requests -------------------------------------------------------------------------------
    def decode(self, x: torch.Tensor, batch: Decode, state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """One token per request: ``x`` `(B, D)`, the requests' positions and slots in ``batch``; ``state``: the state
        tensors of all slots `(num_slots, ...)`, rows ``batch.slots`` read and written. Returns `(B, D)`."""
        xn = rms_norm(x, self.input_norm.weight, self.eps)
        if self.kind == "gss":
            ssm_state = self.part(state, "gss")

            def step(u):
                y, new_state = self.ssm_math().step(u, self._gather_new(ssm_state, batch))
                ssm_state.index_copy_(0, batch.slots, new_state.to(ssm_state.dtype))
                return y

            return self.gss(x, xn, step)
        return self.finish(x, *self.decode_mix(x, xn, *self.project(xn), batch, state))

    def decode_mix(self, x, xn, q, k, v, qc, batch: Decode, state):
        """The stateful part of [`decode`] (not of a GSS layer): the block self-attention over the ring and the
        second attention (context or recurrent state; None in a block layer) of the tokens whose input ``x``,
        normed input ``xn`` and projections ``q``, ``k``, ``v``, ``qc`` (`(B, H, d_h)`, [`project`]) are given;
        the state advanced. Returns the two attention outputs `(B, H d_h)`."""
        slots, write = batch.slots, batch.write
        attn_k, attn_v = self.part(state, "attn_k"), self.part(state, "attn_v")
        # Only the token's own slot is written (not the whole ring back): before the read with attend_self (the
        # token is one of its keys), after it otherwise.
        if self.config.attend_self:
            attn_k[slots, write], attn_v[slots, write] = k, v
        ring_k, ring_v = attn_k.index_select(0, slots), attn_v.index_select(0, slots)  # (B, R, H, d)
        bias = self.decode_bias(batch)
        a_self = attend(q[:, :, None], ring_k.transpose(1, 2), ring_v.transpose(1, 2), bias, batch.sees_self)
        if not self.config.attend_self:
            attn_k[slots, write], attn_v[slots, write] = k, v
            if self.kind == "recurrent":  # its state update reads the ring after the write
                rows = torch.arange(slots.shape[0], device=x.device)
                ring_k[rows, write], ring_v[rows, write] = k, v
        if self.kind == "bst":
            a_second = self.context_decode(x, xn, qc, batch, state)
        elif self.kind == "recurrent":
            a_second = self.recurrent_decode(qc, batch, state, ring_k, ring_v)
        else:
            a_second = None
        return a_self.flatten(1), a_second

    def decode_bias(self, batch: Decode) -> torch.Tensor:
        """The scaled T5 bias of the decode queries over the ring's slots, masked outside the window and where a
        slot holds no token yet: `(B, H, 1, R)`. The relative positions depend on the position mod R only, so the
        bias is one table of R rows, computed once."""
        if self._decode_bias is None:
            ring = batch.ring
            phase = torch.arange(ring, device=batch.positions.device) + ring  # every slot holds a token
            rel = ring_positions(phase - (0 if self.config.attend_self else 1), ring) - phase[:, None]
            self._decode_bias = self.self_bias(rel).permute(1, 0, 2)[:, :, None]  # (R, H, 1, R)
        table = self._decode_bias
        return torch.where(batch.held, table[batch.write], fb.masked_fill_value(table.dtype))

    @staticmethod
    def _gather_new(all_slots: torch.Tensor, batch: Decode) -> torch.Tensor:
        """Rows ``batch.slots`` of an SSM state tensor, zeros for a request at position 0 (a one-token prompt is
        scheduled as a decode; its slot may hold an earlier request's state). The other parts of the state need no
        reset: the ring and context keys a step reads are masked by position, MF and Block-Recurrent layers pick
        their initial contexts by position."""
        rows = all_slots.index_select(0, batch.slots)
        return torch.where(batch.fresh.view(-1, *[1] * (rows.dim() - 1)), 0, rows)

    def context_decode(self, x, xn, qc, batch: Decode, state):
        cfg, slots = self.config, batch.slots
        src = x if cfg.ssm_input == "raw" else xn
        z = self.context.down_proj(src)
        ssm_state = self.ssm_state(state)
        y, new_state = self.ssm_math().step(z, self._gather_new(ssm_state, batch))  # (B, C, Ds)
        ssm_state.index_copy_(0, slots, new_state.to(ssm_state.dtype))
        qc = qc[:, :, None]  # (B, H, 1, d)
        if self.mode == "mf":
            mf_last = self.part(state, "mf_last")
            last = mf_last.index_select(0, slots)  # (B, S, Ds)
            kc, vc = self.mf_context(last)  # (B, S, H, d)
            k0, v0 = self.mf_initial()
            first = batch.first_block[:, None, None, None]
            kc, vc = torch.where(first, k0, kc), torch.where(first, v0, vc)
            out = attend(qc, kc.transpose(1, 2), vc.transpose(1, 2)).flatten(1)
            end = batch.block_end[:, None, None]
            mf_last.index_copy_(0, slots, torch.where(end, y.to(last.dtype), last))
            return out
        ck, cv = self.lift_tokens(y)  # (B, H, d)
        ctx_k_all, ctx_v_all = self.part(state, "ctx_k"), self.part(state, "ctx_v")
        ctx_k_all[slots, batch.ctx_write], ctx_v_all[slots, batch.ctx_write] = ck, cv  # the token's slot only
        ctx_k, ctx_v = ctx_k_all.index_select(0, slots), ctx_v_all.index_select(0, slots)  # (B, W, H, d)
        mask, seen = batch.context_mask(qc.dtype)
        return attend(qc, ctx_k.transpose(1, 2), ctx_v.transpose(1, 2), mask, seen).flatten(1)

    def recurrent_decode(self, qc, batch: Decode, state, ring_k, ring_v):
        """A Block-Recurrent layer's step: the token reads the state's keys/values (a new request: the learned
        initial state's); at a block end the state absorbs the ring's 2W tokens (``ring_k``/``ring_v`` `(B, 2W, H,
        d_h)` after the token's write)."""
        slots, fresh = batch.slots, batch.fresh
        rec_all, rk_all, rv_all = self.part(state, "rec"), self.part(state, "rec_k"), self.part(state, "rec_v")
        rec, rec_k, rec_v = (t.index_select(0, slots) for t in (rec_all, rk_all, rv_all))
        init = self.recurrent.initial_state
        if self._constants is None:  # the initial state's keys/values, computed once
            self._constants = self.recurrent_keys_values(init)
        init_k, init_v = self._constants
        rec = torch.where(fresh[:, None, None], init, rec)
        rec_k = torch.where(fresh[:, None, None, None], init_k, rec_k)
        rec_v = torch.where(fresh[:, None, None, None], init_v, rec_v)
        qc = qc[:, :, None]  # (B, H, 1, d)
        out = attend(qc, rec_k.transpose(1, 2), rec_v.transpose(1, 2)).flatten(1)
        # At a block end the state absorbs the ring; computed for every request and kept where a block ends (no
        # host read of which ones do).
        end = batch.block_end[:, None, None]
        new = self.recurrent_update(rec, (rec_k, rec_v), ring_k, ring_v, batch.held_after)
        new_k, new_v = self.recurrent_keys_values(new)
        rec_all.index_copy_(0, slots, torch.where(end, new, rec))
        rk_all.index_copy_(0, slots, torch.where(end[..., None], new_k, rec_k))
        rv_all.index_copy_(0, slots, torch.where(end[..., None], new_v, rec_v))
        return out


def _s4d_parameters(channels: int, out_channels: int, state_size: int) -> nn.Module:
    """An S4D kernel's parameters (``modeling_bst``'s ``S4DKernel``)."""
    module, n2 = _Module(), state_size // 2
    for name, shape in (
        ("log_dt", (channels,)),
        ("A_log_real", (channels, n2)),
        ("A_imag", (channels, n2)),
        ("B", (channels, n2, 2)),
        ("C", (out_channels, channels, n2, 2)),
        ("D", (out_channels, channels)),
    ):
        module.register_parameter(name, nn.Parameter(torch.zeros(shape)))
    return module


def _unstruct_parameters(config, channels: int, out_channels: int) -> nn.Module:
    """An unstruct filter's parameters (``modeling_bst``'s ``UnstructFilter``, causal)."""
    order, emb = config.unstruct_order, config.unstruct_emb_dim
    layers = [nn.Linear(emb, order)] + [nn.Linear(order, order) for _ in range(config.unstruct_num_inner_mlps)]
    module = _Module(
        sin=_Module(), mlp=nn.ModuleList(layers), out=nn.Linear(order, out_channels * channels, bias=False)
    )
    module.pos_emb = nn.Parameter(torch.zeros(1, config.max_position_embeddings, emb))
    module.sin.freq = nn.Parameter(torch.zeros(order))
    module.bias = nn.Parameter(torch.zeros(out_channels, channels))
    return module


class _Module(nn.Module):
    """A named container of submodules (the parameter path of ``modeling_bst``)."""

    def __init__(self, **modules):
        super().__init__()
        for name, module in modules.items():
            setattr(self, name, module)


class _Norm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
