"""A Block-State Transformer layer for serving, in plain PyTorch (no vLLM import).

The tensor maths (norms, T5 buckets, the window and context mask rules, the S4D discretisation, chunked form and
recurrent step in real arithmetic) is ``modeling_bst/functional_bst.py``, the file the model itself uses: it imports
only torch, so it runs under the older transformers vLLM pins, and this module loads it by its path in the
repository ([`load_functional`]; the plugin is installed editable from the repository, ``scripts/setup.sh``). What is
here is the serving layout: parameter names of ``modeling_bst`` (a saved checkpoint loads as it is), one request's
chunk or a batch of decode steps over fixed-size per-request states. Per-position parity with ``modeling_bst``'s
forward is tested in the main suite (``tests/integrations/test_vllm_layers.py``), greedy parity with ``generate()``
in the plugin's own tests.

A layer processes one request's chunk of ``T`` consecutive tokens at positions ``p0 .. p0 + T - 1`` (a whole
prompt, a piece of a chunked prefill, or one decoded token) and advances that request's state in place. Every part
of the state has a fixed size, whatever the length of the sequence:

* ``attn_k``, ``attn_v`` `(W, H, d_h)`: the keys/values of the last W tokens (token at position p in slot p % W):
  the block self-attention of a token reads exactly the W tokens before it (the W most recent with
  ``attend_self``);
* BST layers: ``ssm`` `(D_s, N/2, 2)`: the S4D state (real and imaginary parts);
* SH / MH: ``ctx_k``, ``ctx_v`` `(W, H, d_h)`: the context keys/values of the current block's tokens (slot p % W);
* MF: ``last`` `(S, D_s)`: the SSM's S read-outs at the last block end, from which the current block's context
  states come.

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
rms_norm = fb.rms_norm
# S4D outputs of a prefill chunk are computed in pieces of this many tokens (the model's chunk length).
S4D_CHUNK_LEN = 64


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention with an additive ``mask`` and no further scaling (queries carry the learned scale).

    ``q`` `(..., H, Tq, d)`, ``k``/``v`` `(..., H, Tk, d)`, ``mask`` broadcastable to `(..., H, Tq, Tk)` (finite
    large negative where masked) -> `(..., H, Tq, d)`; a query that sees no key gets zeros."""
    scores = torch.matmul(q, k.transpose(-1, -2)) + mask
    out = torch.matmul(torch.softmax(fb.upcast(scores), -1).to(q.dtype), v)
    seen = (mask > fb.masked_fill_value(mask.dtype)).any(-1, keepdim=True)
    return out * seen.to(out.dtype)


