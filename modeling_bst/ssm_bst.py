"""SSM kernels of the Block-State Transformer: diagonal S4 (S4D) and Hyena-style "unstruct" filters, `(B, L, Ds)` ->
`(B, L, C, Ds)` behind one contract (``forward``, ``final_state``, ``step_constants``, ``step``,
``block_end_outputs``); the maths is ``functional_bst.py``; docs/architecture.md, "SSM maths", describes both.
"""

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from .functional_bst import (
    chunk_exponents_layout,
    chunk_groups,
    direct_causal_conv,
    fold_skip,
    s4d_chunk_scan,
    s4d_chunk_tables,
    s4d_chunked_forward,
    s4d_discretize,
    s4d_final_state,
    s4d_step,
    s4d_step_constants,
    s4d_vandermonde,
    spectrum_conv,
    unstruct_filters,
)
from .utils_bst import Switch, host_can_branch, memoised, step_memo, tracing


def _no_autocast(device_type: str):
    return torch.autocast(device_type=device_type, enabled=False)


def compute_dtype(param: torch.Tensor) -> torch.dtype:
    """SSM maths runs in float32 (float64 when the model is float64), never in half precision."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def fft_conv(u: torch.Tensor, k_f: torch.Tensor) -> torch.Tensor:
    """[`spectrum_conv`]; one opaque custom op under ``torch.compile`` / ``torch.export`` (no complex tensor)."""
    if torch.compiler.is_compiling():
        return _fft_conv_op(u, k_f)
    return spectrum_conv(u, k_f)


def ssm_dtype() -> torch.dtype:
    """The dtype SSM parameters are created in: the default dtype, float32 for a half-precision one."""
    dtype = torch.get_default_dtype()
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# The FFT convolution and its backward as custom ops, in a namespace per copy of this module (remote code).
_OPS = "".join(c if c.isalnum() else "_" for c in __name__)


@torch.library.custom_op(f"{_OPS}::fft_conv", mutates_args=())
def _fft_conv_op(u: torch.Tensor, k_f: torch.Tensor) -> torch.Tensor:
    return spectrum_conv(u, k_f).contiguous()


@_fft_conv_op.register_fake
def _(u, k_f):
    return u.new_empty((u.shape[0], k_f.shape[0], *u.shape[1:]))


@torch.library.custom_op(f"{_OPS}::fft_conv_backward", mutates_args=())
def _fft_conv_backward(grad: torch.Tensor, u: torch.Tensor, k_f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of [`fft_conv`] with respect to ``u`` and ``k_f``, the same as eager autograd gives."""
    n = 2 * u.shape[-1]
    g_f = torch.fft.rfft(grad, n=n)  # (B, C, Ds, L+1)
    grad_u = torch.fft.irfft((g_f * k_f.conj()).sum(1), n=n)[..., : u.shape[-1]]  # correlation with the kernel
    # irfft's adjoint (as torch defines it): rfft / n with the bins whose mirror image was dropped counted twice.
    g_f[..., 1 : n // 2] *= 2
    grad_k = (g_f * torch.fft.rfft(u, n=n).conj().unsqueeze(1)).sum(0) / n
    return grad_u.contiguous(), grad_k.contiguous()


@_fft_conv_backward.register_fake
def _(grad, u, k_f):
    return u.new_empty(u.shape), k_f.new_empty(k_f.shape)  # contiguous, as the real outputs


_fft_conv_op.register_autograd(
    lambda ctx, grad: _fft_conv_backward(grad, *ctx.saved_tensors),
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs),
)


# -- real arithmetic (ONNX export: no complex tensors, no FFT) ------------------------------------------------------
_REAL_ARITHMETIC = [False]


class real_arithmetic(Switch):
    """Context manager: direct long convolutions, no FFT (as in ONNX export)."""

    flag = _REAL_ARITHMETIC


def use_real_arithmetic() -> bool:
    """Inside [`real_arithmetic`], or while ``torch.onnx.export`` traces the model."""
    return _REAL_ARITHMETIC[0] or (torch.compiler.is_exporting() and torch.onnx.is_in_onnx_export())


