"""SSM kernels of the Block-State Transformer: diagonal S4 (S4D) and Hyena-style "unstruct" filters.

Both kernels produce a causal long convolution over the whole sequence (in float32, also under bf16 autocast: an
FFT of size 2L; S4D in training, on accelerators and without a memoised spectrum in real arithmetic chunk by chunk,
[`S4DKernel.chunked_forward`]) plus a D skip term, behind one contract (each kernel with its own state):

* ``forward(z, state=None)``: full-sequence form, `(B, L, Ds)` -> `(B, L, C, Ds)`, continuing from ``state``;
* ``final_state(z, state=None)``: the state after ``z`` (rows right-aligned: leading zeros are no input);
* ``step_constants()``: what a step needs from the parameters (memoised by the decoding cache);
* ``step(z_t, state, constants=None, seen=None)``: recurrent form for one token, `(B, Ds)` -> ``(y_t (B, C, Ds),
  new state)``; ``seen`` bounds how many inputs any row has (unstruct: the cost of a step is O(seen));
* ``block_end_outputs(z, W, state=None)``: the outputs at the last token of every block (MF context states).

S4D's maths is real arithmetic throughout (``functional_bst.py``: complex numbers as ``(re, im)`` pairs); its state
is the diagonal state `(B, Ds, N2)`, held as a complex tensor (a view of the real `(B, Ds, N2, 2)` one the maths
computes). Unstruct's state is the input history `(B, Ds, Lmax)` (newest last; the filter has
``max_position_embeddings`` taps). An unstruct step that outputs at every position (SH, MH) can be given the chunk's
pending outputs ([`UnstructFilter.pending_outputs`]): then it costs O(M), not O(seen).

For ONNX export (no complex tensors, no FFT), while ``torch.onnx.export`` traces or inside [`real_arithmetic`], the
S4D state is the real `(B, Ds, N2, 2)` tensor and the long convolution a direct one ([`direct_causal_conv`]).

Shape legend: B batch, L length, C output channels per SSM channel (1 for SH, H for MH, S for MF),
Ds SSM channels, N2 complex modes (ssm_state_size / 2), nb number of blocks, W block length.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from .functional_bst import (
    causal_spectrum,
    chunk_exponents_layout,
    chunk_groups,
    direct_causal_conv,
    fold_skip,
    s4d_chunk_scan,
    s4d_chunk_tables,
    s4d_chunked_forward,
    s4d_discretize,
    s4d_final_state,
    s4d_free_response,
    s4d_kernel,
    s4d_step,
    s4d_step_constants,
    spectrum_conv,
    unstruct_filters,
)
from .utils_bst import Switch, host_can_branch, memoised, tracing


def _no_autocast(device_type: str):
    return torch.autocast(device_type=device_type, enabled=False)


def compute_dtype(param: torch.Tensor) -> torch.dtype:
    """SSM maths runs in float32 (float64 when the model is float64), never in half precision."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def bidirectional_spectrum(k_fwd: torch.Tensor, k_bwd: torch.Tensor) -> torch.Tensor:
    """Spectrum of the two-sided kernel (``k_fwd`` on lags 0..L-1, ``k_bwd`` on lags -1..-L) for [`fft_conv`]."""
    length = k_fwd.shape[-1]
    k = F.pad(k_fwd, (0, length)) + F.pad(k_bwd.flip(-1), (length, 0))  # (C, Ds, 2L): negative lags wrap around
    return torch.fft.rfft(k, n=2 * length)


def fft_conv(u: torch.Tensor, k_f: torch.Tensor) -> torch.Tensor:
    """Convolution of ``u`` `(B, Ds, L)` with a kernel given by its size-2L spectrum ``k_f`` `(C, Ds, L+1)`.

    Returns `(B, C, Ds, L)`. Under ``torch.compile`` / ``torch.export`` it is one opaque custom op
    ([`_fft_conv_op`], same numbers): the complex FFT tensors stay out of inductor (it has no code generation for
    complex dtypes) and out of the graph, which stays whole (``fullgraph=True`` works).
    """
    if torch.compiler.is_compiling():
        return _fft_conv_op(u, k_f)
    return spectrum_conv(u, k_f)


def ssm_dtype() -> torch.dtype:
    """The dtype SSM parameters are created in: float32 under a half-precision default dtype (they are the models'
    ``_keep_in_fp32_modules_strict``, so a model built in fp16 / bf16, e.g. ``from_config(config, dtype=torch.bfloat16)``,
    keeps them float32 as loading does), the default dtype otherwise (a float64 model stays float64)."""
    dtype = torch.get_default_dtype()
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


# The FFT convolution as a custom op with a fake (shape-only) implementation, so that a compiled graph keeps it as
# one call (no graph break; fullgraph and torch.export work) and runs the eager FFTs above inside it. Its backward
# is a second op. The namespace follows the module name: a copy loaded as remote code registers its own ops.
_OPS = "".join(c if c.isalnum() else "_" for c in __name__)


@torch.library.custom_op(f"{_OPS}::fft_conv", mutates_args=())
def _fft_conv_op(u: torch.Tensor, k_f: torch.Tensor) -> torch.Tensor:
    return spectrum_conv(u, k_f).contiguous()


