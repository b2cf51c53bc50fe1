"""Public KDA ops on the pool's per-layer state views: validate, then dispatch.

The state tensors are the strided views :meth:`CachePool.kda_state_views` hands out (any
tensor of the same shape and inner layout works): conv ``[N, R, C]`` and recurrent
``[N, HV, K, V]`` fp32, K first (fla-core's default layout; V first is not offered), indexed
by int32 state indices, one per request (``-1``: padding, never read or written by these
ops). Gates and betas are fla-core's: ``g`` is the per-channel decay in log space (e.g. from
``fla.ops.kda.gate.fused_kda_gate``), ``beta`` is after the sigmoid.

``impl`` follows :mod:`dsacache.dispatch`. The conv runs this project's Triton kernel (or its
twin in ``naive.py``); the recurrence runs fla-core: ``fused_recurrent_kda_fwd`` for decode,
``chunk_kda`` for prefill (CUDA only: it is autotuned), or fla-core's naive references on the
torch path. ``check_indices=True`` reads the indices back on the host (one sync) and refuses
any outside ``[-1, N)``, a state used twice, and accepted counts outside their range; with it
off (CUDA-graph capture) the conv kernel skips indices outside ``[0, N)`` but fla-core's
recurrent kernel does not, so the indices must be valid (the step metadata builder checks them
on the host) and ``-1`` entries rely on the pool's guard row.
"""

from __future__ import annotations

import torch

from dsacache.dispatch import check_same_device, interpreting, use_triton
from dsacache.ops.checks import check_flag, check_int, check_tensor
from dsacache.ops.kda import naive

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ACTIVATIONS = (None, "silu")
#: Triton release whose interpreter runs fla-core's recurrent kernel on CPU (3.6 fails on its loop bound).
FLA_INTERPRETER_TRITON = (3, 9)


def causal_conv1d_update_indexed(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    next_n: int = 1,
    num_accepted_tokens: torch.Tensor | None = None,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,
    impl: str = "auto",
    check_indices: bool = True,
) -> torch.Tensor:
    """Decode step of the short causal conv, in place on indexed conv states.

    Args:
        x: ``[B * next_n, C]`` inputs (bf16/fp16/fp32, channels contiguous), request after request.
        conv_states: ``[N, R, C]`` conv states (one layer's pool view), ``R >= W - 2 + next_n``.
        state_indices: int32 ``[B]``, each request's state (``-1``: padding, its rows of ``out``
            are left unwritten).
        weight: ``[C, W]`` depthwise taps (the model's ``conv1d.weight[:, 0, :]``), ``W >= 2``.
        bias: ``[C]`` or None.
        next_n: tokens a request (1 + draft tokens).
        num_accepted_tokens: int32 ``[B]``: how many of each request's previous-step tokens were
            accepted (1 after a prefill); None means 1 for all.
        activation: ``"silu"`` (Kimi-Linear / K3.1) or None.
        out: ``[B * next_n, C]`` of ``x.dtype``, not overlapping ``x``; allocated when omitted.

    Returns ``out``. The state rule (which rows are history, which are kept) is in
    :mod:`dsacache.ops.kda.naive`.
    """
    batch, width = _check_conv(x, conv_states, state_indices, weight, bias, activation, impl, check_indices)
    next_n = check_int("next_n", next_n, 1)
    if x.shape[0] != batch * next_n:
        raise ValueError(f"x has {x.shape[0]} rows; {batch} requests of next_n={next_n} need {batch * next_n}")
    rows = conv_states.shape[1]
    if rows < width - 2 + next_n:
        raise ValueError(f"conv_states hold {rows} rows; width {width} with next_n={next_n} needs "
                         f"{width - 2 + next_n} (conv_kernel - 1 + num_speculative_tokens)")
    _check_accepted(num_accepted_tokens, batch, rows - width + 2, check_indices)
    out = _conv_out(out, x)
    check_same_device(x=x, conv_states=conv_states, state_indices=state_indices, weight=weight, out=out)
    silu = activation == "silu"
    if use_triton(impl, x, conv_states, state_indices, weight, out):
        from dsacache.ops.kda.launch import launch_conv_decode

        launch_conv_decode(x, out, conv_states, state_indices, weight, bias, next_n, num_accepted_tokens, silu)
        return out
    accepted = num_accepted_tokens.tolist() if num_accepted_tokens is not None else None
    naive.conv_indexed(x, out, conv_states, state_indices, weight, bias, list(range(0, x.shape[0] + 1, next_n)),
                       accepted, None, keep_drafts=True, silu=silu)
    return out


