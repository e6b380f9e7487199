"""Slow reference implementations, written from the maths (docs: bst-algorithms.md sections 1.3, 3, 5.5).

Nothing here calls the package's fast paths (FFT convolutions, Vandermonde products, batched block attention):
only raw parameter tensors are read, and everything is computed with explicit loops in float64.
"""

import cmath
import math

import torch


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

    ``z`` `(B, L, Ds)`, ``state`` `(B, Ds, N2)` complex or None -> ``y`` `(B, L, C, Ds)`, final state `(B, Ds, N2)`.
    """
    p = s4d_params(kernel)
    a_bar, b_bar = p["a_bar_b_bar"]
    c, d = p["C"], p["D"]
    z = z.detach().double()
    bsz, length, ds = z.shape
    x = torch.zeros(bsz, ds, a_bar.shape[1], dtype=torch.complex128)
    if state is not None:
        x = x + state.detach().to(torch.complex128)
    ys = []
    for t in range(length):
        x = a_bar[None] * x + b_bar[None] * z[:, t, :, None]
        y = 2 * torch.einsum("chn,bhn->bch", c, x).real + d[None] * z[:, t, None, :]
        ys.append(y)
    return torch.stack(ys, 1), x


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