S4D_CHUNK_LEN = 64  # S4D outputs beyond twice this length run chunk by chunk ([`s4d_chunked_forward`])
SPECTRUM_MEMO_BYTES = 512 * 2**20


def memoised_spectrum(module: nn.Module, key: tuple, compute):
    """``compute()``, reused across evaluation forwards while the parameters are unchanged ([`memoised`])."""
    if not spectrum_memo_usable(module):
        return compute()
    return memoised(module.__dict__, "_spectrum_memo", key, list(module.parameters()), compute, SPECTRUM_MEMO_BYTES)


def spectrum_memo_usable(module: nn.Module) -> bool:
    """Evaluation mode, no gradient to the parameters, on the CPU (no sync to compare values) and not tracing."""
    params = list(module.parameters())
    if module.training or (torch.is_grad_enabled() and any(p.requires_grad for p in params)):
        return False
    return not params or host_can_branch(params[0])


def chunk_exponents(chunk: int, groups: int, conv: bool, dtype: torch.dtype, device):
    """[`chunk_exponents_layout`] as a `(2, E)` tensor and the offsets, kept per device and dtype in eager mode."""
    layout = chunk_exponents_layout.__wrapped__ if tracing() else chunk_exponents_layout  # (dynamo: no lru_cache)
    exps, mask, offsets = layout(chunk, groups, conv)
    if tracing():
        return torch.tensor([exps, mask], dtype=dtype, device=device), offsets
    return _exponent_table(chunk, groups, conv, dtype, torch.device(device)), offsets


@functools.lru_cache(maxsize=256)
def _exponent_table(chunk: int, groups: int, conv: bool, dtype: torch.dtype, device) -> torch.Tensor:
    with torch.inference_mode(False):  # usable by later training steps (inference tensors are not)
        return torch.tensor(chunk_exponents_layout(chunk, groups, conv)[:2], dtype=dtype, device=device)


class LongConv(nn.Module):
    """A long convolution by its ``taps(length)``: ``(forward taps with the D skip, backward taps or None)``."""

    def spectrum(self, length: int) -> torch.Tensor:
        """FFT (size 2 ``length``) of the taps: `(C, Ds, length + 1)`."""
        forward, backward = self.taps(length)
        if backward is not None:  # two-sided: lags -1..-L wrap around to the end
            forward = F.pad(forward, (0, length)) + F.pad(backward.flip(-1), (length, 0))
        return torch.fft.rfft(forward, n=2 * length)

    def long_conv(self, u: torch.Tensor) -> torch.Tensor:
        """``u`` `(B, Ds, L)` -> `(B, C, Ds, L)`: direct in [`real_arithmetic`], else by the memoised spectrum."""
        length = u.shape[-1]
        if not use_real_arithmetic():
            return fft_conv(u, memoised_spectrum(self, (length, u.dtype), lambda: self.spectrum(length)))
        forward, backward = self.taps(length)
        y = direct_causal_conv(u, forward)
        if backward is None:
            return y
        return y + direct_causal_conv(u.flip(-1), F.pad(backward, (1, 0))[..., :length]).flip(-1)  # negative lags