def causal_conv1d_prefill_indexed(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor,
    max_query_len: int | None = None,
    activation: str | None = "silu",
    out: torch.Tensor | None = None,
    impl: str = "auto",
    check_indices: bool = True,
) -> torch.Tensor:
    """Prefill (or a prefill chunk) of the short causal conv, reading and updating indexed conv states.

    Args:
        x: ``[T, C]`` ragged inputs of the ``B`` requests.
        conv_states, state_indices, weight, bias, activation: as in :func:`causal_conv1d_update_indexed`.
        query_start_loc: int32 ``[B + 1]``, request ``b``'s tokens are ``x[qsl[b]:qsl[b + 1]]``.
        has_initial_state: bool ``[B]``: False for a request's first chunk (its history is
            zeros whatever its rows hold), True for a later chunk (the history is its state).
        max_query_len: the longest request's token count (host int; read off
            ``query_start_loc`` with a sync when omitted).
        out: ``[T, C]`` of ``x.dtype``, not overlapping ``x``.

    Afterwards rows ``[0, W - 1)`` of each state are the last ``W - 1`` inputs (``a = 1`` for
    the next step), however many chunks the prompt took.
    """
    batch, width = _check_conv(x, conv_states, state_indices, weight, bias, activation, impl, check_indices)
    _check_ragged(query_start_loc, "query_start_loc", batch, x.shape[0], check_indices)
    _check_initial(has_initial_state, batch)
    if conv_states.shape[1] < width - 1:
        raise ValueError(f"conv_states hold {conv_states.shape[1]} rows; width {width} needs {width - 1}")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if batch else 0
    max_query_len = check_int("max_query_len", max_query_len, 0)
    out = _conv_out(out, x)
    check_same_device(x=x, conv_states=conv_states, state_indices=state_indices, weight=weight, out=out,
                      query_start_loc=query_start_loc, has_initial_state=has_initial_state)
    silu = activation == "silu"
    if use_triton(impl, x, conv_states, state_indices, weight, out, query_start_loc):
        from dsacache.ops.kda.launch import launch_conv_prefill

        launch_conv_prefill(x, out, conv_states, state_indices, weight, bias, query_start_loc, has_initial_state,
                            max_query_len, silu)
        return out
    naive.conv_indexed(x, out, conv_states, state_indices, weight, bias, query_start_loc.tolist(), None,
                       has_initial_state.tolist(), keep_drafts=False, silu=silu)
    return out


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent_states: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    num_accepted_tokens: torch.Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    out: torch.Tensor | None = None,
    impl: str = "auto",
    check_indices: bool = True,
) -> torch.Tensor:
    """Decode step of the KDA recurrence, in place on indexed recurrent states (fla-core's kernel).

    Args:
        q, k: ``[B, next_n, H, K]``; v: ``[B, next_n, HV, V]``; g: ``[B, next_n, HV, K]`` log
            decays; beta: ``[B, next_n, HV]``. Contiguous, float.
        recurrent_states: fp32 ``[N, HV, K, V]`` (one layer's pool view), each state contiguous.
        state_indices: int32 ``[B]`` (``next_n == 1``) or ``[B, next_n]`` (speculative decode:
            the state after token ``i`` is written to ``state_indices[b, i]``, and the step
            starts from ``state_indices[b, num_accepted_tokens[b] - 1]``, where the previous
            step left the state after its last accepted token). ``-1``: padding.
        num_accepted_tokens: int32 ``[B]`` in ``[1, next_n]``; required with ``[B, next_n]`` indices.
        scale: query scale, default ``K ** -0.5``.
        use_qk_l2norm_in_kernel: L2-normalize q and k first (as K3.1 / Kimi-Linear do).
        out: ``[B, next_n, HV, V]`` of ``v.dtype``; allocated when omitted.

    Returns ``out``; rows of padded entries are unspecified on the fla-core path (it computes
    them from the guard row) and left unwritten on the torch path.
    """
    batch, next_n, heads, dim_k = _check_qkv(q, k, v, g, beta, recurrent_states)
    _check_indices_tensor(state_indices, recurrent_states.shape[0], check_indices, (batch,), (batch, next_n))
    if state_indices.dim() == 1 and next_n != 1:
        raise ValueError(f"next_n={next_n} tokens a request need state_indices [B, next_n] (one state a token)")
    if state_indices.dim() == 2 and num_accepted_tokens is None:
        raise ValueError("state_indices [B, next_n] (speculative decode) need num_accepted_tokens")
    _check_accepted(num_accepted_tokens, batch, next_n, check_indices)
    scale = _scale(scale, dim_k)
    check_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    out = _recurrent_out(out, v)
    check_same_device(q=q, recurrent_states=recurrent_states, state_indices=state_indices, out=out)
    if use_triton(impl, q, recurrent_states, state_indices, out):
        _check_fla_runs(q)
        if batch == 0:
            return out
        from dsacache.ops.kda.launch import launch_recurrent_decode

        launch_recurrent_decode(q, k, v, g, beta, out, recurrent_states, state_indices, num_accepted_tokens, scale,
                                use_qk_l2norm_in_kernel)
        return out
    naive.recurrent_decode(q, k, v, g, beta, out, recurrent_states, state_indices, num_accepted_tokens, scale,
                           use_qk_l2norm_in_kernel)
    return out


