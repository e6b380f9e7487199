"""Slow reference implementations, written from the maths (docs: bst-algorithms.md sections 1.3, 3, 5.5).

Nothing here calls the package's fast paths (FFT convolutions, Vandermonde products, batched block attention):
only raw parameter tensors are read, and everything is computed with explicit loops in float64.
"""

import cmath
import math

import torch
import torch.nn.functional as F

from modeling_bst.ssm_bst import _no_autocast, compute_dtype, fft_conv


# -- S4D ---------------------------------------------------------------------------------------------------------


def s4d_discretize_reference(log_dt, a_log_real, a_imag, b):
    """ZOH discretisation of one diagonal SSM from its raw parameters, element by element with ``cmath``.

    ``Lambda = -exp(A_log_real) - i A_imag``, ``Abar = exp(dt Lambda)``, ``Bbar = (Abar - 1) / Lambda * B``.
    Returns complex128 ``(Abar, Bbar)`` of shape `(Ds, N2)`.
    """
    ds, n2 = a_log_real.shape
    a_bar = torch.zeros(ds, n2, dtype=torch.complex128)
    b_bar = torch.zeros(ds, n2, dtype=torch.complex128)
    for h in range(ds):
        dt = math.exp(float(log_dt[h]))
        for n in range(n2):
            lam = complex(-math.exp(float(a_log_real[h, n])), -float(a_imag[h, n]))
            ab = cmath.exp(dt * lam)
            a_bar[h, n] = ab
            b_bar[h, n] = (ab - 1) / lam * complex(float(b[h, n, 0]), float(b[h, n, 1]))
    return a_bar, b_bar


def s4d_params(kernel):
    """Raw float64 parameters of an ``S4DKernel`` (read only; no method of the module is called)."""
    c = kernel.C.detach().double()
    return dict(
        a_bar_b_bar=s4d_discretize_reference(
            kernel.log_dt.detach().double(),
            kernel.A_log_real.detach().double(),
            kernel.A_imag.detach().double(),
            kernel.B.detach().double(),
        ),
        C=torch.complex(c[..., 0], c[..., 1]),  # (C, Ds, N2)
        D=kernel.D.detach().double(),  # (C, Ds)
    )


def s4d_kernel_bruteforce(kernel, length: int) -> torch.Tensor:
    """``K[c, h, l] = 2 Re(sum_n C[c, h, n] Abar[h, n]^l Bbar[h, n])`` by repeated multiplication: `(C, Ds, L)` f64."""
    p = s4d_params(kernel)
    a_bar, b_bar = p["a_bar_b_bar"]
    c = p["C"]
    out = torch.zeros(c.shape[0], c.shape[1], length, dtype=torch.float64)
    power = torch.ones_like(a_bar)  # Abar^0
    for step in range(length):
        out[..., step] = 2 * (c * (power * b_bar)[None]).sum(-1).real
        power = power * a_bar
    return out


def s4d_recurrence(kernel, z: torch.Tensor, state: torch.Tensor | None = None):
    """Per-token loop ``x_t = Abar x_{t-1} + Bbar z_t``, ``y_t = 2 Re(C x_t) + D z_t`` in float64.

    ``z`` `(B, L, Ds)`, ``state`` or None -> ``y`` `(B, L, C, Ds)`, final state; states as the model keeps them,
    complex modes as real pairs `(B, Ds, N2, 2)` (complex128 within the loop).
    """
    p = s4d_params(kernel)
    a_bar, b_bar = p["a_bar_b_bar"]
    c, d = p["C"], p["D"]
    z = z.detach().double()
    bsz, length, ds = z.shape
    x = torch.zeros(bsz, ds, a_bar.shape[1], dtype=torch.complex128)
    if state is not None:
        x = x + torch.complex(*state.detach().double().unbind(-1))
    ys = []
    for t in range(length):
        x = a_bar[None] * x + b_bar[None] * z[:, t, :, None]
        y = 2 * torch.einsum("chn,bhn->bch", c, x).real + d[None] * z[:, t, None, :]
        ys.append(y)
    return torch.stack(ys, 1), torch.view_as_real(x)


