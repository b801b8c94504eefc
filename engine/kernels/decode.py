"""One decode step of a transformer layer in a single compiled call: the fast path for one new token.

The per-op path (engine/layer.py `run_layer` on kernels/prompt_ops.py) runs each small operation -- norm, rope,
attention over the cache, SwiGLU -- as separate calls, a few microseconds of dispatch each; at one token per
call that overhead, some 300 calls a token, costs as much as the matrix products themselves. `layer` does the
same arithmetic for any family's layer in one call, the layer's LayerSpec passed as named arguments (norm kind,
q/k norms, post-norms, FFN kind, RoPE, attention scale, sliding window, soft-cap; one_token.py builds them),
with the same products as the kernel layer (packed.py for the quantized types, floats.py for F16 and BF16), so
a token costs n_layer calls into compiled code.

A weight is passed as a tuple: (q, s, format tag) when packed, (w, bf16) when 16-bit floats; `product` picks the
kernel from the tuple's type when the layer is compiled, so a layer is compiled for its weights' formats.

Numerics follow the per-op path: q, k, v rounded to float16 values (llama.cpp's F16 KV cache), packed products on
activations quantized to int8 per 32. Attention sums in a different order than BLAS, so results agree with
the reference to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ..formats.fields import ROWS
from . import floats, packed
from .attention import attend_one, float_to_half, geglu_row, half_to_float, store_cache_row, swiglu_row

# FFN kinds, as `layer` takes them (engine/layer.py DenseFfn.activation names them).
FFN_KINDS = {"swiglu": 0, "geglu": 1, "gelu": 2}


@njit(cache=True, nogil=True)
def round_to_half(a):
    """a (n,) float32, in place: each value rounded to the nearest float16 value (ties to even), as float32."""
    for i in range(a.shape[0]):
        a[i] = half_to_float(float_to_half(a[i]))


@njit(cache=True, nogil=True)
def rms_norm(x, w, eps, out):
    """out (d,) = x / sqrt(mean(x²) + eps) * w, the sum of squares in float64."""
    ss = 0.0
    for i in range(x.shape[0]):
        ss += np.float64(x[i]) * np.float64(x[i])
    scale = np.float32(1.0 / np.sqrt(ss / x.shape[0] + eps))
    for i in range(x.shape[0]):
        out[i] = x[i] * scale * w[i]


@njit(cache=True, nogil=True)
def layer_norm(x, w, b, eps, out):
    """out (d,) = (x - mean) / sqrt(var + eps) * w + b, the sums in float64."""
    d = x.shape[0]
    mu = 0.0
    for i in range(d):
        mu += np.float64(x[i])
    mu /= d
    ss = 0.0
    for i in range(d):
        c = np.float64(x[i]) - mu
        ss += c * c
    scale = np.float32(1.0 / np.sqrt(ss / d + eps))
    m32 = np.float32(mu)
    for i in range(d):
        out[i] = (x[i] - m32) * scale * w[i] + b[i]


@njit(cache=True, nogil=True)
def head_norms(x, n_heads, head_dim, w, eps):
    """RMSNorm of each head of x (n_heads·head_dim,) in place, weight w (head_dim,): the q/k norm."""
    for h in range(n_heads):
        part = x[h * head_dim : (h + 1) * head_dim]
        rms_norm(part, w, eps, part)


@njit(cache=True, nogil=True, fastmath={"contract"})
def gelu_tanh(g):
    """GELU, tanh form, in float32: model.gelu's formula (the ungated FFN's)."""
    return (
        np.float32(0.5)
        * g
        * (np.float32(1.0) + np.tanh(np.float32(0.7978845608) * (g + np.float32(0.044715) * g * g * g)))
    )


@njit(cache=True, nogil=True)
def rope(x, n_heads, head_dim, rope_dim, cos, sin, neox):
    """Rotate the leading rope_dim dims of each head of x (n_heads·head_dim,) in place; cos, sin (rope_dim/2,)."""
    half = rope_dim // 2
    for h in range(n_heads):
        base = h * head_dim
        for i in range(half):
            if neox:  # pairs (i, i + half)
                j0, j1 = base + i, base + i + half
            else:  # adjacent pairs (2i, 2i + 1)
                j0, j1 = base + 2 * i, base + 2 * i + 1
            x0, x1 = x[j0], x[j1]
            x[j0] = x0 * cos[i] - x1 * sin[i]
            x[j1] = x0 * sin[i] + x1 * cos[i]


@njit(parallel=True, cache=True, nogil=True)
def rms_norm_rows(x, w, eps, out):
    """out (t, d) = each row of x (t, d) through `rms_norm`: a prompt normalized as `layer` normalizes a token."""
    for i in prange(x.shape[0]):
        rms_norm(x[i], w, eps, out[i])


@njit(parallel=True, cache=True, nogil=True)
def layer_norm_rows(x, w, b, eps, out):
    """out (t, d) = each row of x (t, d) through `layer_norm`, as `layer` normalizes a token."""
    for i in prange(x.shape[0]):
        layer_norm(x[i], w, b, eps, out[i])


@njit(parallel=True, cache=True, nogil=True)
def gelu_rows(x):
    """x (t, n) in place through `gelu_tanh`, as `layer` applies the ungated FFN's activation to a token."""
    for i in prange(x.shape[0]):
        for j in range(x.shape[1]):
            x[i, j] = gelu_tanh(x[i, j])