@_fft_conv_op.register_fake
def _(u, k_f):
    return torch.empty((u.shape[0], k_f.shape[0], *u.shape[1:]), dtype=u.dtype, device=u.device)


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
    # contiguous, as the real outputs (explicitly: a fake ``u`` may be a transposed view)
    return (
        torch.empty(u.shape, dtype=u.dtype, device=u.device),
        torch.empty(k_f.shape, dtype=k_f.dtype, device=k_f.device),
    )


def _fft_conv_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _fft_conv_vjp(ctx, grad):
    return _fft_conv_backward(grad, *ctx.saved_tensors)


_fft_conv_op.register_autograd(_fft_conv_vjp, setup_context=_fft_conv_setup)


def fft_causal_conv(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Causal convolution ``y[..., t] = sum_{j<=t} k[..., j] u[..., t-j]`` via FFT of size n = 2L.

    Args:
        u (`torch.Tensor` of shape `(B, Ds, L)`): input, float32.
        k (`torch.Tensor` of shape `(C, Ds, L)`): kernel, float32.

    Returns:
        `torch.Tensor` of shape `(B, C, Ds, L)`.
    """
    return fft_conv(u, causal_spectrum(k))


def fft_bidirectional_conv(u: torch.Tensor, k_fwd: torch.Tensor, k_bwd: torch.Tensor) -> torch.Tensor:
    """Two-sided convolution ``y_t = sum_{j>=0} k_fwd[j] u[t-j] + sum_{j>=1} k_bwd[j-1] u[t+j]`` (FFT size 2L).

    Shapes as in [`fft_causal_conv`]; ``k_bwd`` has the same shape as ``k_fwd``.
    """
    return fft_conv(u, bidirectional_spectrum(k_fwd, k_bwd))


# -- real arithmetic (ONNX export) ------------------------------------------------------------------------------------
# ONNX has no complex tensors, and torch.fft does not export to it. Under ``torch.onnx.export`` (or inside
# [`real_arithmetic`]) the S4D state is therefore a real `(B, Ds, N2, 2)` tensor (``view_as_real`` layout) and the
# long convolution a direct causal convolution ([`direct_causal_conv`], O(L^2) instead of the FFT's O(L log L)). The
# same numbers as the FFT form up to rounding; the eager and training paths are unchanged.
_REAL_ARITHMETIC = [False]


class real_arithmetic(Switch):
    """Context manager: the SSM kernels take their real-arithmetic form ([`use_real_arithmetic`]) inside it.

    ``torch.onnx.export`` selects that form by itself; this is for running it eagerly (tests, a PyTorch reference of
    an exported model, a prefill whose cache feeds an exported decode step)."""

    flag = _REAL_ARITHMETIC


def use_real_arithmetic() -> bool:
    """Whether the SSM kernels run in real arithmetic: inside [`real_arithmetic`], or while ``torch.onnx.export``
    traces the model (checked only while exporting: a compiled graph never branches on it)."""
    if _REAL_ARITHMETIC[0]:
        return True
    return torch.compiler.is_exporting() and torch.onnx.is_in_onnx_export()


def direct_bidirectional_conv(u: torch.Tensor, k_fwd: torch.Tensor, k_bwd: torch.Tensor) -> torch.Tensor:
    """[`fft_bidirectional_conv`] as two direct convolutions: the backward lags are a causal convolution of the
    reversed input with ``k_bwd`` shifted by one lag."""
    backward = direct_causal_conv(u.flip(-1), F.pad(k_bwd, (1, 0))[..., : k_bwd.shape[-1]]).flip(-1)
    return direct_causal_conv(u, k_fwd) + backward


# S4D full-sequence outputs beyond twice this length are computed chunk by chunk ([`S4DKernel.chunked_forward`]).
S4D_CHUNK_LEN = 64
# Largest kernel spectrum kept between evaluation forwards (per SSM module).
SPECTRUM_MEMO_BYTES = 512 * 2**20


def memoised_spectrum(module: nn.Module, key: tuple, compute):
    """A kernel spectrum ``compute()``, reused across evaluation forwards (eval mode, no gradient to the SSM
    parameters) while those parameters are unchanged: see [`memoised`]."""
    if not spectrum_memo_usable(module):
        return compute()
    return memoised(module.__dict__, "_spectrum_memo", key, list(module.parameters()), compute, SPECTRUM_MEMO_BYTES)


def spectrum_memo_usable(module: nn.Module) -> bool:
    """Whether [`memoised_spectrum`] may reuse a spectrum: evaluation mode, no gradient to the SSM parameters, on the
    CPU, and not tracing. The check compares parameter values: on an accelerator that is a host-device sync per
    forward (recomputing the spectrum is cheap there), and it is not traceable by torch.export / torch.compile."""
    params = list(module.parameters())
    if module.training or (torch.is_grad_enabled() and any(p.requires_grad for p in params)):
        return False
    return not params or host_can_branch(params[0])


def upcast_ssm(x: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``x`` in the SSM's compute dtype ([`compute_dtype`] of ``param``)."""
    return x.to(compute_dtype(param))


# The exponent tables of S4D's chunked form ([`chunk_exponents`]), per layout, dtype and device.
_EXPONENT_TABLES: dict = {}


def chunk_exponents(chunk: int, groups: int, conv: bool, dtype: torch.dtype, device):
    """[`chunk_exponents_layout`] as a `(2, E)` tensor (exponents, log-mask) and the offsets.

    Kept per device and dtype in eager mode (no host-to-device copy per forward: it would be a sync point on a GPU);
    built in the graph while tracing (a constant there)."""
    if tracing():  # the plain function (dynamo would warn about the lru_cache wrapper)
        exps, mask, offsets = chunk_exponents_layout.__wrapped__(chunk, groups, conv)
        return torch.tensor([exps, mask], dtype=dtype, device=device), offsets
    exps, mask, offsets = chunk_exponents_layout(chunk, groups, conv)
    key = (chunk, groups, conv, dtype, torch.device(device))
    table = _EXPONENT_TABLES.get(key)
    if table is None:
        if len(_EXPONENT_TABLES) > 256:  # many distinct lengths: start over rather than grow
            _EXPONENT_TABLES.clear()
        with torch.inference_mode(False):  # usable by later training steps (inference tensors are not)
            table = _EXPONENT_TABLES[key] = torch.tensor([exps, mask], dtype=dtype, device=device)
    return table, offsets


class S4DKernel(nn.Module):
    """Diagonal state-space kernel (S4D) with zero-order-hold discretisation.

    Per channel h: ``x_t = exp(dt_h Lambda_h) x_{t-1} + Bbar_h z_t``, ``y_{c,t} = 2 Re(C_{c,h} x_t) + D_{c,h} z_t``
    with ``Bbar = (exp(dt Lambda) - 1) / Lambda * B``; equivalently ``y = K * z + D z`` with
    ``K_{c,h}[l] = 2 Re(C_{c,h} Abar_h^l Bbar_h)``. Lambda, B and dt are shared by the C output channels (MH heads,
    MF filters): one state per SSM channel, several read-outs.

    Complex parameters are stored as real views (`(..., 2)`) so that optimisers, weight decay and clipping work.
    """

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
        # Full-sequence outputs are computed in chunks of this many tokens beyond twice its length (0: never).
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
        """``(dt Lambda, Bbar)``: `(Ds, N2)` ``(re, im)`` pairs in the compute dtype (``dt Lambda`` = log Abar, exact
        for ZOH), [`s4d_discretize`]."""
        return s4d_discretize(self.log_dt, self.A_log_real, self.A_imag, self.B, compute_dtype(self.log_dt))

    def kernel(self, length: int, dt_a=None, d_b=None, backward: bool = False) -> torch.Tensor:
        """The convolution kernel ``K`` of shape `(C, Ds, length)`, computed for exactly ``length`` lags."""
        if dt_a is None:
            dt_a, d_b = self.discretize()
        return s4d_kernel(self.C_backward if backward else self.C, dt_a, d_b, length)

    def spectrum(self, length: int) -> torch.Tensor:
        """FFT (size 2 ``length``) of the full kernel, D skip included, for [`fft_conv`]: `(C, Ds, length + 1)`."""
        dt_a, d_b = self.discretize()
        # The D skip is the lag-0 tap: folded into the kernel, one pass over the (B, C, Ds, L) output fewer.
        k = fold_skip(self.kernel(length, dt_a, d_b), self.D.to(dt_a[0].dtype))
        if self.bidirectional:
            return bidirectional_spectrum(k, self.kernel(length, dt_a, d_b, backward=True))
        return causal_spectrum(k)

    def forward(self, z: torch.Tensor, state: torch.Tensor | None = None, tables=None) -> torch.Tensor:
        """Full-sequence form. ``z`` `(B, L, Ds)` -> ``y`` `(B, L, C, Ds)` (float32); ``tables``: the forward's
        [`ChunkTables`] (or None).

        ``state`` (`(B, Ds, N2)` complex or real `(B, Ds, N2, 2)`), if given, is the state before the first token (a
        continued sequence). Causal kernels run chunk by chunk ([`chunked_forward`], see [`use_chunks`]): in
        training, on accelerators and whenever no whole-length spectrum is memoised; time and memory grow linearly in
        L also with many read-outs (MH: C = H). Otherwise (``chunk_len = 0``, bidirectional kernels, CPU evaluation
        with a memoised spectrum) one FFT convolution over the whole length, or in [`real_arithmetic`] a direct one
        ([`direct_causal_conv`]: no FFT, for ONNX export).
        """
        direct = use_real_arithmetic()
        with _no_autocast(z.device.type):
            z = z.to(compute_dtype(self.log_dt))
            length = z.shape[1]
            if not direct and self.use_chunks(length, z.element_size()):
                return self.chunked_forward(z, min(self.chunk_len, length), state, tables)
            u = z.transpose(1, 2)  # (B, Ds, L)
            if direct:
                dt_a, d_b = self.discretize()
                k = fold_skip(self.kernel(length, dt_a, d_b), self.D.to(z.dtype))
                if self.bidirectional:
                    y = direct_bidirectional_conv(u, k, self.kernel(length, dt_a, d_b, backward=True))
                else:
                    y = direct_causal_conv(u, k)  # (B, C, Ds, L)
            else:
                y = fft_conv(u, memoised_spectrum(self, (length, z.dtype), lambda: self.spectrum(length)))
            if state is not None:
                y = y + s4d_free_response(self.C, self.discretize()[0], state, length)
            return y.permute(0, 3, 1, 2)  # (B, L, C, Ds)

    def use_chunks(self, length: int, element_size: int) -> bool:
        """Whether [`forward`] runs chunk by chunk ([`chunked_forward`]): causal kernels with ``chunk_len`` set,
        unless a memoised whole-length spectrum can be reused (CPU evaluation), which is faster while it fits the
        memo (and for at most two chunks)."""
        if not self.chunk_len or self.bidirectional:
            return False
        if not spectrum_memo_usable(self):
            return True  # training, gradients, accelerators, tracing: the real chunked form
        spectrum_bytes = self.out_channels * self.channels * (length + 1) * 2 * element_size
        return length > 2 * self.chunk_len and spectrum_bytes > SPECTRUM_MEMO_BYTES

    # -- the chunked form in real arithmetic (training, prefill on accelerators): ``functional_bst`` -------------------
    def params(self) -> tuple[torch.Tensor, ...]:
        """``(log_dt, A_log_real, A_imag, B, C, D)``: the parameters of the functional S4D maths."""
        return self.log_dt, self.A_log_real, self.A_imag, self.B, self.C, self.D

    def chunk_tables(self, chunk: int, num_chunks: int, conv: bool = True):
        """[`s4d_chunk_tables`] of this kernel for ``num_chunks`` chunks of ``chunk`` tokens, from one discretisation
        in the compute dtype."""
        return grouped_chunk_tables([self], chunk, num_chunks, conv)[0]

    def chunked_forward(self, z: torch.Tensor, chunk: int, state: torch.Tensor | None = None, tables=None):
        """[`forward`] chunk by chunk in real arithmetic (causal kernels, [`s4d_chunked_forward`]): the same outputs,
        linear cost in L. ``z`` `(B, L, Ds)` in the compute dtype -> `(B, L, C, Ds)`."""
        constants = self.chunked_constants(chunk, z.dtype, -(-z.shape[1] // chunk), tables)
        return s4d_chunked_forward(z, chunk, constants, state)

    def chunk_start_states(
        self, z: torch.Tensor, chunk: int, state: torch.Tensor | None = None, constants=None
    ) -> torch.Tensor:
        """The states entering every chunk of ``chunk`` tokens (the given ``state`` or zero, then the chunk-end
        states), in the stacked real layout of [`s4d_chunk_scan`]: ``z`` `(B, nc * chunk, Ds)` (compute dtype) ->
        `(Ds, B, nc, 2 N2)` (real parts of the N2 modes, then imaginary ones). ``constants``: [`chunked_constants`]
        for ``nc`` chunks, if already computed."""
        with _no_autocast(z.device.type):
            bsz, length, ds = z.shape
            nc = length // chunk
            rw, _, *scan = constants if constants is not None else self.chunked_constants(chunk, z.dtype, nc)
            u = z.reshape(bsz * nc, chunk, ds).permute(2, 0, 1)
            local = torch.bmm(u, rw[..., rw.shape[-1] - 2 * self.n_modes :])  # (Ds, B*nc, 2 N2)
            return s4d_chunk_scan(local.view(ds, bsz, nc, -1), state, scan, nc).view(ds, bsz, nc, -1)

    def chunked_constants(self, chunk: int, dtype: torch.dtype, num_chunks: int = 1, tables=None):
        """[`chunk_tables`] for ``num_chunks`` chunks, memoised between evaluation forwards ([`memoised_spectrum`]),
        else from the forward's [`ChunkTables`] if given."""
        key = ("chunked", chunk, num_chunks, dtype)
        return memoised_spectrum(self, key, lambda: chunk_tables_of(self, chunk, num_chunks, True, tables))

    def channel_major_chunks(self, z: torch.Tensor, x0: torch.Tensor, chunk: int, constants=None) -> torch.Tensor:
        """[`chunked_forward`]'s outputs for whole chunks, laid out read-out and channel first.

        ``z`` `(B, n * chunk, Ds)` (compute dtype) and ``x0`` the states entering its n chunks `(Ds, B, n, 2 N2)`
        ([`chunk_start_states`]) -> `(C, Ds, B * n * chunk)`, tokens batch-major. Every read-out's outputs of a
        channel are contiguous in time: a per-read-out projection over Ds (MH's lift) is then one batched matmul
        without a copy. The same numbers as [`chunked_forward`] up to rounding. ``constants``: [`chunked_constants`]
        if the caller runs several segments (computed, and differentiated, once).
        """
        with _no_autocast(z.device.type):
            bsz, length, ds = z.shape
            nc = length // chunk
            rw, g, *_ = constants if constants is not None else self.chunked_constants(chunk, z.dtype, nc)
            width = self.out_channels * chunk
            u = z.reshape(bsz * nc, chunk, ds).permute(2, 0, 1)  # (Ds, B*n, T)
            y = torch.baddbmm(
                torch.bmm(u, rw[..., :width]), x0.reshape(ds, bsz * nc, -1), g, alpha=2
            )  # (Ds, B*n, C*T)
            y = y.view(ds, bsz * nc, self.out_channels, chunk).permute(2, 0, 1, 3)
            return y.reshape(self.out_channels, ds, bsz * length)

    def final_state(self, z: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """State after the last token: ``x_T = Abar^T x0 + sum_j Abar^{T-1-j} Bbar z_j``. `(B, L, Ds)` -> `(B, Ds, N2)`
        complex ([`s4d_final_state`], viewed as complex).

        Rows must be left-aligned to the end (left padding with zeros leaves the state exactly zero). In real
        arithmetic ([`use_real_arithmetic`], or ``state`` in the real form) the state is real `(B, Ds, N2, 2)`.
        """
        with _no_autocast(z.device.type):
            dt_a, d_b = self.discretize()
            x = s4d_final_state(z.to(compute_dtype(self.log_dt)), dt_a, d_b, state)
            real = use_real_arithmetic() or (state is not None and not state.is_complex())
            return x if real else torch.view_as_complex(x)

    def block_end_outputs(self, z: torch.Tensor, block_len: int, state: torch.Tensor | None = None, tables=None):
        """SSM outputs of all C channels at the last token of every block, without an FFT per channel.

        The C read-outs ``2 Re(C x) + D z`` of the block-end states, in real arithmetic: every block's local end
        state is one batched matmul (the local-state weights of [`chunk_tables`] with blocks as chunks), then the
        chunk scan ([`s4d_chunk_scan`]) and one more matmul for the read-outs. ``z`` `(B, nb*W, Ds)` -> `(B, nb, C, Ds)`.
        Causal kernels only.
        """
        if self.bidirectional:
            raise ValueError("block_end_outputs is the causal fast path; use forward() for a bidirectional kernel.")
        with _no_autocast(z.device.type):
            z = z.to(compute_dtype(self.log_dt))
            bsz, length, ds = z.shape
            nb = length // block_len
            if nb == 0:
                return z.new_zeros(bsz, 0, self.out_channels, ds)
            # Blocks as chunks; the states after them are those entering chunks 1 .. nb of nb + 1.
            w_local, readout, *scan = chunk_tables_of(self, block_len, nb + 1, False, tables)
            u = z[:, : nb * block_len].reshape(bsz * nb, block_len, ds).permute(2, 0, 1)  # (Ds, B*nb, W)
            local = torch.bmm(u, w_local)  # (Ds, B*nb, 2 N2)
            x = s4d_chunk_scan(local.view(ds, bsz, nb, -1), state, scan, nb + 1, first=1)  # (Ds, B*nb, 2 N2)
            z_end = z[:, block_len - 1 :: block_len].permute(2, 0, 1).unsqueeze(-1)  # (Ds, B, nb, 1)
            skip = (z_end * self.D.to(z.dtype).t()[:, None, None]).view(ds, bsz * nb, self.out_channels)
            y = torch.baddbmm(skip, x, readout, alpha=2)  # (Ds, B*nb, C)
            return y.view(ds, bsz, nb, self.out_channels).permute(1, 2, 3, 0)

    def empty_state(self, batch_size: int, device) -> torch.Tensor:
        """The zero state `(B, Ds, N2)` (complex; real `(B, Ds, N2, 2)` in real arithmetic): no input yet."""
        if use_real_arithmetic():
            dtype = compute_dtype(self.log_dt)
            return torch.zeros(batch_size, self.channels, self.n_modes, 2, dtype=dtype, device=device)
        dtype = torch.complex128 if compute_dtype(self.log_dt) == torch.float64 else torch.complex64
        return torch.zeros(batch_size, self.channels, self.n_modes, dtype=dtype, device=device)

    def step_constants(self):
        """What a recurrent step needs from the parameters: ``(Abar, Bbar, 2 C, D)``, computed once per decode; in
        real arithmetic ([`use_real_arithmetic`]) as real `(..., 2)` tensors ([`s4d_step_constants`]), else complex."""
        with _no_autocast(self.log_dt.device.type):
            a_bar, b_bar, c2, skip = s4d_step_constants(*self.params(), compute_dtype(self.log_dt))
            if use_real_arithmetic():
                return a_bar, b_bar, c2, skip
            return tuple(torch.complex(t[..., 0], t[..., 1]) for t in (a_bar, b_bar, c2)) + (skip,)

    def step(self, z_t: torch.Tensor, state: torch.Tensor, constants=None, seen: int | None = None):
        """Recurrent form for one token. ``z_t`` `(B, Ds)`, ``state`` `(B, Ds, N2)` complex (or real
        `(B, Ds, N2, 2)`: [`s4d_step`]) -> ``y_t`` `(B, C, Ds)` and the new state in the same form.

        ``constants``: [`step_constants`] if already computed (they only change with the parameters). ``seen`` is
        not needed (the state has a fixed size). A complex state steps with complex products: on the CPU one
        vectorised complex multiply is several times faster than its four real ones on the interleaved layout.
        """
        with _no_autocast(z_t.device.type):
            z_t = z_t.to(compute_dtype(self.log_dt))
            if constants is None or constants[0].is_complex() != state.is_complex():
                with real_arithmetic(not state.is_complex()):
                    constants = self.step_constants()
            if not state.is_complex():
                return s4d_step(z_t, state, constants)
            a_bar, b_bar, c2, skip = constants
            state = a_bar * state + b_bar * z_t.unsqueeze(-1)
            y = torch.einsum("chn,bhn->bch", c2, state).real
            return y + skip * z_t.unsqueeze(1), state


def grouped_chunk_tables(kernels: list, chunk: int, num_chunks: int, conv: bool = True) -> list:
    """[`S4DKernel.chunk_tables`] of S4D kernels of one shape (modes, read-outs, dtype, device) from one call: their
    parameters concatenated along the channels (every table is per channel), the tables split back per kernel."""
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
    """The chunked-form tables ([`S4DKernel.chunk_tables`]) of a model's causal S4D kernels for one forward: the
    first request for a kernel computes them for every listed kernel of its shape at once ([`grouped_chunk_tables`]:
    one set of parameter-side ops and their autograd instead of one per layer). Kernels with hooks (offloading,
    adapters) or not listed compute their own."""

    def __init__(self, kernels):
        self.kernels = [
            k
            for k in kernels
            if type(k) is S4DKernel
            and k.chunk_len
            and not k.bidirectional
            and not (k._forward_hooks or k._forward_pre_hooks or hasattr(k, "_hf_hook"))
        ]
        self.built = {}

    @staticmethod
    def shape(kernel) -> tuple:
        return kernel.n_modes, kernel.out_channels, kernel.log_dt.dtype, kernel.log_dt.device

    def get(self, kernel, chunk: int, num_chunks: int, conv: bool = True):
        if kernel not in self.kernels:
            return kernel.chunk_tables(chunk, num_chunks, conv)
        shape = self.shape(kernel)
        key = (chunk, num_chunks, conv, *shape)
        group = [k for k in self.kernels if self.shape(k) == shape]
        if key not in self.built:
            self.built[key] = grouped_chunk_tables(group, chunk, num_chunks, conv)
        return self.built[key][group.index(kernel)]


def chunk_tables_of(kernel, chunk: int, num_chunks: int, conv: bool, tables: ChunkTables | None):
    """``kernel``'s chunk tables, from the forward's shared ``tables`` if given."""
    return (
        kernel.chunk_tables(chunk, num_chunks, conv) if tables is None else tables.get(kernel, chunk, num_chunks, conv)
    )


def append_history(history: torch.Tensor, z_t: torch.Tensor) -> torch.Tensor:
    """The last ``Lh`` inputs after ``z_t`` `(B, Ds)` joins ``history`` `(B, Ds, Lh)` (oldest first): amortised O(1).

    The returned history is a view of a buffer with slack after its end: a step writes the new input into the next
    free slot and moves the view by one, so the ``Lh`` inputs are copied only when the slack runs out (every
    ``max(64, Lh // 4)`` steps) instead of at every step. Earlier views stay valid (a step writes only beyond
    them). Out of place (a copy) where gradients flow or while tracing.
    """
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
    """``sin(freq * x)`` with a trainable per-feature frequency (shared by all sine layers of one filter)."""

    def __init__(self, dim: int, freq: float):
        super().__init__()
        self.init_freq = freq
        self.freq = nn.Parameter(torch.empty(dim, dtype=ssm_dtype()))

    def forward(self, x):
        return torch.sin(self.freq * x)


# Unstruct decoding in chunks of this many steps: once per chunk one FFT convolution gives the share of all earlier
# inputs in the chunk's outputs ([`UnstructFilter.pending_outputs`]); a step adds a dot product over the chunk's own
# inputs. 512 by measurement (~60M bst-unstruct at 64k context, 1 thread: mean 45.8 / 43.7 / 41.1 ms per token with
# M = 128 / 256 / 512 in one run; a chunk's FFTs cost ~250 ms per layer there, the direct part <= M is negligible).
# Mean over 1024 steps, 1k and 64k alternating: 38.8 / 42.6 / 41.6 / 44.6 ms per token (64k/1k 1.09).
UNSTRUCT_DECODE_CHUNK = 512


class UnstructFilter(nn.Module):
    """Hyena-style implicit long filter: ``h_t = exp(-alpha t) * FFN(PositionalFeatures(t))`` plus a bias (D term).

    The positional feature table (trainable, `(1, Lmax, emb_dim)`) and the time grid are tied to
    ``max_position_embeddings``: the filter has Lmax taps. Longer inputs see it as finite (taps at larger lags are
    zero: [`spectrum`] pads them, a decoding history keeps the last Lmax inputs).
    """

    def __init__(self, channels: int, out_channels: int, config):
        super().__init__()
        self.channels, self.out_channels = channels, out_channels
        self.max_len = config.max_position_embeddings
        self.emb_dim = config.unstruct_emb_dim
        self.bidirectional = config.bidirectional
        order = config.unstruct_order
        self.decay_target = config.unstruct_decay_target
        self.decay_fast, self.decay_slow = config.unstruct_decay_fast, config.unstruct_decay_slow
        width = out_channels * channels * (2 if self.bidirectional else 1)
        dtype = ssm_dtype()
        self.pos_emb = nn.Parameter(torch.empty(1, self.max_len, self.emb_dim, dtype=dtype))
        self.sin = Sin(order, config.unstruct_sin_freq)
        layers = [nn.Linear(self.emb_dim, order, dtype=dtype)]
        layers += [nn.Linear(order, order, dtype=dtype) for _ in range(config.unstruct_num_inner_mlps)]
        self.mlp = nn.ModuleList(layers)
        self.out = nn.Linear(order, width, bias=False, dtype=dtype)
        self.bias = nn.Parameter(torch.empty(out_channels, channels, dtype=dtype))
        # Steps per decoding chunk (M, at most Lmax): see [`pending_outputs`].
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
        """Filter taps for the first ``length`` lags: `(C, Ds, length)` (`(2, C, Ds, length)` if bidirectional)."""
        if length > self.max_len:
            raise ValueError(
                f"unstruct filters exist up to max_position_embeddings={self.max_len} tokens; got a sequence of "
                f"{length}. Use ssm_kind='s4' for longer contexts."
            )
        with _no_autocast(self.pos_emb.device.type):
            dtype = compute_dtype(self.pos_emb)
            # The MLP's layers are called as modules (an adapter on them, e.g. LoRA's "all-linear", runs), in their
            # weights' dtype: float32, as the model's SSM modules are kept.
            h = unstruct_filters(
                self.pos_emb[0, :length].to(dtype),
                [lambda x, layer=layer: layer(x.to(layer.weight.dtype)) for layer in self.mlp],
                lambda x: self.out(x.to(self.out.weight.dtype)),
                self.sin.freq,
                self.max_len,
                (self.decay_target, self.decay_fast, self.decay_slow),
                self.out_channels,
                self.channels,
            )
            return h if self.bidirectional else h[0]

    def taps(self, total: int):
        """The filter over ``total`` lags with the bias (D skip) folded into lag 0, and the backward filter of a
        bidirectional one (else None)."""
        # Lags beyond the filter length have no taps (callers keep real positions below max_len).
        h = self.filters(min(total, self.max_len))
        h = F.pad(h, (0, total - h.shape[-1]))
        bias = self.bias.to(h.dtype)
        if self.bidirectional:
            return fold_skip(h[0], bias), h[1]
        return fold_skip(h, bias), None

    def spectrum(self, total: int) -> torch.Tensor:
        """FFT (size 2 ``total``) of the filter over ``total`` lags, bias (D skip) included, for [`fft_conv`]."""
        forward, backward = self.taps(total)
        return causal_spectrum(forward) if backward is None else bidirectional_spectrum(forward, backward)

    def direct_conv(self, u: torch.Tensor) -> torch.Tensor:
        """The convolution of [`forward`] without an FFT ([`direct_causal_conv`]): the real-arithmetic form
        ([`use_real_arithmetic`], ONNX export). ``u`` `(B, Ds, L)` -> `(B, C, Ds, L)`."""
        forward, backward = self.taps(u.shape[-1])
        return direct_causal_conv(u, forward) if backward is None else direct_bidirectional_conv(u, forward, backward)

    def forward(self, z: torch.Tensor, history: torch.Tensor | None = None, tables=None) -> torch.Tensor:
        """``z`` `(B, L, Ds)` -> ``y`` `(B, L, C, Ds)`. ``history`` `(B, Ds, Lh)`: earlier inputs (continuation);
        ``tables`` (S4D's [`ChunkTables`]) unused."""
        with _no_autocast(z.device.type):
            dtype = compute_dtype(self.pos_emb)
            u = z.to(dtype).transpose(1, 2)  # (B, Ds, L)
            length = u.shape[-1]
            if history is not None:
                u = torch.cat([history.to(dtype), u], dim=-1)
            total = u.shape[-1]
            if use_real_arithmetic():
                y = self.direct_conv(u)
            else:
                spectrum = memoised_spectrum(self, (total, dtype), lambda: self.spectrum(total))
                y = fft_conv(u, spectrum)  # (B, C, Ds, L')
            y = y[..., -length:]
            return y.permute(0, 3, 1, 2)

    @staticmethod
    def reverse_taps(taps: torch.Tensor) -> torch.Tensor:
        """Taps `(C, Ds, Lh)` laid out for [`step`]: `(Ds, Lh, C)`, lag ``Lh - 1 - j`` at index ``j`` (oldest first,
        like the history), contiguous, so that a step is one batched matrix product over a suffix of it."""
        return taps.flip(-1).permute(1, 2, 0).contiguous()

    def output_at_newest(
        self,
        history: torch.Tensor,
        taps: torch.Tensor | None = None,
        seen: int | None = None,
        reversed_taps: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Output at the newest input of ``history`` `(B, Ds, Lh)` (newest last): `(B, C, Ds)`.

        One dot product with the history: ``y_t = sum_j h_j z_{t-j} + bias z_t``. ``seen`` (the most inputs any row
        has) limits it to the last ``seen`` entries, which hold everything non-zero: the cost is O(t), not O(Lh).
        ``taps`` (`(C, Ds, Lh)`, [`filters`]) or ``reversed_taps`` ([`reverse_taps`] of them, what a decoding cache
        keeps) skip recomputing the filter.
        """
        with _no_autocast(history.device.type):
            length = history.shape[-1]
            dtype = compute_dtype(self.pos_emb)
            if reversed_taps is None:
                reversed_taps = self.reverse_taps(taps if taps is not None else self.filters(length))
            n = length if seen is None else max(1, min(seen, length))
            # (Ds, B, n) @ (Ds, n, C): the newest n inputs against lags n-1 .. 0.
            y = torch.matmul(history[..., -n:].to(dtype).transpose(0, 1), reversed_taps[:, -n:].to(dtype))
            y = y.permute(1, 2, 0)  # (B, C, Ds)
            return y + self.bias.to(dtype) * history[:, None, :, -1].to(dtype)

    # -- chunked decoding: a step's cost independent of the position -----------------------------------------------
    def pending_fft_size(self, n: int) -> int:
        """FFT size for [`pending_outputs`] of ``n`` inputs: the smallest ``2^k``, ``5 * 2^(k-2)`` or ``3 * 2^(k-1)``
        >= ``n + M`` (no wrap-around; fast sizes with at most 25% padding above 4, few distinct sizes: the taps
        spectrum is memoised per size)."""
        need = n + self.decode_chunk
        power = 1 << (need - 1).bit_length()  # >= need
        return min(size for size in (power, power * 5 // 8, power * 3 // 4) if size >= need)

    def pending_spectrum(self, size: int, reversed_taps: torch.Tensor) -> torch.Tensor:
        """rFFT (``size`` points) of the taps at lags ``0 .. size - 1`` (none beyond Lmax) from their stepping layout
        ``reversed_taps`` `(Ds, Lmax, C)` ([`reverse_taps`]): `(C, Ds, size // 2 + 1)`."""
        with _no_autocast(reversed_taps.device.type):
            taps = reversed_taps.flip(1).permute(2, 0, 1)[..., :size]  # (C, Ds, min(Lmax, size)), lag order
            return torch.fft.rfft(taps.to(compute_dtype(self.pos_emb)), n=size)

    def pending_outputs(self, history: torch.Tensor, n: int, spectrum: torch.Tensor) -> torch.Tensor:
        """The share of the inputs in ``history`` `(B, Ds, Lh)` in the next M outputs: `(B, C, Ds, M)`.

        Entry k is ``sum_{j > k} h_j z_{t+k-j}`` for the k-th step after ``history`` (time t; lags beyond Lmax have
        no taps), so that output = entry k + a dot product over the k + 1 newest inputs ([`step`] with ``pending``).
        ``n``: the newest inputs that can be non-zero (the rest are skipped); ``spectrum``: [`pending_spectrum`] of
        size [`pending_fft_size`] ``(n)``. One circular convolution of that size: output index n + k reads the
        inputs at lags 1 .. n + M - 1 only, below the size, so nothing wraps around. O(n log n) once per M steps.
        """
        with _no_autocast(history.device.type):
            size = self.pending_fft_size(n)
            x = history[..., history.shape[-1] - n :].to(spectrum.real.dtype)  # (B, Ds, n)
            y = torch.fft.irfft(torch.fft.rfft(x, n=size).unsqueeze(1) * spectrum.unsqueeze(0), n=size)
            return y[..., n : n + self.decode_chunk].contiguous()

    # -- the recurrent contract shared with S4DKernel --------------------------------------------------------------
    def empty_state(self, batch_size: int, device) -> torch.Tensor:
        """An empty input history `(B, Ds, Lmax)` (zeros: no input yet)."""
        dtype = compute_dtype(self.pos_emb)
        return torch.zeros(batch_size, self.channels, self.max_len, dtype=dtype, device=device)

    def final_state(self, z: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """The input history after ``z`` `(B, L, Ds)` (rows right-aligned): the last ``Lmax`` inputs, `(B, Ds, Lmax)`."""
        hist = upcast_ssm(z, self.pos_emb).transpose(1, 2)
        if state is not None:
            hist = torch.cat([state.to(hist.dtype), hist], -1)
        if hist.shape[-1] < self.max_len:
            hist = F.pad(hist, (self.max_len - hist.shape[-1], 0))
        return hist[..., -self.max_len :].contiguous()

    def step_constants(self):
        """The taps laid out for stepping ([`reverse_taps`] of all ``Lmax`` of them)."""
        return self.reverse_taps(self.filters(self.max_len))

    def step(
        self,
        z_t: torch.Tensor,
        state: torch.Tensor,
        constants=None,
        seen: int | None = None,
        output: bool = True,
        pending: tuple[torch.Tensor, int] | None = None,
    ):
        """Recurrent form for one token: ``z_t`` `(B, Ds)` joins the history ``state`` `(B, Ds, Lmax)`; returns the
        output `(B, C, Ds)` (None when not ``output``: MF needs it only at block ends) and the new history.

        ``seen`` (inputs of the longest row, this one included) limits the dot product to the entries that can be
        non-zero: O(seen) per step. ``pending`` ``(buffer, k)``: this is step k (k < M) of a chunk whose
        [`pending_outputs`] ``buffer`` were computed from the history before its first step; the output is
        ``buffer[..., k]`` plus a dot product over the k + 1 newest inputs: O(M) per step."""
        history = append_history(state, z_t.to(state.dtype))
        if not output:
            return None, history
        if pending is not None:
            buffer, k = pending
            return buffer[..., k] + self.output_at_newest(history, seen=k + 1, reversed_taps=constants), history
        return self.output_at_newest(history, seen=seen, reversed_taps=constants), history

    def block_end_outputs(self, z: torch.Tensor, block_len: int, state: torch.Tensor | None = None, tables=None):
        """Outputs at the last token of every block: `(B, nb*W, Ds)` -> `(B, nb, C, Ds)`."""
        return self(z, state)[:, block_len - 1 :: block_len]


class PerFilterS4D(nn.Module):
    """MF with one SSM per filter: each of the S filters has its own ``(Lambda, B, dt)`` (and C, D), instead of S
    read-outs of one shared state. Same contract as [`S4DKernel`] (``forward``, ``final_state``, ``step``,
    ``block_end_outputs``: still the exact block-end fast path), computed by one S4D kernel over S * Ds channels that
    all read the same input; its state is `(B, S * Ds, N2)`.

    With a shared state of N/2 complex modes, the S outputs at a block end span at most N + 1 dimensions per
    channel; independent filters span S.
    """

    def __init__(self, channels: int, out_channels: int, state_size: int, config):
        super().__init__()
        self.channels, self.out_channels = channels, out_channels
        self.kernel = S4DKernel(out_channels * channels, 1, state_size, config)

    def _repeat(self, z: torch.Tensor) -> torch.Tensor:
        """`(..., Ds)` -> `(..., S * Ds)`: every filter reads the same input (filter-major, as ``_split`` expects)."""
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