# -- convolutions --------------------------------------------------------------------------------------------------


def direct_causal_conv(u: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """O(L^2) ``y[b, c, h, t] = sum_{j<=t} k[c, h, j] u[b, h, t-j]``. ``u`` `(B, Ds, L)`, ``k`` `(C, Ds, L)`."""
    length = u.shape[-1]
    y = torch.zeros(u.shape[0], k.shape[0], u.shape[1], length, dtype=torch.float64)
    u64, k64 = u.double(), k.double()
    for t in range(length):
        for j in range(t + 1):
            y[..., t] += k64[None, :, :, j] * u64[:, None, :, t - j]
    return y


def two_sided_conv(u: torch.Tensor, k_fwd: torch.Tensor, k_bwd: torch.Tensor) -> torch.Tensor:
    """Explicit ``y_t = sum_{j=0}^{t} k_fwd[j] u[t-j] + sum_{j=1}^{L-1-t} k_bwd[j-1] u[t+j]`` (bst-algorithms §3.5)."""
    length = u.shape[-1]
    y = torch.zeros(u.shape[0], k_fwd.shape[0], u.shape[1], length, dtype=torch.float64)
    u64, kf, kb = u.double(), k_fwd.double(), k_bwd.double()
    for t in range(length):
        for j in range(t + 1):
            y[..., t] += kf[None, :, :, j] * u64[:, None, :, t - j]
        for j in range(1, length - t):
            y[..., t] += kb[None, :, :, j - 1] * u64[:, None, :, t + j]
    return y


# -- block self-attention ----------------------------------------------------------------------------------------


def t5_bucket_reference(query_pos: int, key_pos: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5 relative-position bucket with plain Python integers and ``math.log``."""
    n = query_pos - key_pos  # > 0: key in the past
    offset = 0
    if bidirectional:
        num_buckets //= 2
        if n < 0:
            offset = num_buckets
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return offset + n
    large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return offset + min(large, num_buckets - 1)


def block_self_attention_reference(layer, xn: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """One layer's block self-attention (before the output projection), one block and one query at a time.

    Causal: the query at ``t`` in block ``b`` sees exactly the W previous tokens ``t-W .. t-1`` (``attend_self``:
    ``t-W+1 .. t``) that exist (the first block has no previous block). Bidirectional: every real token of blocks
    ``b-1, b, b+1``. Logits ``(q.k + bias) * scale`` with L2-normalised q, k (``qk_norm``); a query without any key
    outputs zero. ``xn`` `(B, T, D)` is the normalised layer input; returns `(B, T, H * d_h)` float64.
    """
    cfg = layer.config
    heads, hd, w = cfg.num_attention_heads, cfg.head_dim, cfg.block_len
    bsz, seq, _ = xn.shape
    length = seq if length is None else length
    xn = xn.detach().double()

    def proj(linear):
        return (xn @ linear.weight.detach().double().t()).view(bsz, seq, heads, hd)

    q, k, v = proj(layer.self_attn.q_proj), proj(layer.self_attn.k_proj), proj(layer.self_attn.v_proj)
    if cfg.qk_norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    table = layer.self_attn.relative_bias.weight.detach().double()  # (buckets, H)
    scale = layer.self_attn.scale.detach().double()
    out = torch.zeros(bsz, seq, heads, hd, dtype=torch.float64)
    num_blocks = -(-length // w)
    for b in range(num_blocks):
        for i in range(w):
            t = b * w + i
            if t >= length:
                break
            if cfg.bidirectional:
                keys = [j for j in range((b - 1) * w, (b + 2) * w) if 0 <= j < length]
            elif cfg.attend_self:
                keys = [j for j in range(t - w + 1, t + 1) if j >= 0]
            else:
                keys = [j for j in range(t - w, t) if j >= 0]
            if not keys:
                continue
            for h in range(heads):
                logits = []
                for j in keys:
                    bucket = t5_bucket_reference(
                        t,
                        j,
                        cfg.bidirectional,
                        cfg.relative_attention_num_buckets,
                        cfg.relative_attention_max_distance,
                    )
                    logits.append(((q[:, t, h] * k[:, j, h]).sum(-1) + table[bucket, h]) * scale[h])
                p = torch.softmax(torch.stack(logits, -1), -1)  # (B, K)
                out[:, t, h] = (p[..., None] * v[:, keys, h]).sum(1)
    return out.reshape(bsz, seq, heads * hd)


# -- S4D's complex chunked forms (the training path before issue #44): references of the real ones ----------------


# -- S4D in complex arithmetic: the model computes the same maps in real arithmetic (functional_bst) -----------------


def vandermonde_powers(log_a: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """``exp(log_a[..., None] * exponents)``: powers of the diagonal state matrix. `(Ds, N2)` -> `(Ds, N2, len)`."""
    arg = log_a.unsqueeze(-1) * exponents.to(log_a.real.dtype)
    return torch.polar(torch.exp(arg.real), arg.imag)


def as_complex(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Complex tensor from a real `(..., 2)` parameter, in fresh memory."""
    param = param.to(dtype)
    return torch.complex(param[..., 0], param[..., 1])


def complex_discretize(kernel):
    """``(dt Lambda, Bbar)`` of an ``S4DKernel`` as complex `(Ds, N2)` tensors (zero-order hold)."""
    dtype = compute_dtype(kernel.log_dt)
    lam = torch.complex(-torch.exp(kernel.A_log_real.to(dtype)), -kernel.A_imag.to(dtype))
    dt_a = lam * torch.exp(kernel.log_dt.to(dtype)).unsqueeze(-1)  # (Ds, N2)
    return dt_a, as_complex(kernel.B, dtype) * torch.expm1(dt_a) / lam


def output_matrix(kernel, backward: bool = False) -> torch.Tensor:
    param = kernel.C_backward if backward else kernel.C
    return as_complex(param, compute_dtype(param))  # (C, Ds, N2)


def complex_vandermonde(coeff: torch.Tensor, log_a: torch.Tensor, length: int, offset: int = 0) -> torch.Tensor:
    """``sum_n coeff[..., h, n] * exp(log_a[h, n]) ** (offset + l)`` for ``l < length``: complex `(..., Ds, length)`."""
    powers = vandermonde_powers(log_a, offset + torch.arange(length, device=log_a.device))  # (Ds, N2, L)
    return torch.einsum("...hn,hnl->...hl", coeff, powers)


def complex_kernel(kernel, length: int, backward: bool = False) -> torch.Tensor:
    """``K[c, h, l] = 2 Re(sum_n C Bbar Abar^l)`` `(C, Ds, length)`."""
    dt_a, d_b = complex_discretize(kernel)
    return 2 * complex_vandermonde(output_matrix(kernel, backward) * d_b, dt_a, length).real


def complex_forward(kernel, z: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
    """The full-sequence S4D outputs `(B, L, C, Ds)` (causal): a direct convolution with [`complex_kernel`], D skip,
    and the free response ``2 Re(C Abar^(t+1) x0)`` of a complex ``state``."""
    z = z.to(compute_dtype(kernel.log_dt))
    length = z.shape[1]
    y = direct_causal_conv(z.transpose(1, 2), complex_kernel(kernel, length))  # (B, C, Ds, L)
    y = y + kernel.D.to(z.dtype)[None, :, :, None] * z.transpose(1, 2)[:, None]
    if state is not None:
        dt_a, _ = complex_discretize(kernel)
        coeff = output_matrix(kernel)[None] * state[:, None]  # (B, C, Ds, N2)
        y = y + 2 * complex_vandermonde(coeff, dt_a, length, offset=1).real
    return y.permute(0, 3, 1, 2)


def complex_final_state(kernel, z: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
    """``Abar^L x0 + sum_j Abar^(L-1-j) Bbar z_j``: complex `(B, Ds, N2)`."""
    z = z.to(compute_dtype(kernel.log_dt))
    length = z.shape[1]
    dt_a, d_b = complex_discretize(kernel)
    powers = vandermonde_powers(dt_a, torch.arange(length - 1, -1, -1, device=z.device))  # (Ds, N2, L)
    out = torch.einsum("blh,hnl->bhn", z.to(powers.dtype), powers) * d_b
    return out if state is None else out + torch.exp(dt_a * length) * state


def complex_step(kernel, z_t: torch.Tensor, state: torch.Tensor):
    """One token with a complex state: ``x = Abar x + Bbar z``, ``y = 2 Re(C x) + D z``."""
    z_t = z_t.to(compute_dtype(kernel.log_dt))
    dt_a, d_b = complex_discretize(kernel)
    state = torch.exp(dt_a) * state + d_b * z_t.unsqueeze(-1)
    y = 2 * torch.einsum("chn,bhn->bch", output_matrix(kernel), state).real
    return y + kernel.D.to(z_t.dtype) * z_t.unsqueeze(1), state


def stacked_states(x0: torch.Tensor) -> torch.Tensor:
    """Complex chunk-start states `(B, n, Ds, N2)` as real `(Ds, B * n, 2 N2)` (real parts, then imaginary), the
    left operand of the free-response matmul against [`chunk_constants`]' read-out."""
    bsz, n, ds, modes = x0.shape
    return torch.cat([x0.real, x0.imag], -1).permute(2, 0, 1, 3).reshape(ds, bsz * n, 2 * modes)


def complex_chunked_forward(kernel, z: torch.Tensor, chunk: int, state: torch.Tensor | None = None):
    """[`chunked_forward`] with complex states and an FFT within chunks (the earlier training path; a reference
    for tests): the same outputs.

    Within a chunk of ``chunk`` tokens the output is the convolution with the first ``chunk`` lags of the
    kernel (one FFT conv over all chunks at once); what earlier chunks contribute is the free response to the
    state at the chunk's start, ``2 Re(C Abar^{j+1} x_start)`` for offset j, with the chunk-start states from
    the block scan of [`block_states`]. Exact: equal to the whole-length convolution up to rounding.
    ``z`` `(B, L, Ds)` in the compute dtype -> `(B, L, C, Ds)`.
    """
    bsz, length, ds = z.shape
    nc = -(-length // chunk)
    z = F.pad(z, (0, 0, 0, nc * chunk - length))  # causal: zeros at the end change no earlier output
    u = z.view(bsz * nc, chunk, ds).transpose(1, 2)  # (B*nc, Ds, T)
    spectrum, readout = chunk_constants(kernel, chunk)
    y = fft_conv(u, spectrum).view(bsz, nc, kernel.out_channels, ds, chunk)  # within each chunk
    if nc > 1 or state is not None:
        x0 = complex_chunk_start_states(kernel, z, chunk, state)
        xs = stacked_states(x0)  # (Ds, B*nc, 2 N2)
        free = 2 * torch.bmm(xs, readout)  # (Ds, B*nc, C*T): the free response of every chunk
        y = y + free.view(ds, bsz, nc, kernel.out_channels, chunk).permute(1, 2, 3, 0, 4)
    return y.permute(0, 1, 4, 2, 3).reshape(bsz, nc * chunk, kernel.out_channels, ds)[:, :length]


def complex_state(state: torch.Tensor | None) -> torch.Tensor | None:
    """A model's S4D state (complex modes as real pairs `(B, Ds, N2, 2)`) as complex `(B, Ds, N2)`."""
    return None if state is None or state.is_complex() else torch.complex(*state.unbind(-1))


def complex_chunk_start_states(kernel, z: torch.Tensor, chunk: int, state: torch.Tensor | None = None):
    """The states entering every chunk of ``chunk`` tokens as complex numbers: the given ``state`` (or zero), then
    the chunk-end states of [`block_states`]. ``z`` `(B, nc * chunk, Ds)` (compute dtype) -> `(B, nc, Ds, N2)`."""
    with _no_autocast(z.device.type):
        dt_a, d_b = complex_discretize(kernel)
        bsz, nc = z.shape[0], z.shape[1] // chunk
        state = complex_state(state)
        x0 = (state if state is not None else torch.zeros_like(d_b).expand(bsz, -1, -1)).unsqueeze(1)
        if nc > 1:
            x0 = torch.cat([x0, block_states(kernel, z[:, : (nc - 1) * chunk], chunk, dt_a, d_b, state)], 1)
        return x0


def chunk_constants(kernel, chunk: int):
    """What [`chunked_forward`] needs from the parameters: the spectrum of the first ``chunk`` lags (D skip
    included) and the free-response read-out ``G[c, s, n, j] = C[c, s, n] Abar[s, n]^(j+1)`` laid out for a real
    batched matmul, `(Ds, 2 N2, C * chunk)` (``Re(G x) = Re(G) Re(x) - Im(G) Im(x)``)."""
    dt_a, _ = complex_discretize(kernel)
    powers = vandermonde_powers(dt_a, torch.arange(1, chunk + 1, device=dt_a.device))  # (Ds, N2, T)
    g = output_matrix(kernel).unsqueeze(-1) * powers  # (C, Ds, N2, T)
    g = torch.cat([g.real, -g.imag], 2).permute(1, 2, 0, 3).reshape(kernel.channels, 2 * kernel.n_modes, -1)
    return kernel.spectrum(chunk), g


def block_states(kernel, z: torch.Tensor, block_len: int, dt_a, d_b, state: torch.Tensor | None = None):
    """States after the last token of every block: ``z`` `(B, nb*W, Ds)` (compute dtype) -> `(B, nb, Ds, N2)`.

    Local block states from a per-block Vandermonde product, then a log-depth scan over blocks (``state``, if
    given, is the state before the first token)."""
    bsz, length, _ = z.shape
    nb = length // block_len
    powers = vandermonde_powers(dt_a, torch.arange(block_len - 1, -1, -1, device=z.device))  # (Ds, N2, W)
    # Local block states sum_w Abar^(W-1-w) z_w as one real batched matmul over channels (a complex einsum
    # would promote z to complex and copy every channel slice): (Ds, B*nb, W) @ (Ds, W, 2*N2).
    zt = z.reshape(bsz * nb, block_len, kernel.channels).permute(2, 0, 1)
    pw = torch.view_as_real(powers).permute(0, 2, 1, 3).reshape(kernel.channels, block_len, 2 * kernel.n_modes)
    x = torch.view_as_complex(torch.bmm(zt, pw).view(kernel.channels, bsz * nb, kernel.n_modes, 2))
    x = x.permute(1, 0, 2).reshape(bsz, nb, kernel.channels, kernel.n_modes) * d_b  # (B, nb, Ds, N2)
    if state is not None:
        x = torch.cat([x[:, :1] + (torch.exp(dt_a * block_len) * state).unsqueeze(1), x[:, 1:]], 1)
    # Hillis-Steele scan: x_b <- x_b + Abar^{dW} x_{b-d} for d = 1, 2, 4, ...
    decay = torch.exp(dt_a * block_len)
    shift = 1
    while shift < nb:
        x = torch.cat([x[:, :shift], x[:, shift:] + decay * x[:, :-shift]], 1)
        decay = decay * decay
        shift *= 2
    return x


def complex_block_end_outputs(kernel, z: torch.Tensor, block_len: int, state: torch.Tensor | None = None):
    """[`block_end_outputs`] with complex states and the log-depth scan of [`block_states`] (a reference)."""
    with _no_autocast(z.device.type):
        z = z.to(compute_dtype(kernel.log_dt))
        dt_a, d_b = complex_discretize(kernel)
        x = block_states(kernel, z, block_len, dt_a, d_b, complex_state(state))
        y = 2 * torch.einsum("chn,bkhn->bkch", output_matrix(kernel), x).real
        z_end = z[:, block_len - 1 :: block_len]  # (B, nb, Ds)
        return y + kernel.D.to(z.dtype)[None, None] * z_end.unsqueeze(2)