@njit(parallel=True, cache=True, nogil=True)
def rope_into_cache(q, k, v, start, cos, sin, shape, kc, vc):
    """A prompt's q, k, v as `layer` treats one token's, row i at position start + i.

    q (t, n_head·hd), in place: rotated and rounded to float16 values. k, v (t, n_kv·hd): k rotated (in
    place), then both written to kc, vc (n_kv, rows, width) as their type stores them (float16 bit patterns or
    q8_0 blocks: attention.store_cache_row), position p in row p % rows.
    cos, sin (t, rope_dim/2); shape: (n_head, n_kv, head_dim, rope_dim, neox). rope_dim 0: no rotation.
    """
    n_head, n_kv, hd, rope_dim, neox = shape
    rows = kc.shape[1]
    for i in prange(q.shape[0]):
        rope(q[i], n_head, hd, rope_dim, cos[i], sin[i], neox != 0)
        rope(k[i], n_kv, hd, rope_dim, cos[i], sin[i], neox != 0)
        round_to_half(q[i])
        row = (start + i) % rows
        for j in range(n_kv):
            store_cache_row(k[i, j * hd : (j + 1) * hd], kc[j, row])
            store_cache_row(v[i, j * hd : (j + 1) * hd], vc[j, row])


def product(w, x, out, parallel_min_bytes):
    """out = W x for a weight tuple (module docstring), on all threads when W is big enough to repay the
    launch. Compiled code only."""
    raise NotImplementedError("decode.product runs inside compiled kernels only")


def _is_packed(w) -> bool:
    return isinstance(w, types.BaseTuple) and len(w.types) == 3


@overload(product, jit_options={"nogil": True})
def _product(w, x, out, parallel_min_bytes):
    if _is_packed(w):

        def packed_product(w, x, out, parallel_min_bytes):
            q, s, fmt = w
            if q.nbytes + s.nbytes >= parallel_min_bytes:
                packed.matvec(q, s, fmt, x, out)
            else:
                packed.matvec_serial(q, s, fmt, x, out)

        return packed_product

    def float_product(w, x, out, parallel_min_bytes):
        data, bf16 = w
        if data.nbytes >= parallel_min_bytes:
            floats.matvec(data, bf16, x, out)
        else:
            floats.matvec_serial(data, bf16, x, out)

    return float_product


def products3(a, b, c, x, oa, ob, oc, parallel_min_bytes):
    """oa, ob, oc = A x, B x, C x: one parallel launch when all three are packed. Compiled only."""
    raise NotImplementedError("decode.products3 runs inside compiled kernels only")


