"""The gated delta rule (Gated DeltaNet's token mixer): chunk-parallel for training, a recurrence
for generation; both in plain torch (CPU and any device), fp32 inside
(fp64 inputs stay fp64).

Per head, with state ``S [Dk, Dv]`` (zero or given), queries scaled by ``Dk ** -0.5``::

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - k_t^T S_t))^T        # the delta rule: write only the correction
    o_t = S_t^T q_t

``recurrent_gated_delta_rule`` runs that loop token by token (``gated_delta_step`` is one step, what
generation calls per decode token). ``chunk_gated_delta_rule`` computes the same function with
``T / chunk_size`` sequential steps: within a chunk the updates are condensed by the UT transform
(one unit-lower-triangular solve), across chunks the state is carried -- the WY form of
Yang et al., "Gated Delta Networks" (2024), as in Hugging Face's torch fallback. The two compute
different sums (agreement is ~1e-6 relative in fp32, see tests/models/test_delta_rule.py), so
they are not bitwise equal. Both are differentiable by autograd (no in-place writes into
tensors autograd saved).

Shapes: ``q, k [B, T, H, Dk]``, ``v [B, T, H, Dv]``, ``g, beta [B, T, H]`` (``g <= 0``: log decay),
state ``[B, H, Dk, Dv]``. Grouped heads (fewer k heads than v heads) are expanded by the caller.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the FLA / Hugging Face form, eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _to_heads_first(*xs: torch.Tensor) -> list[torch.Tensor]:
    # fp32 at least (bf16 inputs are upcast); fp64 stays fp64 so gradcheck sees exact derivatives
    dtype = torch.promote_types(xs[0].dtype, torch.float32)
    return [x.transpose(1, 2).to(dtype).contiguous() for x in xs]


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: ``q, k [B, H, Dk]`` (q already scaled), ``v [B, H, Dv]``, ``g, beta [B, H]``,
    ``state [B, H, Dk, Dv]`` (fp32) -> (output ``[B, H, Dv]``, new state)."""
    state = state * g.exp()[..., None, None]
    predicted = (state * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - predicted) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(dim=-2), state


def _initial(state: torch.Tensor | None, b: int, h: int, dk: int, dv: int, like: torch.Tensor) -> torch.Tensor:
    if state is None:
        return like.new_zeros(b, h, dk, dv)
    return state.to(like.dtype)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule -> (output ``[B, T, H, Dv]`` in q's dtype, final state fp32)."""
    dtype = q.dtype
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = _to_heads_first(q, k, v, g, beta)
    q = q * dk ** -0.5
    state = _initial(initial_state, b, h, dk, dv, v)
    outs = []
    for i in range(t):
        o, state = gated_delta_step(q[:, :, i], k[:, :, i], v[:, :, i], g[:, :, i], beta[:, :, i], state)
        outs.append(o)
    out = torch.stack(outs, dim=2) if outs else v.new_zeros(b, h, 0, dv)
    return out.transpose(1, 2).contiguous().to(dtype), state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, chunk_size: int = 64, initial_state: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel gated delta rule -> (output ``[B, T, H, Dv]`` in q's dtype, final state fp32).

    ``T`` need not divide by ``chunk_size``: the tail is zero-padded with ``g = beta = 0`` (no decay,
    no write), which leaves the outputs of real tokens and the final state unchanged."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    dtype = q.dtype
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = _to_heads_first(q, k, v, g, beta)
    q = q * dk ** -0.5
    pad = (chunk_size - t % chunk_size) % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk_size
    c = chunk_size
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)

    # Within a chunk: decay[i, j] = exp(G_i - G_j) for j <= i (G = cumulative log decay), 0 above.
    cum = g.cumsum(dim=-1)
    upper = torch.ones(c, c, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    # UT transform: (I + strictly_lower(beta_i k_i.k_j decay_ij)) W = [beta v | beta k exp(G)]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([v_beta, k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :dv], solved[..., dv:]
    attn = (q @ k.transpose(-1, -2)) * decay  # decay is exp(-inf) = 0 above the diagonal: causal already
    q_decayed = q * cum.exp().unsqueeze(-1)
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]

    state = _initial(initial_state, b, h, dk, dv, v)
    outs = []
    # unbind, not x[:, :, i]: the backward of one unbind is one stack, while each indexing's backward
    # would zero-fill and accumulate a full-size gradient (n of them per tensor)
    per_chunk = zip(*(x.unbind(2) for x in (u, w, q_decayed, attn, k_to_end.transpose(-1, -2), chunk_decay)))
    for u_i, w_i, q_i, attn_i, k_end_i, decay_i in per_chunk:
        v_new = u_i - w_i @ state  # each token's correction given the carried state
        outs.append(q_i @ state + attn_i @ v_new)
        state = state * decay_i + k_end_i @ v_new
    out = torch.stack(outs, dim=2).reshape(b, h, n * c, dv)[:, :, :t]
    return out.transpose(1, 2).contiguous().to(dtype), state


def invariant_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, initial_state: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence in batch-invariant mode: same arguments and results as
    :func:`recurrent_gated_delta_rule`, but every token's arithmetic is fixed whatever the batch and
    whichever path runs it (a trainer's full sequence, a generator's prefill or its decode step):

    * the state is kept as ``[B, H, Dv, Dk]`` so both reductions (the state's prediction of ``v``
      and the output) are sums over the last dim, which this CPU's kernels compute per row
      independently of the other rows (``lockstep.ops.batch_invariant``);
    * the one transcendental, ``exp(g)``, goes through ``numerics.rowwise``;
    * the rest is elementwise multiply/add, exact per element.

    Cost: ``T`` sequential steps of small ops per layer (no chunk parallelism), so a trainer's
    batch-invariant forward of a hybrid model is slower than its chunked one (``docs/hybrid.md``)."""
    from lockstep import numerics

    dtype = q.dtype
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = _to_heads_first(q, k, v, g, beta)
    q = q * dk ** -0.5
    state = _initial(initial_state, b, h, dk, dv, v).transpose(-1, -2).contiguous()
    decay = numerics.rowwise(torch.exp, g)
    outs = []
    for i in range(t):
        k_t = k[:, :, i, None, :]
        state = state * decay[:, :, i, None, None]
        delta = (v[:, :, i] - (state * k_t).sum(dim=-1)) * beta[:, :, i, None]
        state = state + delta[..., None] * k_t
        outs.append((state * q[:, :, i, None, :]).sum(dim=-1))
    out = torch.stack(outs, dim=2) if outs else v.new_zeros(b, h, 0, dv)
    return out.transpose(1, 2).contiguous().to(dtype), state.transpose(-1, -2).contiguous()