class S4DKernel(LongConv):
    """Diagonal state-space kernel (S4D, zero-order hold): one state per SSM channel, C read-outs of it."""

    def __init__(self, channels: int, out_channels: int, state_size: int, config):
        super().__init__()
        self.channels = channels
        self.out_channels = out_channels
        self.n_modes = state_size // 2
        self.init_mode = config.ssm_init
        self.dt_min, self.dt_max = config.ssm_dt_min, config.ssm_dt_max
        self.bidirectional = config.bidirectional
        dtype = ssm_dtype()
        self.log_dt = nn.Parameter(torch.empty(channels, dtype=dtype))
        self.A_log_real = nn.Parameter(torch.empty(channels, self.n_modes, dtype=dtype))
        self.A_imag = nn.Parameter(torch.empty(channels, self.n_modes, dtype=dtype))
        self.B = nn.Parameter(torch.empty(channels, self.n_modes, 2, dtype=dtype))
        self.C = nn.Parameter(torch.empty(out_channels, channels, self.n_modes, 2, dtype=dtype))
        self.D = nn.Parameter(torch.empty(out_channels, channels, dtype=dtype))
        if self.bidirectional:
            self.C_backward = nn.Parameter(torch.empty(out_channels, channels, self.n_modes, 2, dtype=dtype))
        self.chunk_len = S4D_CHUNK_LEN

    @torch.no_grad()
    def reset_parameters(self):
        """S4D-Lin / S4D-Inv init, log-uniform dt in [dt_min, dt_max], B = 1, C ~ CN(0, 1), D ~ N(0, 1)."""
        device = self.log_dt.device
        n = torch.arange(self.n_modes, dtype=torch.float32, device=device)
        if self.init_mode == "lin":
            imag = math.pi * n
        else:
            big_n = 2 * self.n_modes
            imag = big_n / math.pi * (big_n / (2 * n + 1) - 1)
        init.constant_(self.A_log_real, math.log(0.5))
        init.copy_(self.A_imag, imag.expand(self.channels, -1))
        init.uniform_(self.log_dt, math.log(self.dt_min), math.log(self.dt_max))
        init.copy_(self.B, torch.stack([torch.ones_like(self.A_imag), torch.zeros_like(self.A_imag)], -1))
        init.normal_(self.C, 0.0, math.sqrt(0.5))
        init.normal_(self.D, 0.0, 1.0)
        if self.bidirectional:
            init.normal_(self.C_backward, 0.0, math.sqrt(0.5))

    def discretize(self):
        """[`s4d_discretize`] in the compute dtype."""
        return s4d_discretize(self.log_dt, self.A_log_real, self.A_imag, self.B, compute_dtype(self.log_dt))

    def kernel(self, length: int, dt_a=None, d_b=None, backward: bool = False) -> torch.Tensor:
        """The convolution kernel ``K`` `(C, Ds, length)`."""
        if dt_a is None:
            dt_a, d_b = self.discretize()
        return s4d_vandermonde(self.C_backward if backward else self.C, d_b, dt_a, length)

    def taps(self, length: int):
        """The kernel over ``length`` lags with D folded into lag 0, and the backward one (or None)."""
        dt_a, d_b = self.discretize()
        k = fold_skip(self.kernel(length, dt_a, d_b), self.D.to(dt_a[0].dtype))
        return k, (self.kernel(length, dt_a, d_b, backward=True) if self.bidirectional else None)

    def forward(self, z: torch.Tensor, state: torch.Tensor | None = None, tables=None) -> torch.Tensor:
        """``z`` `(B, L, Ds)` -> ``y`` `(B, L, C, Ds)` from ``state`` (None: zero), chunked, FFT or direct."""
        with _no_autocast(z.device.type):
            z = z.to(compute_dtype(self.log_dt))
            length = z.shape[1]
            if not use_real_arithmetic() and self.use_chunks(length, z.element_size()):
                chunk = min(self.chunk_len, length)  # the real chunked form, [`s4d_chunked_forward`]
                return s4d_chunked_forward(
                    z, chunk, self.chunk_tables(chunk, -(-length // chunk), True, tables), state
                )
            y = self.long_conv(z.transpose(1, 2))  # (B, C, Ds, L)
            if state is not None:
                dt_a = self.discretize()[0]
                x0 = state.to(dt_a[0].dtype).unbind(-1)
                y = y + s4d_vandermonde(self.C, x0, dt_a, length, offset=1)
            return y.permute(0, 3, 1, 2)  # (B, L, C, Ds)

    def use_chunks(self, length: int, element_size: int) -> bool:
        """Whether [`forward`] runs the chunked form (causal; not where a memoised spectrum serves)."""
        if not self.chunk_len or self.bidirectional:
            return False
        if not spectrum_memo_usable(self):
            return True  # training, gradients, accelerators, tracing: the real chunked form
        spectrum_bytes = self.out_channels * self.channels * (length + 1) * 2 * element_size
        return length > 2 * self.chunk_len and spectrum_bytes > SPECTRUM_MEMO_BYTES

    def params(self) -> tuple[torch.Tensor, ...]:
        """``(log_dt, A_log_real, A_imag, B, C, D)``."""
        return self.log_dt, self.A_log_real, self.A_imag, self.B, self.C, self.D

    def chunk_tables(self, chunk: int, num_chunks: int, conv: bool = True, tables=None):
        """[`s4d_chunk_tables`] from the forward's [`ChunkTables`] if they list this kernel, memoised in evaluation."""

        def build():
            if tables is not None and self in tables.kernels:
                return tables.get(self, chunk, num_chunks, conv)
            return grouped_chunk_tables([self], chunk, num_chunks, conv)[0]

        return memoised_spectrum(self, ("chunked", chunk, num_chunks, conv, compute_dtype(self.log_dt)), build)

    def chunk_start_states(self, z: torch.Tensor, chunk: int, state=None, constants=None, first: int = 0):
        """The states `(Ds, B, nc, 2 N2)` entering chunks ``first ..`` of ``z`` `(B, nc * chunk, Ds)` (compute dtype)."""
        with _no_autocast(z.device.type):
            bsz, length, ds = z.shape
            nc = length // chunk
            rw, _, *scan = constants if constants is not None else self.chunk_tables(chunk, nc + first)
            u = z.reshape(bsz * nc, chunk, ds).permute(2, 0, 1)
            local = torch.bmm(u, rw[..., rw.shape[-1] - 2 * self.n_modes :])  # (Ds, B*nc, 2 N2)
            return s4d_chunk_scan(local.view(ds, bsz, nc, -1), state, scan, nc + first, first).view(ds, bsz, nc, -1)

    def channel_major_chunks(self, z: torch.Tensor, x0: torch.Tensor, chunk: int, constants=None) -> torch.Tensor:
        """The chunked form's outputs of whole chunks from their entering states ``x0``, `(C, Ds, B * L)`."""
        with _no_autocast(z.device.type):
            bsz, length, ds = z.shape
            nc = length // chunk
            rw, g, *_ = constants if constants is not None else self.chunk_tables(chunk, nc)
            width = self.out_channels * chunk
            u = z.reshape(bsz * nc, chunk, ds).permute(2, 0, 1)  # (Ds, B*n, T)
            y = torch.baddbmm(torch.bmm(u, rw[..., :width]), x0.reshape(ds, bsz * nc, -1), g, alpha=2)
            y = y.view(ds, bsz * nc, self.out_channels, chunk).permute(2, 0, 1, 3)
            return y.reshape(self.out_channels, ds, bsz * length)

    def final_state(self, z: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """[`s4d_final_state`] of ``z`` `(B, L, Ds)`: `(B, Ds, N2, 2)`."""
        with _no_autocast(z.device.type):
            dt_a, d_b = self.discretize()
            return s4d_final_state(z.to(compute_dtype(self.log_dt)), dt_a, d_b, state)

    def block_end_outputs(self, z: torch.Tensor, block_len: int, state: torch.Tensor | None = None, tables=None):
        """The outputs at the last token of every block (causal): `(B, nb*W, Ds)` -> `(B, nb, C, Ds)`."""
        if self.bidirectional:
            raise ValueError("block_end_outputs is the causal fast path; use forward() for a bidirectional kernel.")
        with _no_autocast(z.device.type):
            z = z.to(compute_dtype(self.log_dt))
            bsz, length, ds = z.shape
            nb = length // block_len
            if nb == 0:
                return z.new_zeros(bsz, 0, self.out_channels, ds)
            constants = self.chunk_tables(block_len, nb + 1, False, tables)  # the states after blocks 0 .. nb-1
            x = self.chunk_start_states(z[:, : nb * block_len], block_len, state, constants, first=1)
            z_end = z[:, block_len - 1 :: block_len].permute(2, 0, 1).unsqueeze(-1)  # (Ds, B, nb, 1)
            skip = (z_end * self.D.to(z.dtype).t()[:, None, None]).view(ds, bsz * nb, self.out_channels)
            y = torch.baddbmm(skip, x.view(ds, bsz * nb, -1), constants[1], alpha=2)  # (Ds, B*nb, C)
            return y.view(ds, bsz, nb, self.out_channels).permute(1, 2, 3, 0)

    def empty_state(self, batch_size: int, device) -> torch.Tensor:
        """The zero state `(B, Ds, N2, 2)`: complex modes as real pairs."""
        return torch.zeros(batch_size, self.channels, self.n_modes, 2, dtype=compute_dtype(self.log_dt), device=device)

    def step_constants(self):
        """[`s4d_step_constants`], the constants of [`s4d_step`]."""
        with _no_autocast(self.log_dt.device.type):
            return s4d_step_constants(*self.params(), compute_dtype(self.log_dt))

    def step(self, z_t: torch.Tensor, state: torch.Tensor, constants=None, seen: int | None = None):
        """One token ``z_t`` `(B, Ds)` -> ``y_t`` `(B, C, Ds)` and the new state ([`s4d_step`])."""
        with _no_autocast(z_t.device.type):
            z_t = z_t.to(compute_dtype(self.log_dt))
            return s4d_step(z_t, state, constants if constants is not None else self.step_constants())


def grouped_chunk_tables(kernels: list, chunk: int, num_chunks: int, conv: bool = True) -> list:
    """[`S4DKernel.chunk_tables`] of kernels of one shape from one call on their channel-concatenated parameters."""
    first = kernels[0]
    dims = (0, 0, 0, 0, 1, 1)  # log_dt, A_log_real, A_imag, B: channels first; C, D: after the read-outs
    params = [torch.cat(p, d) if len(kernels) > 1 else p[0] for p, d in zip(zip(*(k.params() for k in kernels)), dims)]
    groups, _ = chunk_groups(num_chunks)
    exps, offsets = chunk_exponents(chunk, groups, conv, compute_dtype(first.log_dt), first.log_dt.device)
    with _no_autocast(first.log_dt.device.type):
        rw, g, *scan = s4d_chunk_tables(params, exps, offsets, chunk, num_chunks, conv)
    if len(kernels) == 1:
        return [(rw, g, *scan)]
    sizes = [k.channels for k in kernels]
    parts = [rw.split(sizes), g.split(sizes)] + [t.split([n * first.n_modes for n in sizes]) for t in scan]
    return list(zip(*parts))


class ChunkTables:
    """A forward's chunked-form tables of its causal S4D kernels, built per shape at once ([`grouped_chunk_tables`]);
    kernels with hooks or parameters not plain here (FSDP, offloaded) compute their own."""

    def __init__(self, kernels):
        self.kernels = [
            k
            for k in kernels
            if type(k) is S4DKernel
            and k.chunk_len
            and not k.bidirectional
            and not (k._forward_hooks or k._forward_pre_hooks or hasattr(k, "_hf_hook"))
            and all(type(p) is nn.Parameter and not p.is_meta for p in k.parameters())
        ]
        self.built = {}

    def get(self, kernel, chunk: int, num_chunks: int, conv: bool = True):
        """``kernel``'s tables, built with those of the listed kernels of its shape."""
        shape = (kernel.n_modes, kernel.out_channels, kernel.log_dt.dtype, kernel.log_dt.device)
        key = (chunk, num_chunks, conv, *shape)
        group = [k for k in self.kernels if (k.n_modes, k.out_channels, k.log_dt.dtype, k.log_dt.device) == shape]
        if key not in self.built:
            self.built[key] = grouped_chunk_tables(group, chunk, num_chunks, conv)
        return self.built[key][group.index(kernel)]


def append_history(history: torch.Tensor, z_t: torch.Tensor) -> torch.Tensor:
    """The last ``Lh`` inputs after ``z_t`` `(B, Ds)` joins ``history`` `(B, Ds, Lh)` (oldest first), amortised O(1):
    a view of a buffer with slack after its end, copied only when the slack runs out (earlier views stay valid).
    Out of place where gradients flow or while tracing."""
    bsz, channels, length = history.shape
    if (torch.is_grad_enabled() and (history.requires_grad or z_t.requires_grad)) or tracing():
        return torch.cat([history[..., 1:], z_t[..., None]], -1)
    row = history.stride(1)
    start = history.storage_offset()
    in_buffer = (
        history.stride(2) == 1
        and history.stride(0) == channels * row
        and history.untyped_storage().nbytes() >= bsz * channels * row * history.element_size()
        and start < row
    )
    if not (in_buffer and start + length < row):
        row = length + max(64, length // 4)
        buffer = history.new_empty(bsz, channels, row)
        buffer[..., : length - 1] = history[..., 1:]
        buffer[..., length - 1] = z_t
        return buffer[..., :length]
    history.as_strided((bsz, channels), (channels * row, row), start + length).copy_(z_t)
    return history.as_strided((bsz, channels, length), (channels * row, row, 1), start + 1)


class Sin(nn.Module):
    """The trainable per-feature frequency of an unstruct filter's sine layers, ``sin(freq * x)``."""

    def __init__(self, dim: int, freq: float):
        super().__init__()
        self.init_freq = freq
        self.freq = nn.Parameter(torch.empty(dim, dtype=ssm_dtype()))


# Unstruct decoding in chunks of M steps ([`UnstructFilter.pending_outputs`]); 512 by measurement (~60M bst-unstruct
# at 64k context, 1 thread: 45.8 / 43.7 / 41.1 ms per token with M = 128 / 256 / 512; docs/performance.md).
UNSTRUCT_DECODE_CHUNK = 512
PENDING_BYTES = 128 * 2**20  # largest decoding-chunk spectrum kept per layer


class UnstructFilter(LongConv):
    """Hyena-style implicit filter ``h_t = exp(-alpha t) * FFN(PositionalFeatures(t))`` plus a bias, Lmax taps."""

    def __init__(self, channels: int, out_channels: int, config):
        super().__init__()
        self.channels, self.out_channels = channels, out_channels
        self.filter_shape = (out_channels, channels)
        self.max_len = config.max_position_embeddings
        self.emb_dim = config.unstruct_emb_dim
        self.bidirectional = config.bidirectional
        order = config.unstruct_order
        self.decay = (config.unstruct_decay_target, config.unstruct_decay_fast, config.unstruct_decay_slow)
        width = out_channels * channels * (2 if self.bidirectional else 1)
        dtype = ssm_dtype()
        self.pos_emb = nn.Parameter(torch.empty(1, self.max_len, self.emb_dim, dtype=dtype))
        self.sin = Sin(order, config.unstruct_sin_freq)
        layers = [nn.Linear(self.emb_dim, order, dtype=dtype)]
        layers += [nn.Linear(order, order, dtype=dtype) for _ in range(config.unstruct_num_inner_mlps)]
        self.mlp = nn.ModuleList(layers)
        self.out = nn.Linear(order, width, bias=False, dtype=dtype)
        self.bias = nn.Parameter(torch.empty(out_channels, channels, dtype=dtype))
        self.decode_chunk = min(UNSTRUCT_DECODE_CHUNK, self.max_len)

    @torch.no_grad()
    def reset_positional_features(self):
        device = self.pos_emb.device
        t = torch.linspace(0, 1, self.max_len, device=device)[:, None]  # (Lmax, 1)
        bands = (self.emb_dim - 1) // 2
        w = 2 * math.pi * torch.arange(self.max_len, device=device)[:, None] / self.max_len
        f = torch.linspace(1e-4, bands - 1, bands, device=device)[None]
        feats = torch.cat([t, torch.cos(f * w), -torch.sin(f * w)], dim=-1)  # (Lmax, emb_dim)
        init.copy_(self.pos_emb, feats.unsqueeze(0))

    def filters(self, length: int) -> torch.Tensor:
        """Filter taps for the first ``length`` lags: `(C, Ds, length)` (`(2, C, Ds, length)` two-sided)."""
        if length > self.max_len:
            raise ValueError(
                f"unstruct filters exist up to max_position_embeddings={self.max_len} tokens; got a sequence of "
                f"{length}. Use ssm_kind='s4' for longer contexts."
            )
        with _no_autocast(self.pos_emb.device.type):
            dtype = compute_dtype(self.pos_emb)
            # The layers are called as modules (adapters run), in their weights' dtype.
            layers = [lambda x, m=m: m(x.to(m.weight.dtype)) for m in [*self.mlp, self.out]]
            h = self.pos_emb[0, :length].to(dtype)
            h = unstruct_filters(
                h, layers[:-1], layers[-1], self.sin.freq, self.max_len, self.decay, *self.filter_shape
            )
            return h if self.bidirectional else h[0]

    def taps(self, total: int):
        """The filter over ``total`` lags with the bias folded into lag 0, and the backward one (or None)."""
        h = F.pad(self.filters(min(total, self.max_len)), (0, max(0, total - self.max_len)))
        forward, backward = h if self.bidirectional else (h, None)
        return fold_skip(forward, self.bias.to(h.dtype)), backward

    def forward(self, z: torch.Tensor, history: torch.Tensor | None = None, tables=None) -> torch.Tensor:
        """``z`` `(B, L, Ds)` -> ``y`` `(B, L, C, Ds)` after the earlier inputs ``history`` (``tables`` unused)."""
        with _no_autocast(z.device.type):
            dtype = compute_dtype(self.pos_emb)
            u = z.to(dtype).transpose(1, 2)  # (B, Ds, L)
            length = u.shape[-1]
            if history is not None:
                u = torch.cat([history.to(dtype), u], dim=-1)
            return self.long_conv(u)[..., -length:].permute(0, 3, 1, 2)

    def output_at_newest(self, history: torch.Tensor, seen: int | None = None, constants=None) -> torch.Tensor:
        """The output `(B, C, Ds)` at the newest input of ``history`` `(B, Ds, Lh)`, over its last ``seen`` inputs."""
        with _no_autocast(history.device.type):
            dtype = compute_dtype(self.pos_emb)
            taps = constants if constants is not None else self.step_constants()  # (Ds, Lmax, C), newest lag last
            n = history.shape[-1] if seen is None else max(1, min(seen, history.shape[-1]))
            y = torch.matmul(history[..., -n:].to(dtype).transpose(0, 1), taps[:, -n:].to(dtype)).permute(1, 2, 0)
            return y + self.bias.to(dtype) * history[:, None, :, -1].to(dtype)

    def pending_outputs(self, history: torch.Tensor, n: int, constants, memo: dict | None = None) -> torch.Tensor:
        """The share `(B, C, Ds, M)` of the ``n`` newest inputs of ``history`` in the next M outputs, by one FFT of the
        smallest size 2^k, 5 * 2^(k-3) or 3 * 2^(k-2) >= n + M (the taps' spectrum kept in a decoding ``memo``)."""
        need = n + self.decode_chunk
        power = 1 << (need - 1).bit_length()  # >= need
        size = min(size for size in (power, power * 5 // 8, power * 3 // 4) if size >= need)
        dtype = compute_dtype(self.pos_emb)

        def build():  # (C, Ds, size // 2 + 1) from the taps in lag order
            return torch.fft.rfft(constants.flip(1).permute(2, 0, 1)[..., :size].to(dtype), n=size)

        with _no_autocast(history.device.type):
            spectrum = step_memo(memo, (id(self), "unstruct_chunk"), (size,), self.parameters(), build, PENDING_BYTES)
            x = history[..., history.shape[-1] - n :].to(dtype)  # (B, Ds, n)
            y = torch.fft.irfft(torch.fft.rfft(x, n=size).unsqueeze(1) * spectrum.unsqueeze(0), n=size)
            return y[..., n : n + self.decode_chunk].contiguous()

    def empty_state(self, batch_size: int, device) -> torch.Tensor:
        """An empty input history `(B, Ds, Lmax)`."""
        dtype = compute_dtype(self.pos_emb)
        return torch.zeros(batch_size, self.channels, self.max_len, dtype=dtype, device=device)

    def final_state(self, z: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """The last ``Lmax`` inputs after ``z`` `(B, L, Ds)` (rows right-aligned): `(B, Ds, Lmax)`."""
        hist = z.to(compute_dtype(self.pos_emb)).transpose(1, 2)
        if state is not None:
            hist = torch.cat([state.to(hist.dtype), hist], -1)
        if hist.shape[-1] < self.max_len:
            hist = F.pad(hist, (self.max_len - hist.shape[-1], 0))
        return hist[..., -self.max_len :].contiguous()

    def step_constants(self):
        """The taps laid out for stepping, `(Ds, Lmax, C)` with the newest lag last."""
        return self.filters(self.max_len).flip(-1).permute(1, 2, 0).contiguous()

    def step(self, z_t, state, constants=None, seen: int | None = None, output: bool = True, pending=None):
        """``z_t`` `(B, Ds)` joins the history: the output `(B, C, Ds)` (None unless ``output``) and the new history;
        ``pending`` ``(buffer, k)``: step k of a decoding chunk ([`pending_outputs`])."""
        history = append_history(state, z_t.to(state.dtype))
        if not output:
            return None, history
        y = self.output_at_newest(history, seen if pending is None else pending[1] + 1, constants)
        return (y if pending is None else pending[0][..., pending[1]] + y), history

    def block_end_outputs(self, z: torch.Tensor, block_len: int, state: torch.Tensor | None = None, tables=None):
        """Outputs at the last token of every block: `(B, nb*W, Ds)` -> `(B, nb, C, Ds)`."""
        return self(z, state)[:, block_len - 1 :: block_len]


class PerFilterS4D(nn.Module):
    """MF with one SSM per filter: one S4D kernel over S * Ds channels that all read the same input."""

    def __init__(self, channels: int, out_channels: int, state_size: int, config):
        super().__init__()
        self.channels, self.out_channels = channels, out_channels
        self.kernel = S4DKernel(out_channels * channels, 1, state_size, config)

    def _repeat(self, z: torch.Tensor) -> torch.Tensor:
        """`(..., Ds)` -> `(..., S * Ds)`, filter-major."""
        return z.repeat(*([1] * (z.dim() - 1)), self.out_channels)

    def _split(self, y: torch.Tensor) -> torch.Tensor:
        """`(..., 1, S * Ds)` -> `(..., S, Ds)`."""
        return y.squeeze(-2).unflatten(-1, (self.out_channels, self.channels))

    def empty_state(self, batch_size: int, device) -> torch.Tensor:
        return self.kernel.empty_state(batch_size, device)

    def step_constants(self):
        return self.kernel.step_constants()

    def forward(self, z: torch.Tensor, state: torch.Tensor | None = None, tables=None) -> torch.Tensor:
        return self._split(self.kernel(self._repeat(z), state, tables))

    def final_state(self, z: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernel.final_state(self._repeat(z), state)

    def step(self, z_t: torch.Tensor, state: torch.Tensor, constants=None, seen: int | None = None):
        y, state = self.kernel.step(self._repeat(z_t), state, constants)
        return self._split(y), state

    def block_end_outputs(self, z: torch.Tensor, block_len: int, state: torch.Tensor | None = None, tables=None):
        return self._split(self.kernel.block_end_outputs(self._repeat(z), block_len, state, tables))