@overload(products3, jit_options={"nogil": True})
def _products3(a, b, c, x, oa, ob, oc, parallel_min_bytes):
    if _is_packed(a) and _is_packed(b) and _is_packed(c):

        def packed_products(a, b, c, x, oa, ob, oc, parallel_min_bytes):
            if a[0].nbytes + b[0].nbytes + c[0].nbytes >= parallel_min_bytes:
                packed.matvec_many((a[0], b[0], c[0]), (a[1], b[1], c[1]), (a[2], b[2], c[2]), x, (oa, ob, oc))
            else:
                product(a, x, oa, parallel_min_bytes)
                product(b, x, ob, parallel_min_bytes)
                product(c, x, oc, parallel_min_bytes)

        return packed_products

    def each(a, b, c, x, oa, ob, oc, parallel_min_bytes):
        product(a, x, oa, parallel_min_bytes)
        product(b, x, ob, parallel_min_bytes)
        product(c, x, oc, parallel_min_bytes)

    return each


def products2(a, b, x, oa, ob, parallel_min_bytes):
    """oa, ob = A x, B x: one parallel launch when both are packed. Compiled only."""
    raise NotImplementedError("decode.products2 runs inside compiled kernels only")


@overload(products2, jit_options={"nogil": True})
def _products2(a, b, x, oa, ob, parallel_min_bytes):
    if _is_packed(a) and _is_packed(b):

        def packed_products(a, b, x, oa, ob, parallel_min_bytes):
            if a[0].nbytes + b[0].nbytes >= parallel_min_bytes:
                packed.matvec_many((a[0], b[0]), (a[1], b[1]), (a[2], b[2]), x, (oa, ob))
            else:
                product(a, x, oa, parallel_min_bytes)
                product(b, x, ob, parallel_min_bytes)

        return packed_products

    def each(a, b, x, oa, ob, parallel_min_bytes):
        product(a, x, oa, parallel_min_bytes)
        product(b, x, ob, parallel_min_bytes)

    return each


@njit(cache=True, nogil=True)
def add_bias(y, b):
    if b.shape[0]:
        for i in range(y.shape[0]):
            y[i] += b[i]


@njit(cache=True, nogil=True)
def norm_into(x, w, b, layer_norm_kind, eps, out):
    """out = RMSNorm(x) · w, or LayerNorm(x) · w + b when layer_norm_kind."""
    if layer_norm_kind:
        layer_norm(x, w, b, eps, out)
    else:
        rms_norm(x, w, eps, out)


@njit(cache=True, nogil=True)
def branch_end(y, b, post_norm, eps, x):
    """x (d,) += post_norm(y + b): a branch's bias, its post-norm (an RMSNorm; none where post_norm is empty) and
    the residual, on its projection's output y (d,), which is scratch."""
    add_bias(y, b)
    if post_norm.shape[0]:
        rms_norm(y, post_norm, eps, y)
    for i in range(x.shape[0]):
        x[i] += y[i]


@njit(cache=True, nogil=True)
def activate(gate, up, ffn_kind, gelu):
    """up (n,) = act(gate) · up in place, gate overwritten: ffn_kind 1 GeGLU (gelu: its table), else SwiGLU."""
    if ffn_kind == 1:
        geglu_row(gate, up, up, gelu)
    else:
        swiglu_row(gate, up, up)


@njit(parallel=True, cache=True, nogil=True)
def gated_input(w_gate, w_up, h, b_up, ffn_kind, gelu, xq, dx, xsum):
    """The gated FFN's down-projection input for one token, in one parallel launch: act(W_gate ĥ) · (W_up ĥ + b_up),
    quantized per 32 into xq (d_ff/32, 32), dx (d_ff/32,), xsum (d_ff/32, 2) as packed.quantize_x quantizes.

    Each thread takes a share of the row groups of both weights (`gated_groups`), so no pass over the d_ff values
    is left on one thread between this launch and the down projection's. Every value gets the arithmetic
    products2, add_bias, `activate` and quantize_x give it over whole vectors (all elementwise, each 32-block
    quantized alone), so the result is theirs bit for bit. w_gate, w_up: packed.
    """
    xq_in, dx_in, xsum_in = packed.quantize_x(h)
    parts = packed.thread_count()
    for p in prange(parts):
        g0, g1 = packed.share(p, parts, w_gate[0].shape[0])
        gated_groups(w_gate, w_up, b_up, ffn_kind, gelu, xq_in, dx_in, xsum_in, g0, g1, xq, dx, xsum)