def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent_states: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    out: torch.Tensor | None = None,
    impl: str = "auto",
    check_indices: bool = True,
) -> torch.Tensor:
    """Prefill (or a prefill chunk) of the KDA recurrence: ``chunk_kda`` from each request's state.

    Args:
        q, k: ``[T, H, K]``; v: ``[T, HV, V]``; g: ``[T, HV, K]``; beta: ``[T, HV]``: ragged
            tokens of ``B`` requests. Contiguous, float.
        recurrent_states: fp32 ``[N, HV, K, V]`` (one layer's pool view).
        state_indices: int32 ``[B]`` (``-1``: padding, skipped).
        cu_seqlens: int32/int64 ``[B + 1]`` token offsets.
        has_initial_state: bool ``[B]``: False starts the request from zeros.
        out: ``[T, HV, V]`` of ``v.dtype``.

    The initial states are gathered out of the pool (``chunk_kda`` reads contiguous states) and
    the final states scattered back into it. Returns ``out``.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a [T, H, K] tensor, got {getattr(q, 'shape', type(q).__name__)}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_tensor(name, t)
    _check_qkv(q[None], k[None], v[None], g[None], beta[None], recurrent_states)
    batch = state_indices.shape[0] if isinstance(state_indices, torch.Tensor) and state_indices.dim() == 1 else -1
    _check_indices_tensor(state_indices, recurrent_states.shape[0], check_indices, (batch,))
    _check_ragged(cu_seqlens, "cu_seqlens", batch, q.shape[0], check_indices)
    _check_initial(has_initial_state, batch)
    scale = _scale(scale, q.shape[-1])
    check_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    out = _recurrent_out(out, v)
    check_same_device(q=q, recurrent_states=recurrent_states, state_indices=state_indices, out=out,
                      cu_seqlens=cu_seqlens, has_initial_state=has_initial_state)
    if use_triton(impl, q, recurrent_states, state_indices, out):
        if not q.is_cuda:
            raise NotImplementedError("impl='triton' prefill runs fla-core's chunk_kda, which is autotuned and runs "
                                      "only on CUDA; use impl='torch' on CPU")
        from dsacache.ops.kda.launch import launch_chunk_prefill

        if batch:
            launch_chunk_prefill(q, k, v, g, beta, out, recurrent_states, state_indices, cu_seqlens,
                                 has_initial_state, scale, use_qk_l2norm_in_kernel)
        return out
    naive.chunk_prefill(q, k, v, g, beta, out, recurrent_states, state_indices, cu_seqlens.tolist(),
                        has_initial_state.tolist(), scale, use_qk_l2norm_in_kernel)
    return out


# Checks ----------------------------------------------------------------------------------


def _check_float(name: str, t: object, dim: int, contiguous: bool = False) -> None:
    check_tensor(name, t)
    if t.dim() != dim or t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be a {dim}-D bfloat16, float16 or float32 tensor, got {t.dtype} "
                         f"{tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_conv(x, conv_states, state_indices, weight, bias, activation, impl, check_indices):
    _check_float("x", x, 2)
    _check_float("conv_states", conv_states, 3)
    _check_float("weight", weight, 2)
    channels, width = weight.shape
    if x.shape[1] != channels or conv_states.shape[2] != channels:
        raise ValueError(f"channels disagree: x {tuple(x.shape)}, conv_states {tuple(conv_states.shape)}, "
                         f"weight {tuple(weight.shape)} (want x [T, C], conv_states [N, R, C], weight [C, W])")
    if width < 2:
        raise ValueError(f"conv width (weight.shape[1]) must be >= 2, got {width}")
    if x.stride(1) != 1 or conv_states.stride(2) != 1:
        raise ValueError("x and conv_states must have contiguous channels (stride 1 in the last dim)")
    if bias is not None:
        _check_float("bias", bias, 1)
        if bias.shape[0] != channels:
            raise ValueError(f"bias must be [{channels}], got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}; allowed: None, 'silu'")
    batch = state_indices.shape[0] if isinstance(state_indices, torch.Tensor) and state_indices.dim() == 1 else -1
    _check_indices_tensor(state_indices, conv_states.shape[0], check_indices, (batch,))
    return batch, width


def _check_indices_tensor(indices, num_states: int, check_values: bool, *shapes) -> None:
    check_flag("check_indices", check_values)
    check_tensor("state_indices", indices)
    if indices.dtype != torch.int32 or tuple(indices.shape) not in shapes or not indices.is_contiguous():
        want = " or ".join(str(list(s)) for s in shapes if -1 not in s) or "[B]"
        raise ValueError(f"state_indices must be contiguous int32 {want}, got {indices.dtype} {tuple(indices.shape)}")
    if not check_values or indices.numel() == 0:
        return
    values = indices.flatten().tolist()
    if min(values) < -1 or max(values) >= num_states:
        raise ValueError(f"state_indices must be -1 (padding) or in [0, {num_states}); got min {min(values)}, "
                         f"max {max(values)}")
    used = [v for v in values if v >= 0]
    if len(set(used)) != len(used):
        raise ValueError("state_indices name one state twice; each request (and each speculative token) owns its own")


def _check_accepted(accepted, batch: int, limit: int, check_values: bool) -> None:
    if accepted is None:
        return
    check_tensor("num_accepted_tokens", accepted)
    if accepted.dtype != torch.int32 or tuple(accepted.shape) != (batch,) or not accepted.is_contiguous():
        raise ValueError(f"num_accepted_tokens must be contiguous int32 [{batch}], got {accepted.dtype} "
                         f"{tuple(accepted.shape)}")
    if check_values and batch:
        low, high = int(accepted.min()), int(accepted.max())
        if low < 1 or high > limit:
            raise ValueError(f"num_accepted_tokens must be in [1, {limit}]; got min {low}, max {high}")


def _check_ragged(offsets, name: str, batch: int, num_tokens: int, check_values: bool) -> None:
    check_tensor(name, offsets)
    if offsets.dtype not in (torch.int32, torch.int64) or tuple(offsets.shape) != (batch + 1,):
        raise ValueError(f"{name} must be int32 or int64 [{batch + 1}], got {offsets.dtype} {tuple(offsets.shape)}")
    if not offsets.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if check_values:
        values = offsets.tolist()
        if values[0] != 0 or values[-1] != num_tokens or any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(f"{name} must rise from 0 to the {num_tokens} tokens, got {values}")


def _check_initial(has_initial_state, batch: int) -> None:
    check_tensor("has_initial_state", has_initial_state)
    if has_initial_state.dtype != torch.bool or tuple(has_initial_state.shape) != (batch,):
        raise ValueError(f"has_initial_state must be bool [{batch}], got {has_initial_state.dtype} "
                         f"{tuple(has_initial_state.shape)}")


def _check_qkv(q, k, v, g, beta, states):
    for name, t, dim in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
        _check_float(name, t, dim, contiguous=True)
    batch, next_n, heads, dim_k = q.shape
    value_heads, dim_v = v.shape[2], v.shape[3]
    lead = (batch, next_n)
    if (k.shape != q.shape or v.shape[:2] != lead or g.shape != (*lead, value_heads, dim_k)
            or beta.shape != (*lead, value_heads) or value_heads % heads):
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"g {tuple(g.shape)}, beta {tuple(beta.shape)} (want q, k [.., H, K], v [.., HV, V], "
                         "g [.., HV, K], beta [.., HV], HV a multiple of H)")
    check_tensor("recurrent_states", states)
    if states.dtype != torch.float32 or states.dim() != 4 or states.shape[1:] != (value_heads, dim_k, dim_v):
        raise ValueError(f"recurrent_states must be float32 [N, {value_heads}, {dim_k}, {dim_v}] (K first), got "
                         f"{states.dtype} {tuple(states.shape)}")
    if states.stride()[1:] != (dim_k * dim_v, dim_v, 1):
        raise ValueError("each recurrent state must be contiguous (strides (K*V, V, 1) after the first dim)")
    return batch, next_n, heads, dim_k


def _scale(scale, dim_k: int) -> float:
    if scale is None:
        return dim_k ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
    return float(scale)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + (a.numel() and sum((s - 1) * st for s, st in zip(a.shape, a.stride())) + 1) * a.element_size()
    b1 = b0 + (b.numel() and sum((s - 1) * st for s, st in zip(b.shape, b.stride())) + 1) * b.element_size()
    return a0 < b1 and b0 < a1


def _conv_out(out, x):
    if out is None:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    check_tensor("out", out)
    if out.shape != x.shape or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {x.dtype} {tuple(x.shape)} with contiguous channels, got {out.dtype} "
                         f"{tuple(out.shape)}")
    if x.numel() and _overlaps(out, x):
        raise ValueError("out must not overlap x (the kernel reads inputs of neighbouring tokens)")
    return out


def _recurrent_out(out, v):
    if out is None:
        return torch.empty_like(v, memory_format=torch.contiguous_format)
    check_tensor("out", out)
    if out.shape != v.shape or out.dtype != v.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {v.dtype} {tuple(v.shape)}, got {out.dtype} {tuple(out.shape)}")
    return out


def _check_fla_runs(q: torch.Tensor) -> None:
    """fla-core's recurrent kernel on CPU tensors needs an interpreter that runs its loop bound."""
    if q.is_cuda or not interpreting():
        return
    import triton

    version = tuple(int(p) for p in triton.__version__.split(".")[:2])
    if version < FLA_INTERPRETER_TRITON:
        raise NotImplementedError(
            f"fla-core's fused_recurrent_kda_fwd does not run under the Triton {triton.__version__} interpreter "
            f"(a TypeError on its loop bound; {'.'.join(map(str, FLA_INTERPRETER_TRITON))} runs it); use "
            "impl='torch' on CPU, or CUDA tensors"
        )