class S4D:
    """The S4D maths of one layer's SSM parameters (``log_dt``, ``A_log_real``, ``A_imag``, ``B``, ``C``, ``D``),
    with what depends only on them computed once (serving never changes the parameters): the chunked form's tables
    per number of chunks and the step constants. States are real `(..., D_s, N/2, 2)`."""

    def __init__(self, ssm: nn.Module):
        self.params = ssm.log_dt, ssm.A_log_real, ssm.A_imag, ssm.B, ssm.C, ssm.D
        self.dtype = torch.float64 if ssm.log_dt.dtype == torch.float64 else torch.float32
        self.discrete = fb.s4d_discretize(*self.params[:4], self.dtype)
        self.step_constants = fb.s4d_step_constants(*self.params, self.dtype)
        self._tables = {}

    def tables(self, chunk: int, num_chunks: int):
        key = (chunk, num_chunks)
        if key not in self._tables:
            groups, _ = fb.chunk_groups(num_chunks)
            exps, mask, offsets = fb.chunk_exponents_layout(chunk, groups, True)
            exps = torch.tensor([exps, mask], dtype=self.dtype, device=self.params[0].device)
            self._tables[key] = fb.s4d_chunk_tables(self.params, exps, offsets, chunk, num_chunks)
        return self._tables[key]

    def scan(self, z: torch.Tensor, state: torch.Tensor):
        """Outputs ``y`` `(T, C, Ds)` for the inputs ``z`` `(T, Ds)` from ``state`` `(Ds, N2, 2)`, and the state
        after the last input."""
        z = z.to(self.dtype)[None]
        chunk = min(S4D_CHUNK_LEN, z.shape[1])
        tables = self.tables(chunk, -(-z.shape[1] // chunk))
        y = fb.s4d_chunked_forward(z, chunk, tables, state[None])
        return y[0], fb.s4d_final_state(z, *self.discrete, state[None])[0]

    def step(self, z: torch.Tensor, state: torch.Tensor):
        """One token of many requests: ``z`` `(B, Ds)`, ``state`` `(B, Ds, N2, 2)` -> ``y`` `(B, C, Ds)` and the new
        state."""
        return fb.s4d_step(z.to(self.dtype), state.to(self.dtype), self.step_constants)


class BSTLayerMath(nn.Module):
    """One decoder layer of a BST model: a block ("Slide") layer, or a BST layer with an S4D SSM and SH / MH / MF
    context states. Parameters are named as in ``modeling_bst`` (``self_attn``, ``o_proj``, ``mlp``, ``ssm``,
    ``context``, ``cross_attn``, the norms)."""

    def __init__(self, config, is_bst: bool):
        super().__init__()
        self.config = config
        self.is_bst = is_bst
        d, heads, hd = config.hidden_size, config.num_attention_heads, config.head_dim
        self.heads, self.head_dim, self.block_len = heads, hd, config.block_len
        self.eps = config.rms_norm_eps
        self.input_norm = _Norm(d)
        self.post_attention_norm = _Norm(d)
        self.self_attn = _Module(
            q_proj=nn.Linear(d, heads * hd, bias=False),
            k_proj=nn.Linear(d, heads * hd, bias=False),
            v_proj=nn.Linear(d, heads * hd, bias=False),
            relative_bias=nn.Embedding(config.relative_attention_num_buckets, heads),
        )
        self.self_attn.scale = nn.Parameter(torch.ones(heads))
        self.o_proj = nn.Linear(heads * hd * (2 if is_bst else 1), d, bias=False)
        self.mlp = _Module(
            up_proj=nn.Linear(d, config.intermediate_size, bias=False),
            down_proj=nn.Linear(config.intermediate_size, d, bias=False),
        )
        self.mode = config.context_mode
        if is_bst:
            ds, n2 = config.ssm_channels, config.ssm_state_size // 2
            outs = config.ssm_output_channels
            self.ssm = _Module()
            for name, shape in (
                ("log_dt", (ds,)),
                ("A_log_real", (ds, n2)),
                ("A_imag", (ds, n2)),
                ("B", (ds, n2, 2)),
                ("C", (outs, ds, n2, 2)),
                ("D", (outs, ds)),
            ):
                self.ssm.register_parameter(name, nn.Parameter(torch.zeros(shape)))
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
            self.cross_attn = _Module(q_proj=nn.Linear(d, heads * hd, bias=False))
            self.cross_attn.scale = nn.Parameter(torch.ones(heads))
        self._constants = None

    # -- state layout ---------------------------------------------------------------------------------------------
    @staticmethod
    def state_shapes(config, is_bst: bool) -> tuple[tuple[int, ...], ...]:
        """The per-request state tensors of a layer, in the order of [`forward_chunk`]'s ``state``."""
        w, heads, hd = config.block_len, config.num_attention_heads, config.head_dim
        shapes = [(w, heads, hd), (w, heads, hd)]
        if is_bst:
            shapes.append((config.ssm_channels, config.ssm_state_size // 2, 2))
            if config.context_mode == "mf":
                shapes.append((config.num_context_states, config.ssm_channels))
            else:
                shapes += [(w, heads, hd), (w, heads, hd)]
        return tuple(shapes)

    def s4d(self) -> S4D:
        """The SSM's maths; its constants computed once (serving never changes the parameters)."""
        if self._constants is None:
            self._constants = S4D(self.ssm)
        return self._constants

    # -- pieces ---------------------------------------------------------------------------------------------------
    def _heads(self, x):
        return x.unflatten(-1, (self.heads, self.head_dim))

    def project(self, xn):
        a = self.self_attn
        q, k, v = self._heads(a.q_proj(xn)), self._heads(a.k_proj(xn)), self._heads(a.v_proj(xn))
        if self.config.qk_norm:
            q, k = fb.l2_normalize(q), fb.l2_normalize(k)
        return q * a.scale[:, None], k, v

    def cross_query(self, xn):
        q = self._heads(self.cross_attn.q_proj(xn))
        if self.config.qk_norm:
            q = fb.l2_normalize(q)
        return q * self.cross_attn.scale[:, None]

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

    def finish(self, x, a_self, a_second):
        """Concatenation of the attention outputs, output projection and residual, then MLP and residual."""
        a = a_self if a_second is None else torch.cat([a_self, a_second], -1)
        h = x + self.o_proj(a)
        m = self.post_attention_norm.weight
        return h + self.mlp.down_proj(F.relu(self.mlp.up_proj(rms_norm(h, m, self.eps))))

    # -- one request's chunk --------------------------------------------------------------------------------------
    def forward_chunk(self, x: torch.Tensor, p0: int, state: tuple[torch.Tensor, ...], query_block: int = 256):
        """``x`` `(T, D)`: the layer input of one request's tokens at positions ``p0 .. p0 + T - 1``; ``state``:
        that request's state tensors ([`state_shapes`]), read and advanced in place. Returns `(T, D)`."""
        w = self.block_len
        t = x.shape[0]
        xn = rms_norm(x, self.input_norm.weight, self.eps)
        q, k, v = self.project(xn)  # (T, H, d)
        attn_k, attn_v = state[0], state[1]
        # Block self-attention over [the W cached tokens before p0 ; the chunk].
        n_prev = min(p0, w)
        prev_pos = torch.arange(p0 - n_prev, p0, device=x.device)
        keys = torch.cat([attn_k[prev_pos % w], k])
        values = torch.cat([attn_v[prev_pos % w], v])
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
        keep = min(t, w)  # the ring keeps the last W tokens
        slots = torch.arange(p0 + t - keep, p0 + t, device=x.device) % w
        attn_k[slots], attn_v[slots] = k[t - keep :], v[t - keep :]
        a_second = self.context_chunk(x, xn, p0, state) if self.is_bst else None
        return self.finish(x, a_self, a_second)

    def context_chunk(self, x, xn, p0, state):
        """The SSM, context states and cross-attention of a BST layer over one request's chunk: `(T, H d_h)`."""
        w, cfg = self.block_len, self.config
        t = x.shape[0]
        src = x if cfg.ssm_input == "raw" else xn
        z = self.context.down_proj(src)  # (T, Ds)
        ssm_state = state[2]
        y, new_state = self.s4d().scan(z, ssm_state)  # (T, C, Ds)
        ssm_state.copy_(new_state)
        qc = self.cross_query(xn)  # (T, H, d)
        pos = torch.arange(p0, p0 + t, device=x.device)
        if self.mode == "mf":
            last = state[3]
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
            zero = torch.zeros((), dtype=qc.dtype, device=x.device)
            out = attend(qc[:, :, None], keys.transpose(1, 2), values.transpose(1, 2), zero)  # (T, H, 1, d)
            ends = torch.nonzero((pos + 1) % w == 0)
            if len(ends):
                last.copy_(y[int(ends[-1])])
            return out.flatten(1)
        ck, cv = self.lift_tokens(y)  # (T, H, d)
        ctx_k, ctx_v = state[3], state[4]
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

    # -- one token of many requests -------------------------------------------------------------------------------
    def decode(self, x: torch.Tensor, positions: torch.Tensor, state: tuple[torch.Tensor, ...], slots: torch.Tensor):
        """One token per request: ``x`` `(B, D)` at ``positions`` `(B,)`; ``state``: the state tensors of all slots
        `(num_slots, ...)`, rows ``slots`` `(B,)` read and written. Returns `(B, D)`."""
        w, cfg = self.block_len, self.config
        bsz = x.shape[0]
        xn = rms_norm(x, self.input_norm.weight, self.eps)
        q, k, v = self.project(xn)  # (B, H, d)
        attn_k, attn_v = state[0], state[1]
        ring_k, ring_v = attn_k[slots], attn_v[slots]  # (B, W, H, d)
        write = positions % w
        rows = torch.arange(bsz, device=x.device)
        if cfg.attend_self:
            ring_k[rows, write], ring_v[rows, write] = k, v
        # Slot j holds the newest token at a position = j (mod W) before (or, with attend_self, at) the query.
        j = torch.arange(w, device=x.device)
        newest = positions[:, None] - (0 if cfg.attend_self else 1)
        kpos = newest - (newest - j[None]) % w  # (B, W)
        rel = torch.where(kpos >= 0, kpos - positions[:, None], -(10**9))
        bias = self.self_bias(rel).to(q.dtype).permute(1, 0, 2)[:, :, None]  # (B, H, 1, W)
        a_self = attend(q[:, :, None], ring_k.transpose(1, 2), ring_v.transpose(1, 2), bias).flatten(1)
        if not cfg.attend_self:
            ring_k[rows, write], ring_v[rows, write] = k, v
        attn_k[slots], attn_v[slots] = ring_k, ring_v
        a_second = self.context_decode(x, xn, positions, state, slots) if self.is_bst else None
        return self.finish(x, a_self, a_second)

    def context_decode(self, x, xn, positions, state, slots):
        w, cfg = self.block_len, self.config
        bsz = x.shape[0]
        rows = torch.arange(bsz, device=x.device)
        src = x if cfg.ssm_input == "raw" else xn
        z = self.context.down_proj(src)
        y, new_state = self.s4d().step(z, state[2][slots])  # (B, C, Ds)
        state[2][slots] = new_state.to(state[2].dtype)
        qc = self.cross_query(xn)[:, :, None]  # (B, H, 1, d)
        if self.mode == "mf":
            last = state[3][slots]  # (B, S, Ds)
            kc, vc = self.mf_context(last)  # (B, S, H, d)
            k0, v0 = self.mf_context(None)
            first = (positions < w)[:, None, None, None]
            kc, vc = torch.where(first, k0, kc), torch.where(first, v0, vc)
            zero = torch.zeros((), dtype=qc.dtype, device=x.device)
            out = attend(qc, kc.transpose(1, 2), vc.transpose(1, 2), zero).flatten(1)
            end = ((positions + 1) % w == 0)[:, None, None]
            state[3][slots] = torch.where(end, y, last)
            return out
        ck, cv = self.lift_tokens(y)  # (B, H, d)
        ctx_k, ctx_v = state[3][slots], state[4][slots]  # (B, W, H, d)
        ctx_k[rows, positions % w], ctx_v[rows, positions % w] = ck, cv
        j = torch.arange(w, device=x.device)[None]
        offset = (positions % w)[:, None]
        mask = fb.additive_mask(fb.context_valid(j, offset, cfg.cross_mask), qc.dtype)
        out = attend(qc, ctx_k.transpose(1, 2), ctx_v.transpose(1, 2), mask[:, None, None]).flatten(1)
        state[3][slots], state[4][slots] = ctx_k, ctx_v
        return out


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