@njit(cache=True, nogil=True)
def gated_groups(w_gate, w_up, b_up, ffn_kind, gelu, xq_in, dx_in, xsum_in, g0, g1, xq, dx, xsum):
    """`gated_input` for the row groups g0 <= g < g1: each group's two products, then its bias, activation and
    quantization."""
    qg, sg, fg = w_gate
    qu, su, fu = w_up
    x_in, wg, wu = packed.flat_x(xq_in, dx_in, xsum_in), packed.flat_weight(qg, sg), packed.flat_weight(qu, su)
    d_ff = xq.shape[0] * 32
    gate = np.empty(ROWS, dtype=np.float32)
    up = np.empty(ROWS, dtype=np.float32)
    for g in range(g0, g1):
        packed.group_flat(wg, fg, g, x_in, gate)
        packed.group_flat(wu, fu, g, x_in, up)
        r0 = g * ROWS
        n = min(ROWS, d_ff - r0)  # a multiple of 32: ROWS is, and so is d_ff (the down projection's blocks)
        if b_up.shape[0]:
            add_bias(up[:n], b_up[r0 : r0 + n])
        activate(gate[:n], up[:n], ffn_kind, gelu)
        b0, b1 = r0 // 32, (r0 + n) // 32
        packed.quantize_into(up[:n], xq[b0:b1], dx[b0:b1], xsum[b0:b1])


@njit(cache=True, nogil=True)
def gated_ffn_each(w_gate, w_up, w_down, b_up, h, d_ff, ffn_kind, gelu, out, parallel_min_bytes):
    """`gated_ffn` one step at a time: the products, then the activation over the whole vector."""
    gate = np.empty(d_ff, dtype=np.float32)
    up = np.empty(d_ff, dtype=np.float32)
    products2(w_gate, w_up, h, gate, up, parallel_min_bytes)
    add_bias(up, b_up)
    activate(gate, up, ffn_kind, gelu)
    product(w_down, up, out, parallel_min_bytes)


def gated_ffn(w_gate, w_up, w_down, b_up, h, d_ff, ffn_kind, gelu, out, parallel_min_bytes):
    """out (d,) = W_down (act(W_gate h) · (W_up h + b_up)), the gated FFN (ffn_kind 0 or 1) without the down
    projection's bias: two parallel launches (`gated_input`, then the down projection on its quantized input)
    when the weights are packed and gate and up big enough to share, else `gated_ffn_each`. Compiled only."""
    raise NotImplementedError("decode.gated_ffn runs inside compiled kernels only")


@overload(gated_ffn, jit_options={"nogil": True})
def _gated_ffn(w_gate, w_up, w_down, b_up, h, d_ff, ffn_kind, gelu, out, parallel_min_bytes):
    if not (_is_packed(w_gate) and _is_packed(w_up) and _is_packed(w_down)):

        def each(w_gate, w_up, w_down, b_up, h, d_ff, ffn_kind, gelu, out, parallel_min_bytes):
            gated_ffn_each(w_gate, w_up, w_down, b_up, h, d_ff, ffn_kind, gelu, out, parallel_min_bytes)

        return each

    def fused(w_gate, w_up, w_down, b_up, h, d_ff, ffn_kind, gelu, out, parallel_min_bytes):
        if w_gate[0].nbytes + w_up[0].nbytes < parallel_min_bytes:
            gated_ffn_each(w_gate, w_up, w_down, b_up, h, d_ff, ffn_kind, gelu, out, parallel_min_bytes)
            return
        nb = d_ff // 32
        xq = np.empty((nb, 32), dtype=np.int8)
        dx = np.empty(nb, dtype=np.float32)
        xsum = np.empty((nb, 2), dtype=np.int32)
        gated_input(w_gate, w_up, h, b_up, ffn_kind, gelu, xq, dx, xsum)
        q, s, fmt = w_down
        if q.nbytes + s.nbytes >= parallel_min_bytes:
            packed.matvec_quantized(q, s, fmt, xq, dx, xsum, out)
        else:
            packed.matvec_quantized_serial(q, s, fmt, xq, dx, xsum, out)

    return fused


