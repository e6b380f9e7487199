"""The pure tensor maths of the Block-State Transformer (torch only; the vLLM plugin loads this file too).

Complex numbers are real tensors: a pair ``(re, im)``, or a trailing dimension of 2 for a state. Shapes: B batch,
L length, C read-outs per SSM channel, Ds SSM channels, N2 complex modes, T chunk length (docs/architecture.md).
"""

import functools
import math

import torch
import torch.nn.functional as F


# -- norms, T5 buckets, masks ---------------------------------------------------------------------------------------
def upcast(x: torch.Tensor) -> torch.Tensor:
    """float32 for half-precision tensors, unchanged otherwise."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS norm with learned scale ``weight`` (``x * rsqrt(mean(x^2) + eps) * weight``), computed in at least float32
    by torch's ``rms_norm`` (one fused kernel where the device has one), returned in ``x``'s dtype."""
    x32 = upcast(x)
    return F.rms_norm(x32, (x32.shape[-1],), weight.to(x32.dtype), eps).to(x.dtype)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """``x`` divided by its L2 norm over the last dimension (``qk_norm``)."""
    return x * torch.rsqrt(upcast(x).pow(2).sum(-1, keepdim=True) + 1e-6).to(x.dtype)


def t5_relative_bucket(relative_position, bidirectional: bool, num_buckets: int, max_distance: int):
    """T5 bucket of ``key_pos - query_pos``: exact for small distances, log-spaced up to ``max_distance``."""
    bucket = torch.zeros_like(relative_position)
    n = -relative_position
    if bidirectional:
        num_buckets //= 2
        bucket = (n < 0).long() * num_buckets
        n = n.abs()
    else:
        n = n.clamp(min=0)
    max_exact = num_buckets // 2
    log_ratio = torch.log(n.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return bucket + torch.where(n < max_exact, n, large)


def masked_fill_value(dtype: torch.dtype) -> float:
    """The additive mask value of a hidden key: finite (a row with no key is zeroed afterwards)."""
    return torch.finfo(dtype).min


def additive_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``valid``, a large negative number elsewhere."""
    return torch.zeros(valid.shape, dtype=dtype, device=valid.device).masked_fill(~valid, masked_fill_value(dtype))


def window_valid(relative_position: torch.Tensor, block_len: int, attend_self: bool) -> torch.Tensor:
    """The block self-attention's window on ``key_pos - query_pos``: the W tokens before (or up to) the query."""
    if attend_self:
        return (relative_position <= 0) & (relative_position > -block_len)
    return (relative_position < 0) & (relative_position >= -block_len)


def context_valid(key_pos: torch.Tensor, query_pos: torch.Tensor, cross_mask: str) -> torch.Tensor:
    """SH/MH: whether the query at ``query_pos`` sees the context state at ``key_pos`` of its block."""
    return key_pos <= query_pos if cross_mask == "inclusive" else key_pos < query_pos


# -- complex numbers as real pairs, S4D (docs/architecture.md, "SSM maths") -------------------------------------------
def pair_mul(a, b):
    """Product of two complex numbers given as ``(re, im)`` pairs."""
    return a[0] * b[0] - a[1] * b[1], a[0] * b[1] + a[1] * b[0]


def pair_powers(log_a, exponents: torch.Tensor):
    """``exp(log_a[..., None] * exponents)`` as a ``(re, im)`` pair of `(Ds, N2, len)` tensors."""
    exponents = exponents.to(log_a[0].dtype)
    magnitude = torch.exp(log_a[0].unsqueeze(-1) * exponents)
    phase = log_a[1].unsqueeze(-1) * exponents
    return magnitude * torch.cos(phase), magnitude * torch.sin(phase)


def s4d_discretize(log_dt, a_log_real, a_imag, b, dtype: torch.dtype):
    """``(dt Lambda, Bbar)`` as ``(re, im)`` pairs of `(Ds, N2)` tensors in ``dtype``."""
    dt = torch.exp(log_dt.to(dtype)).unsqueeze(-1)
    lam = -torch.exp(a_log_real.to(dtype)), -a_imag.to(dtype)
    dt_a = lam[0] * dt, lam[1] * dt
    e = (
        torch.expm1(dt_a[0]) * torch.cos(dt_a[1]) - 2 * torch.sin(dt_a[1] / 2) ** 2,
        torch.exp(dt_a[0]) * torch.sin(dt_a[1]),
    )
    norm = lam[0] ** 2 + lam[1] ** 2
    ratio = (e[0] * lam[0] + e[1] * lam[1]) / norm, (e[1] * lam[0] - e[0] * lam[1]) / norm  # e / Lambda
    return dt_a, pair_mul(b.to(dtype).unbind(-1), ratio)


def _split_powers(dt_a, length: int, chunk: int, offset: int = 0):
    """``Abar^l``, ``l < length``, as ``(c, a, Abar^(0..c-1), Abar^(offset + c (0..a-1)))``, pairs of `(Ds, N2, .)`."""
    inner = max(1, min(chunk, length))
    outer = -(-length // inner)
    p_in = pair_powers(dt_a, torch.arange(inner, device=dt_a[0].device))
    return inner, outer, p_in, pair_powers(dt_a, offset + inner * torch.arange(outer, device=dt_a[0].device))


def s4d_vandermonde(c, x, dt_a, length: int, offset: int = 0, chunk: int = 64) -> torch.Tensor:
    """``2 Re sum_n C[c, h, n] x[..., h, n] Abar[h, n] ** (offset + l)`` for ``l < length`` -> `(..., C, Ds, length)`:
    the kernel for ``x = Bbar``, the free response of a state ``x`` `(B, Ds, N2)` for ``offset = 1`` (pairs)."""
    coeff = pair_mul(c.to(dt_a[0].dtype).unbind(-1), (x[0].unsqueeze(-3), x[1].unsqueeze(-3)))  # (..., C, Ds, N2)
    _, _, p_in, p_out = _split_powers(dt_a, length, chunk, offset)
    weighted = pair_mul((coeff[0].unsqueeze(-1), coeff[1].unsqueeze(-1)), p_out)  # (..., Ds, N2, a)
    out = torch.einsum("...hna,hnc->...hac", weighted[0], p_in[0]) - torch.einsum(
        "...hna,hnc->...hac", weighted[1], p_in[1]
    )  # (..., Ds, a, c)
    return 2 * out.flatten(-2)[..., :length]


def s4d_final_state(z: torch.Tensor, dt_a, b_bar, state: torch.Tensor | None = None, chunk: int = 64) -> torch.Tensor:
    """The state ``Abar^L x0 + sum_j Abar^(L-1-j) Bbar z_j`` `(B, Ds, N2, 2)` after inputs ``z`` `(B, L, Ds)`."""
    bsz, length, ds = z.shape
    inner, outer, p_in, p_out = _split_powers(dt_a, length, chunk)
    z_rev = F.pad(z.flip(1), (0, 0, 0, inner * outer - length))  # lag l = L-1-j first
    z_rev = z_rev.view(bsz, outer, inner, ds)  # (B, a, c, Ds)
    partial = torch.einsum("bach,hnc->bhna", z_rev, p_in[0]), torch.einsum("bach,hnc->bhna", z_rev, p_in[1])
    x = pair_mul(partial, p_out)
    x = pair_mul((x[0].sum(-1), x[1].sum(-1)), b_bar)  # (B, Ds, N2)
    if state is not None:
        decay = pair_powers(dt_a, torch.tensor([length], device=z.device))
        carried = pair_mul((decay[0][..., 0], decay[1][..., 0]), state.unbind(-1))
        x = x[0] + carried[0], x[1] + carried[1]
    return torch.stack(x, -1)


def s4d_step_constants(log_dt, a_log_real, a_imag, b, c, d, dtype: torch.dtype):
    """What [`s4d_step`] reads, in ``dtype``: ``Re Abar`` per pair, ``(-Im Abar, Im Abar)``, ``Bbar`` `(Ds, N2, 2)`,
    ``2 C`` conjugated and flattened over the pairs `(C, Ds, 2 N2)`, ``D``."""
    dt_a, b_bar = s4d_discretize(log_dt, a_log_real, a_imag, b, dtype)
    magnitude = torch.exp(dt_a[0])
    a_re, a_im = magnitude * torch.cos(dt_a[1]), magnitude * torch.sin(dt_a[1])
    c_conj = (c.to(dtype) * torch.tensor([2.0, -2.0], dtype=dtype, device=c.device)).flatten(-2)
    return a_re[..., None], torch.stack([-a_im, a_im], -1), torch.stack(b_bar, -1), c_conj, d.to(dtype)


def s4d_step(z_t: torch.Tensor, state: torch.Tensor, constants):
    """One token ``z_t`` `(B, Ds)` from a real ``state`` `(B, Ds, N/2, 2)` with [`s4d_step_constants`]: ``y_t``
    `(B, C, Ds)` and the new state. ``Abar x`` is ``x * (re, re) + swap(x) * (-im, im)`` on the stored pairs; the
    read-out ``Re(2 C x)`` is one product with ``2 C`` conjugated, contracted over the pairs."""
    a_re, a_rot, b_bar, c_conj, skip = constants
    x = torch.addcmul(state * a_re, state.flip(-1), a_rot)
    x = torch.addcmul(x, b_bar, z_t.view(*z_t.shape, 1, 1))
    y = torch.einsum("bhk,chk->bch", x.view(x.shape[0], x.shape[1], -1), c_conj)  # one bmm
    return torch.addcmul(y, skip, z_t.unsqueeze(1)), x


@functools.lru_cache(maxsize=256)
def chunk_exponents_layout(chunk: int, groups: int, conv: bool):
    """The exponent columns of [`s4d_chunk_tables`]: ``(exponents, log_mask, (readout offset, scan offset))``."""
    exps = [0.5, 1.0] + [float(t) for t in range(chunk - 1, -1, -1)]
    readout = len(exps)
    exps += [float(t) for t in range(chunk + 1 if conv else 1)]
    mask = [0.0] * len(exps)
    scan = len(exps)
    for step in (chunk, chunk * groups) if groups else ():
        exps += [0.0] * groups + [float(step * m) for m in range(groups + 1)]
        mask += [-math.inf] * groups + [0.0] * (groups + 1)
    return exps, mask, (readout, scan)


def chunk_groups(num_chunks: int) -> tuple[int, int]:
    """Chunks per group and groups of [`s4d_chunk_scan`]: about sqrt(nc) each; ``(0, 0)`` for one chunk."""
    if num_chunks <= 1:
        return 0, 0
    groups = math.isqrt(num_chunks - 1) + 1  # ceil(sqrt(nc))
    return groups, -(-num_chunks // groups)


def s4d_chunk_tables(params, exps: torch.Tensor, offsets, chunk: int, num_chunks: int, conv: bool = True):
    """The chunked form's tables ``(rw, g, *scan)`` from ``params`` ``(log_dt, A_log_real, A_imag, B, C, D)``."""
    log_dt, a_log_real, a_imag, b_param, c_param, d_param = params
    dtype = exps.dtype
    groups, num_groups = chunk_groups(num_chunks)
    readout, grid = offsets
    ds, modes = a_imag.shape
    out_channels = c_param.shape[0]
    neg_dt = -torch.exp(log_dt.to(dtype)).unsqueeze(-1)  # (Ds, 1)
    lam = torch.exp(a_log_real.to(dtype)), a_imag.to(dtype)  # -Lambda
    w = lam[0] * neg_dt, lam[1] * neg_dt  # dt Lambda = log Abar, (Ds, N2)
    # Abar^e for every exponent e: e^(e Re w) (cos(e Im w) + i sin(e Im w)), 0 where masked.
    magnitude = torch.exp(torch.addcmul(exps[1], w[0].unsqueeze(-1), exps[0]))  # (Ds, N2, E)
    phase = w[1].unsqueeze(-1) * exps[0]
    cos, sin = torch.cos(phase), torch.sin(phase)
    # (Ds, 2, 2, N2, E): the 2 x 2 real block [[re, -im], [im, re]] of every power.
    powers = (torch.stack([cos, -sin, sin, cos], 1) * magnitude.unsqueeze(1)).unflatten(1, (2, 2))
    # Column blocks by one split (one backward op)
    sizes = [2, readout - 2, grid - readout, powers.shape[-1] - grid]
    head, local, rows, grids = powers.split(sizes, -1)
    # Bbar = B expm1(dt Lambda) / Lambda; sin(b/2), cos b and e^a sin b are the table's columns 0 and 1.
    sin_half = sin[..., 0]
    e_re = torch.addcmul(torch.expm1(w[0]) * cos[..., 1], sin_half, sin_half, value=-2)
    e_im = head[:, 1, 0, :, 1]
    # expm1 / Lambda = -expm1 conj(-Lambda) / |Lambda|^2; times B, with the minus sign kept in ``b_re``.
    y_re = torch.addcmul(e_re * lam[0], e_im, lam[1])  # Re(expm1 conj(-Lambda))
    y_im = torch.addcmul(e_re * lam[1], e_im, lam[0], value=-1)  # -Im(expm1 conj(-Lambda))
    b = b_param.to(dtype).unbind(-1)
    b_re = torch.addcmul(b[0] * y_re, b[1], y_im)  # -|Lambda|^2 Re(Bbar)
    b_im = torch.addcmul(b[0] * y_im, b[1], y_re, value=-1)  # |Lambda|^2 Im(Bbar)
    norm = torch.addcmul(lam[0] * lam[0], lam[1], lam[1])  # |Lambda|^2
    # W = Bbar Abar^(T-1-j): (re, im) = Re(Bbar) (re, im)(A) + Im(Bbar) (-im, re)(A), the block's columns.
    local = local.unbind(2)  # block columns (Ds, 2, N2, T), exponents T-1 .. 0
    b_re, b_im, norm = b_re[:, None, :, None], b_im[:, None, :, None], norm[:, None, :, None]
    w_local = torch.addcmul(b_im * local[1], b_re, local[0], value=-1)  # |Lambda|^2 W
    w_local = (w_local / norm).permute(0, 3, 1, 2).reshape(ds, chunk, 2 * modes)  # (Ds, T, 2 N2)
    # Read-out rows for x = (re, im): Re(C) times the block's first row minus Im(C) times its second; used as 2 g.
    c_re, c_im = (c[:, :, None, :, None] for c in c_param.to(dtype).unbind(-1))  # (C, Ds, 1, N2, 1)
    rows = rows.unbind(1)  # block rows (Ds, 2, N2, T + 1 | 1): exponents 0 .. T
    g = torch.addcmul(c_re * rows[0], c_im, rows[1], value=-1)  # (C, Ds, 2, N2, T + 1)
    g0 = g[..., 0].permute(1, 2, 3, 0).reshape(ds, 2 * modes, out_channels)  # Re(C x)
    scan = ()
    if groups:
        # Both Toeplitz grids Abar^(s (i - j)), s = T | T * groups, as (Ds N2, 2, (j, p_in), (i, p_out)) in one copy
        blocks = grids.unflatten(-1, (2, 2 * groups + 1)).unfold(-1, groups + 1, 1).flip(-1)
        blocks = blocks.permute(0, 3, 4, 6, 2, 5, 1)
        in_group, across = blocks.reshape(ds * modes, 2, 2 * groups + 2, 2 * groups + 2).unbind(1)
        # row 0: the entering state to chunk i < groups; rows 1 .. groups: chunk j - 1 to the state entering chunk i
        carry, in_group = in_group.split([2, 2 * groups], 1)
        carry = carry[..., : 2 * groups]
        across = across[:, : 2 * num_groups, : 2 * num_groups]  # group j's end state to group i's start
        scan = in_group, carry, across
    if not conv:
        return w_local, g0, *scan
    # The first T lags of the kernel (+ D at lag 0), lag T-1-j at row j.
    skip = F.pad(d_param.to(dtype).t().unsqueeze(1), (0, 0, chunk - 1, 0))  # (Ds, T, C): D at lag 0
    k_rev = torch.baddbmm(skip, w_local, g0, alpha=2)  # (Ds, T, C)
    # Toeplitz rows by one unfold of the zero-padded lags: entry (j, T-1-t) is K[t-j] (0 for t < j).
    toeplitz = F.pad(k_rev, (0, 0, 0, chunk - 1)).unfold(1, chunk, 1).flip(-1)  # (Ds, T, C, T)
    rw = torch.cat([toeplitz.reshape(ds, chunk, out_channels * chunk), w_local], -1)
    g = g[..., 1:].permute(1, 2, 3, 0, 4).reshape(ds, 2 * modes, out_channels * chunk)
    return rw, g, *scan


def s4d_chunk_scan(local: torch.Tensor, state: torch.Tensor | None, scan, num_chunks: int, first: int = 0):
    """The states `(Ds, B * n, 2 N2)` entering chunks ``first ..`` from local end states and ``state``."""
    ds, bsz, n_in = local.shape[0], local.shape[1], local.shape[2]
    modes = local.shape[3] // 2
    if state is not None:
        state = state.to(local.dtype)  # (B, Ds, N2, 2)
    if not scan:  # one chunk: it starts from the given state
        x0 = state.permute(1, 0, 3, 2) if state is not None else local.new_zeros(ds, bsz, 2, modes)
        return x0.reshape(ds, bsz, 2 * modes)
    in_group, carry, across = scan
    groups, num_groups = in_group.shape[1] // 2, across.shape[1] // 2
    # (Ds N2, B * groups', (j, p)): chunk-major within a group, p = re, im last
    v = local.view(ds, bsz, n_in, 2, modes).permute(0, 4, 1, 2, 3)
    if n_in < groups * num_groups:
        v = F.pad(v, (0, 0, 0, groups * num_groups - n_in))
    x = torch.bmm(v.reshape(ds * modes, bsz * num_groups, 2 * groups), in_group)  # (.., (i <= groups, p))
    if num_groups > 1 or state is not None:
        ends = x.view(ds * modes, bsz, num_groups, groups + 1, 2)[:, :, : num_groups - 1, groups]
        if state is None:
            entering = F.pad(ends, (0, 0, 1, 0))  # (Ds N2, B, groups, 2): zero before the first group
        else:
            entering = torch.cat([state.permute(1, 2, 0, 3).reshape(ds * modes, bsz, 1, 2), ends], 2)
        entering = torch.bmm(entering.view(ds * modes, bsz, 2 * num_groups), across)  # (Ds N2, B, (G, p))
        x = torch.baddbmm(x[..., : 2 * groups], entering.view(ds * modes, bsz * num_groups, 2), carry)
    # (Ds, N2, B, chunks, 2) -> (Ds, B * n, 2 N2)
    x = x.view(ds, modes, bsz, -1, 2)[:, :, :, first:num_chunks]
    return x.permute(0, 2, 3, 4, 1).reshape(ds, bsz * (num_chunks - first), 2 * modes)


def s4d_chunked_forward(z: torch.Tensor, chunk: int, tables, state: torch.Tensor | None = None) -> torch.Tensor:
    """The S4D outputs `(B, L, C, Ds)` of ``z`` `(B, L, Ds)` from ``state`` (None: zero), chunk by chunk."""
    bsz, length, ds = z.shape
    nc = -(-length // chunk)
    if nc * chunk != length:
        z = F.pad(z, (0, 0, 0, nc * chunk - length))  # causal: zeros at the end change no earlier output
    rw, g, *scan = tables
    out_channels = g.shape[-1] // chunk
    u = z.view(bsz * nc, chunk, ds).permute(2, 0, 1)  # (Ds, B*nc, T)
    out = torch.bmm(u, rw)  # (Ds, B*nc, C*T + 2 N2): within-chunk outputs, local end states
    width = out_channels * chunk
    y = out[..., :width]
    if nc > 1 or state is not None:
        x0 = s4d_chunk_scan(out[..., width:].view(ds, bsz, nc, -1), state, scan, nc)
        y = torch.baddbmm(y, x0, g, alpha=2)  # + the free response of every chunk
    y = y.view(ds, bsz, nc, out_channels, chunk).permute(1, 2, 4, 3, 0)
    return y.reshape(bsz, nc * chunk, out_channels, ds)[:, :length]


def direct_causal_conv(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Causal convolution of ``u`` `(B, Ds, L)` with ``k`` `(C, Ds, L)` by ``conv1d`` -> `(B, C, Ds, L)`."""
    out_channels, channels, length = k.shape
    weight = k.flip(-1).transpose(0, 1).reshape(channels * out_channels, 1, length)  # channel-major groups
    y = F.conv1d(F.pad(u, (length - 1, 0)), weight, groups=channels)  # (B, Ds * C, L)
    return y.view(u.shape[0], channels, out_channels, length).transpose(1, 2)


def fold_skip(k: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """``k`` `(C, Ds, L)` with ``skip`` `(C, Ds)` added to its lag-0 tap (the D skip in the convolution)."""
    return torch.cat([k[..., :1] + skip.unsqueeze(-1), k[..., 1:]], -1)


def causal_spectrum(k: torch.Tensor) -> torch.Tensor:
    """Spectrum of a causal kernel ``k`` `(C, Ds, L)` for [`spectrum_conv`]: its rFFT of size 2L, `(C, Ds, L+1)`."""
    return torch.fft.rfft(k, n=2 * k.shape[-1])


def spectrum_conv(u: torch.Tensor, k_f: torch.Tensor) -> torch.Tensor:
    """Convolution of ``u`` `(B, Ds, L)` with a kernel's size-2L spectrum ``k_f`` `(C, Ds, L+1)` -> `(B, C, Ds, L)`."""
    length = u.shape[-1]
    u_f = torch.fft.rfft(u, n=2 * length)  # (B, Ds, L+1)
    return torch.fft.irfft(u_f.unsqueeze(1) * k_f.unsqueeze(0), n=2 * length)[..., :length]


def unstruct_filters(features, layers, out, freq, max_len: int, decay, out_channels: int, channels: int):
    """Unstruct taps ``h_t = exp(-delta t) * FFN(features_t)`` `(K, C, Ds, L)` (K = 2 two-sided)."""
    dtype = features.dtype
    h = features
    for layer in layers:
        h = torch.sin(freq.to(dtype) * layer(h).to(dtype))
    h = out(h).to(dtype)  # (L, width)
    length, width = h.shape
    t = torch.arange(length, device=h.device, dtype=dtype)[:, None] / max(max_len - 1, 1)
    target, fast, slow = decay
    low, high = math.log(target) / slow, math.log(target) / fast
    deltas = torch.linspace(low, high, width, device=h.device, dtype=dtype).abs()
    return (h * torch.exp(-t * deltas)).t().reshape(-1, out_channels, channels, length)


def gated_state_update(state: torch.Tensor, update: torch.Tensor, gate_bias: torch.Tensor) -> torch.Tensor:
    """Block-Recurrent fixed gate: ``g * state + (1 - g) * update``, ``g = sigmoid(gate_bias)``."""
    gate = torch.sigmoid(upcast(gate_bias)).to(state.dtype)
    return gate * state + (1 - gate) * update.to(state.dtype)
