"""PyTorch references of the KDA ops on the pool's state views (also the CPU path).

The short convolution is written out here (it is this project's kernel); the KDA recurrence
and chunked form are fla-core's own references, ``naive_recurrent_kda`` and
``naive_chunk_kda``, applied to states gathered from the pool and scattered back.

**The conv state rule.** The conv of width ``W`` over a request's inputs ``x_0, x_1, ...``
(channels are independent) is ``y_p = act(bias + sum_w weight[:, w] * x_{p - W + 1 + w})``,
``x`` before the first token being 0. A step's *extended input* is the ``W - 1`` history rows
of the state followed by the step's inputs; the outputs are the conv over it. The state holds
``R = W - 1 + num_speculative_tokens`` rows:

* the history of a step is rows ``[a - 1, a - 1 + W - 1)``, where ``a`` is the number of the
  previous step's tokens that were accepted (``num_accepted_tokens``; 1 after a prefill or a
  step without speculation);
* after a step, rows ``[0, W - 1 + q)`` are the last ``W - 1 + q`` rows of its extended input,
  with ``q = next_n - 1`` for a decode step (its draft tokens) and ``q = 0`` for a prefill;
  the rows after them are left as they were.

So after a decode step of ``n`` tokens, row ``W - 2 + i`` is the input of its token ``i``
(rows ``0..W-3`` the ``W - 2`` inputs before it): if its first ``a`` tokens are accepted, the
last ``W - 1`` true inputs are rows ``[a - 1, a - 1 + W - 1)``, which is what the next step
reads. After a prefill the last ``W - 1`` inputs sit at rows ``[0, W - 1)`` (``a = 1``).
``n <= R - W + 2`` keeps every row inside the state.
"""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6  # fla-core's in-kernel q/k L2 norm: x / sqrt(sum(x^2) + 1e-6)


def conv_indexed(
    x: torch.Tensor,
    out: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    query_start_loc: list[int],
    num_accepted_tokens: list[int] | None,
    has_initial_state: list[bool] | None,
    keep_drafts: bool,
    silu: bool,
    write_out: bool = True,
) -> None:
    """The conv rule above for every request ``b`` with ``state_indices[b] >= 0`` (host loop).

    ``query_start_loc`` (host ints, ``B + 1``) gives each request's tokens in ``x``/``out``;
    rows of requests with a negative index are neither read nor written.
    """
    width = weight.shape[1]
    w = weight.float()
    for b, index in enumerate(state_indices.tolist()):
        if index < 0:
            continue
        start, end = query_start_loc[b], query_start_loc[b + 1]
        first = num_accepted_tokens[b] - 1 if num_accepted_tokens is not None else 0
        state = conv_states[index]
        history = state[first : first + width - 1].float()
        if has_initial_state is not None and not has_initial_state[b]:
            history = torch.zeros_like(history)
        ext = torch.cat([history, x[start:end].float()])
        n = end - start
        if write_out and n:
            y = torch.zeros_like(ext[:n])
            for i in range(width):  # the kernel's order: taps first, then the bias
                y = y + ext[i : i + n] * w[:, i]
            if bias is not None:
                y = y + bias.float()
            if silu:
                y = y * torch.sigmoid(y)
            out[start:end] = y.to(out.dtype)
        keep = width - 1 + (n - 1 if keep_drafts else 0)
        state[:keep] = ext[ext.shape[0] - keep :].to(state.dtype)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla-core's in-kernel L2 norm of the last dim, in fp32."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _gather(states: torch.Tensor, indices: list[int]) -> torch.Tensor:
    """fp32 ``[n, ...]`` copies of ``states[i]`` (zeros for ``i < 0``)."""
    out = torch.zeros((len(indices), *states.shape[1:]), dtype=torch.float32, device=states.device)
    for j, i in enumerate(indices):
        if i >= 0:
            out[j] = states[i]
    return out


def recurrent_decode(q, k, v, g, beta, out, recurrent_states, state_indices, num_accepted_tokens, scale,
                     qk_l2norm) -> None:
    """Decode through ``naive_recurrent_kda``, token by token, on indexed states.

    ``state_indices`` int ``[B]`` (one token a request) or ``[B, next_n]``: the state after
    token ``i`` goes to ``state_indices[b, i]``, the step starts from
    ``state_indices[b, num_accepted_tokens[b] - 1]`` (fla-core's rule). A negative index is never
    read or written; rows of a request whose start index is negative are left as they were.
    """
    from fla.ops.kda.naive import naive_recurrent_kda

    batch, next_n = q.shape[:2]
    indices = state_indices.view(batch, -1).tolist()
    accepted = num_accepted_tokens.tolist() if num_accepted_tokens is not None else [1] * batch
    starts = [row[a - 1] for row, a in zip(indices, accepted)]
    live = [b for b in range(batch) if starts[b] >= 0]
    if not live:
        return
    state = _gather(recurrent_states, [starts[b] for b in live])
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    for i in range(next_n):
        o, state = naive_recurrent_kda(
            q[live, i : i + 1].float(), k[live, i : i + 1].float(), v[live, i : i + 1].float(),
            g[live, i : i + 1].float(), beta[live, i : i + 1].float(), scale=scale, initial_state=state,
            output_final_state=True,
        )
        out[live, i : i + 1] = o.to(out.dtype)
        for j, b in enumerate(live):
            if indices[b][i] >= 0:
                recurrent_states[indices[b][i]] = state[j]


def chunk_prefill(q, k, v, g, beta, out, recurrent_states, state_indices, cu_seqlens, has_initial_state, scale,
                  qk_l2norm, chunk_size: int = 64) -> None:
    """Prefill through ``naive_chunk_kda``, request by request, on indexed states.

    Inputs are ragged ``[T, H, D]`` with ``cu_seqlens`` (host ints). Each request starts from
    its state (zeros when ``has_initial_state`` is false) and its final state is written back.
    A request's tokens are padded to whole chunks with ``k = 0`` and ``g = 0``, which leave the
    state as it is (the decay is ``exp(0) = 1`` and a zero key adds nothing).
    """
    from fla.ops.kda.naive import naive_chunk_kda

    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    for b, index in enumerate(state_indices.tolist()):
        start, end = cu_seqlens[b], cu_seqlens[b + 1]
        if index < 0:
            continue
        n = end - start
        state = _gather(recurrent_states, [index if has_initial_state[b] else -1])
        if n:
            pad = -n % chunk_size
            parts = [_pad(t[start:end].float(), pad)[None] for t in (q, k, v, g, beta)]
            o, state = naive_chunk_kda(*parts, scale=scale, initial_state=state, output_final_state=True,
                                       chunk_size=chunk_size)
            out[start:end] = o[0, :n].to(out.dtype)
        recurrent_states[index] = state[0]


def _pad(t: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t