@njit(cache=True, nogil=True)
def layer(x, pos, kc, vc, cos, sin, threads,
          attn_norm, attn_norm_b, q_norm, k_norm, attn_post_norm, ffn_norm, ffn_norm_b, ffn_post_norm,
          wq, bq, wk, bk, wv, bv, wo, bo, w_gate, w_up, b_up, w_down, b_down,
          n_head, n_kv, head_dim, rope_dim, neox, d_ff, ffn_kind, layer_norm_kind, window,
          eps, attn_scale, softcap, gelu, parallel_min_bytes):  # fmt: skip
    """x (d,) float32, in place: one token at position pos through one layer of any family -- engine.layer's
    run_layer as one compiled call. Its arguments after `threads` are those of engine.layer's LayerSpec, named
    so, built by one_token.decode_args, and passed as they are from call to call: the call's own cost counts (24
    layers' calls took 0.2 ms of a 0.5B model's 19 ms token while their cache views and RoPE rows were made per
    call).

    kc, vc (n_kv, rows, width): the layer's cache, float16 bit patterns (uint16) or q8_0 blocks (uint8), each its
    own type (engine/cache_types.py), position p in row p % rows; position pos is written. cos, sin (n_pos,
    rope_dim/2): every position's rotation (engine.layer's Rope tables). Norm weights (d,) or (head_dim,) and
    biases are float32, empty arrays where the layer has none; w*: weight tuples (module docstring), w_gate unused
    by the ungated FFN (ffn_kind, FFN_KINDS). layer_norm_kind: the pre-norms are LayerNorms (else RMSNorms); q/k
    and post-norms are RMSNorms. gelu: attention.gelu_table(), GeGLU's. Products of at least parallel_min_bytes
    of weights, and attention over a long context, run on `threads` threads.
    """
    hd = head_dim
    d = x.shape[0]
    h = np.empty(d, dtype=np.float32)
    q = np.empty(n_head * hd, dtype=np.float32)  # (n_head·hd,)
    k = np.empty(n_kv * hd, dtype=np.float32)  # (n_kv·hd,)
    v = np.empty(n_kv * hd, dtype=np.float32)

    # attention
    norm_into(x, attn_norm, attn_norm_b, layer_norm_kind, eps, h)
    products3(wq, wk, wv, h, q, k, v, parallel_min_bytes)
    add_bias(q, bq)
    add_bias(k, bk)
    add_bias(v, bv)
    if q_norm.shape[0]:
        head_norms(q, n_head, hd, q_norm, eps)
    if k_norm.shape[0]:
        head_norms(k, n_kv, hd, k_norm, eps)
    rope(q, n_head, hd, rope_dim, cos[pos], sin[pos], neox != 0)
    rope(k, n_kv, hd, rope_dim, cos[pos], sin[pos], neox != 0)
    round_to_half(q)
    row = pos % kc.shape[1]
    for j in range(n_kv):
        store_cache_row(k[j * hd : (j + 1) * hd], kc[j, row])
        store_cache_row(v[j * hd : (j + 1) * hd], vc[j, row])
    a = np.empty(n_head * hd, dtype=np.float32)
    attend_one(q, kc, vc, pos, n_head, attn_scale, window, softcap, threads, a)
    product(wo, a, h, parallel_min_bytes)
    branch_end(h, bo, attn_post_norm, eps, x)

    # feed-forward
    norm_into(x, ffn_norm, ffn_norm_b, layer_norm_kind, eps, h)
    if ffn_kind == 2:  # ungated: gelu(up + b)
        up = np.empty(d_ff, dtype=np.float32)
        product(w_up, h, up, parallel_min_bytes)
        add_bias(up, b_up)
        for i in range(d_ff):
            up[i] = gelu_tanh(up[i])
        product(w_down, up, h, parallel_min_bytes)
    else:
        gated_ffn(w_gate, w_up, w_down, b_up, h, d_ff, ffn_kind, gelu, h, parallel_min_bytes)  # h read, then written
    branch_end(h, b_down, ffn_post_norm, eps, x)
