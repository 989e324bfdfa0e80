"""OVQ-attention's chunked form with no loop over chunks: the discrete choices of every chunk of the call come from
one Triton kernel (:func:`.decide.decide`); given them, the dictionary each chunk reads is linear in the keys and
values, so all chunks' dictionaries and reads are a few batched tensor operations, differentiated by autograd.

Why this is exact: with the paper's rate ``eta = 1 / count`` (eq. 19) a centroid is the running mean of every key
(value) it ever absorbed, its seeding key included. With ``a_i`` the row key ``i`` joined and ``c`` the chunk,
row ``r`` as chunk ``c`` reads it is ``(c0_r d0_r + sum_{c' < c} sum_{i in c', a_i = r} x_i) / count_r^{(c)}``
(``d0, c0``: the dictionary entering the call): a scatter-add of the keys into ``(chunk, row)`` cells and an
exclusive cumulative sum over chunks. The read of eq. 15 for every chunk is then one attention call over
``[snapshot_c ; K_c]`` with the prior ``[log count^{(c)} ; 0]`` and the chunk's causal mask, batched over chunks.
VQ-attention (``static_codebook``, eq. 7-10) is the same with the codebook as every snapshot's keys and each key's
codeword as its row (no kernel: nothing there is sequential).

Not covered (:func:`mixerzoo_ovq.ops.linear_in_keys`): a constant ``centroid_lr`` and ``renormalize`` make the
dictionary non-linear in the keys, and the ``first_key`` seeding is not decided by the kernel; those run
:mod:`mixerzoo_ovq.chunk`'s loop.

Paper: "Online Vector Quantized Attention", arXiv 2602.03922 (v2), sec. 2.2, 3.2 (eq. 15, 17-19), appendix 8.3.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from mixerzoo.decisions import decision
from mixerzoo.ops import max_last

from ... import ops
from ...documents import Piece
from .decide import decide

__all__ = ["chunk_forward", "GROUP_CHUNKS"]

# whole chunks batched into one kernel launch and one attention call at most: a group holds every chunk's
# [dictionary ; chunk] keys and values in the compute dtype and the mask while it runs (float32: 32 chunks x 2176 rows
# x 128 dims x 2 kv heads = 71 MB each), and its backward as much again for their gradients; as many chunks as a
# recomputed segment of the layer (mixerzoo_ovq.layer.TRITON_SEGMENT_CHUNKS), so that a segment is one group
GROUP_CHUNKS = 32


def _plan(spec: ops.Spec, first_chunk: int, n_chunks: int, n0: int) -> tuple[list[int], int]:
    """New centroids of each of ``n_chunks`` chunks from chunk ``first_chunk`` on (eq. 18; integers on the host: the
    schedule depends only on positions and sizes) and the rows after the last."""
    sizes, n = [], n0
    for c in range(first_chunk, first_chunk + n_chunks):
        sizes.append(ops.new_centroid_count(spec.schedule, c, spec.chunk_len, n))
        n += sizes[-1]
    return sizes, n


def _assignments(spec: ops.Spec, kk: torch.Tensor, dk: torch.Tensor, counts: torch.Tensor, first_chunk: int,
                 memo: dict | None) -> tuple[torch.Tensor, int]:
    """``(B, H_kv, C, L)`` each key's dictionary row after its chunk, and the rows after the last chunk; taken from
    ``memo`` when a recomputation in backward has the first run's."""
    B, Hkv, C, L, _ = kk.shape
    n0 = dk.shape[2]
    if memo is not None and "assign" in memo:
        return memo["assign"], memo["rows"]
    with torch.no_grad(), torch.autocast(kk.device.type, enabled=False):  # in the dictionary's dtype, as ops.merge
        if spec.static_codebook:  # the codewords stay: each key's row is its nearest codeword
            assign, rows = max_last(kk.to(dk.dtype) @ dk[:, :, None].transpose(-1, -2))[1], n0
            assign = decision("vq.codeword", assign)
        else:
            n_new, rows = _plan(spec, first_chunk, C, n0)
            scores = None
            if spec.new_centroids == "random":
                scores = torch.stack([ops.random_scores(c, B, Hkv, L, spec.seed, spec.layer_idx)
                                      for c in range(first_chunk, first_chunk + C)], dim=2).to(kk.device)
            n_new_t = torch.tensor(n_new, dtype=torch.int32).to(kk.device)
            assign = decision("ovq.assign", decide(*(t.detach().float() for t in (kk, dk, counts)), n_new_t, scores,
                                                   rows))
    if memo is not None:
        memo["assign"], memo["rows"] = assign, rows
    return assign, rows


def _whole_chunks(spec: ops.Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dk: torch.Tensor,
                  dv: torch.Tensor, counts: torch.Tensor, first_chunk: int, memo: dict | None) -> tuple:
    """``C`` whole chunks starting at chunk ``first_chunk`` with the dictionary ``dk, dv, counts`` ``(B, H_kv, n0,
    D)`` / ``(B, H_kv, n0)`` entering them: ``(o (B, H, C L, D), dk, dv, counts)`` after the last merge."""
    B, H, T, D = q.shape
    Hkv, L = k.shape[1], spec.chunk_len
    C, n0, acc = T // L, dk.shape[2], dk.dtype
    kk, vv = k.reshape(B, Hkv, C, L, D), v.reshape(B, Hkv, C, L, D)
    assign, N = _assignments(spec, kk, dk, counts, first_chunk, memo)
    # counts of each (chunk, row) cell; cell c of ``cum`` the counts chunk c reads (the entering counts plus the
    # earlier chunks'), cell C the counts after the last chunk
    cell = counts.new_zeros(B, Hkv, C, N).scatter_add_(-1, assign, counts.new_ones(()).expand(B, Hkv, C, L))
    c0 = F.pad(counts, (0, N - n0))[:, :, None]
    cum = torch.cat([c0, c0 + cell.cumsum(2)], dim=2)                                     # (B, H_kv, C + 1, N)
    index = assign[..., None].expand(B, Hkv, C, L, D)
    dt = q.dtype

    def snapshots(d0: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every chunk's ``[dictionary ; chunk]`` (:func:`_joined`) and the dictionary after the last chunk
        ``(B, H_kv, N, D)``: the running means, sums over the rows' keys divided by their counts (0 for a row no
        key reached yet). Cell 0 of the sums holds the entering dictionary's, cell ``c + 1`` chunk ``c``'s keys;
        their cumulative sum over the cells, taken in place, is every chunk's entering sums and the sums after the
        last: one ``(C + 1) N D`` tensor in the dictionary's dtype at a time, freed once copied."""
        sums = torch.zeros(B, Hkv, C + 1, N, D, dtype=acc, device=x.device)
        sums[:, :, 1:].scatter_add_(3, index, x.to(acc))
        sums[:, :, 0, :n0] = d0 * counts[..., None]
        sums = sums.cumsum_(2).div_(cum.clamp(min=1)[..., None])
        return _joined(sums[:, :, :C], x, dt), sums[:, :, C].clone()

    if spec.static_codebook:  # the codebook is every chunk's key dictionary; only the value means move
        keys, dk_out = _joined(dk[:, :, None], kk, dt), dk
    else:
        keys, dk_out = snapshots(dk, kk)
    values, dv_out = snapshots(dv, vv)
    o = _attend(q.view(B, H, C, L, D), keys, values, cum[:, :, :C]).reshape(B, H, T, D)
    return o, dk_out, dv_out, cum[:, :, C]


def _joined(snap: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[snapshot_c ; chunk c]`` for every chunk: ``snap (B, H_kv, C or 1, N, D)``, ``x (B, H_kv, C, L, D)`` ->
    ``(B H_kv, C, N + L, D)`` in ``dtype``, written into one tensor (no concatenation of a separate cast copy)."""
    B, Hkv, C, L, D = x.shape
    N = snap.shape[3]
    out = torch.empty(B, Hkv, C, N + L, D, dtype=dtype, device=x.device)
    out[:, :, :, :N] = snap
    out[:, :, :, N:] = x
    return out.view(B * Hkv, C, N + L, D)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Eq. 15 for all chunks at once: ``q (B, H, C, L, D)`` over their ``keys, values (B H_kv, C, N + L, D)``
    (:func:`_joined`) with the prior ``log counts (B, H_kv, C, N)`` over the dictionary rows (``-inf`` where a row
    has none) and the causal mask over the chunk's positions. The ``G`` query heads of a kv head are stacked along
    the query axis; one additive mask. Returns ``(B, H, C, L, D)``."""
    B, H, C, L, D = q.shape
    Hkv, N = counts.shape[1], counts.shape[3]
    G, dt = H // Hkv, q.dtype
    qq = q.view(B, Hkv, G, C, L, D).transpose(2, 3).reshape(B * Hkv, C, G * L, D)
    i = torch.arange(L, device=q.device).repeat(G)[:, None]
    mask = torch.empty(B * Hkv, C, G * L, N + L, dtype=dt, device=q.device)
    mask[..., :N] = counts.log().view(B * Hkv, C, 1, N)
    mask[..., N:] = torch.zeros(G * L, L, dtype=dt, device=q.device).masked_fill(
        torch.arange(L, device=q.device) > i, float("-inf"))
    o = F.scaled_dot_product_attention(qq, keys, values, attn_mask=mask, scale=1.0)
    return o.view(B, Hkv, C, G, L, D).transpose(2, 3).reshape(B, H, C, L, D)


def _packed_plan(spec: ops.Spec, group: list[Piece], buffered: int, n0: int) -> dict:
    """The host's plan of one group of packed documents' pieces (:func:`mixerzoo_ovq.documents.pieces`; each piece
    one chunk slot of ``L`` positions): where each slot's keys, queries and outputs are, which slots are whole
    chunks (merged), the new centroids and dictionary resets of those (eq. 18, counted per document), the rows
    ``N`` the group needs, the last document's rows after it, and the ``(C + 1, C + 1)`` 0/1 matrix that sums
    each slot's document's earlier cells (cell 0: the entering dictionary, of the first document only). Host
    integers and CPU tensors only."""
    L, C = spec.chunk_len, len(group)
    base = group[0].start
    r = [p.pos % L for p in group]                                       # positions before the slot's first token
    n = [p.length for p in group]
    t0 = [p.start - base for p in group]
    doc = [d - int(group[0].reset) for d in itertools.accumulate(int(p.reset) for p in group)]
    # Python integers, one tensor each at the end: torch operations on host tensors would each be a dispatch
    kidx = [buffered + t0[s] - r[s] + j if j < r[s] + n[s] else 0 for s in range(C) for j in range(L)]
    qidx = [t0[s] - r[s] + j if r[s] <= j < r[s] + n[s] else 0 for s in range(C) for j in range(L)]
    oidx = [s * L + r[s] + j for s in range(C) for j in range(n[s])]
    whole = [s for s in range(C) if r[s] + n[s] == L]
    sizes, n_new, resets, rows, last = {0: n0}, [], [], n0, 0
    for s in whole:
        d = doc[s]
        resets.append(int(d != last))
        last = d
        sizes.setdefault(d, 0)
        if not spec.static_codebook:
            n_new.append(ops.new_centroid_count(spec.schedule, group[s].pos // L, L, sizes[d]))
            sizes[d] += n_new[-1]
        rows = max(rows, sizes[d])
    M = [[float(doc[s] == 0)] + [float(c < s and doc[c] == doc[s]) for c in range(C)] for s in range(C)]
    M.append([float(doc[-1] == 0)] + [float(doc[c] == doc[-1]) for c in range(C)])
    return dict(kidx=torch.tensor(kidx), qidx=torch.tensor(qidx), oidx=torch.tensor(oidx), whole=whole,
                n_new=n_new, resets=resets, rows=rows, last_rows=sizes.get(doc[-1], 0), merge=torch.tensor(M),
                merged=torch.tensor([float(s in whole) for s in range(C)]), tail=(r[-1] + n[-1]) % L,
                tail_at=buffered + t0[-1] - r[-1], chunks=[group[s].pos // L for s in whole])


def _packed_group(spec: ops.Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dk: torch.Tensor,
                  dv: torch.Tensor, counts: torch.Tensor, buf_k: torch.Tensor, buf_v: torch.Tensor,
                  group: list[Piece], memo: dict | None) -> tuple:
    """One group of packed documents' chunk slots (batch 1) at once, as :func:`_whole_chunks` does whole chunks:
    each slot one chunk of one document, read over ``[its document's dictionary ; the chunk]``; the dictionaries
    are the running means of the keys of each document's earlier whole chunks (the cells of the slots summed by
    :func:`_packed_plan`'s 0/1 matrix: a cumulative sum that restarts at each document), the decisions one kernel
    launch that empties the dictionary where a document starts. ``dk, dv, counts, buf_k, buf_v``: the state of the
    group's first document entering it (empty where it starts here). Returns ``(o (1, H, T, D), dk, dv, counts,
    buf_k, buf_v)``, the last document's state after the group."""
    B, H, T, D = q.shape
    Hkv, L = k.shape[1], spec.chunk_len
    n0, acc, dt, dev = dk.shape[2], counts.dtype, q.dtype, q.device
    plan = _packed_plan(spec, group, buf_k.shape[2], n0)
    C, N, whole = len(group), plan["rows"], plan["whole"]
    kx = k if buf_k.shape[2] == 0 else torch.cat([buf_k.to(k.dtype), k], dim=2)
    vx = v if buf_v.shape[2] == 0 else torch.cat([buf_v.to(v.dtype), v], dim=2)
    kidx = plan["kidx"].to(dev)
    kk, vv = (t.index_select(2, kidx).view(B, Hkv, C, L, D) for t in (kx, vx))
    qq = q.index_select(2, plan["qidx"].to(dev)).view(B, H, C, L, D)
    if memo is not None and "assign" in memo:
        assign = memo["assign"]
    else:
        with torch.no_grad(), torch.autocast(dev.type, enabled=False):  # in the dictionary's dtype, as ops.merge
            if spec.static_codebook:
                assign = decision("vq.codeword", max_last(kk.to(acc) @ dk[:, :, None].transpose(-1, -2))[1])
            else:
                assign = torch.zeros(B, Hkv, C, L, dtype=torch.long, device=dev)
                if whole:
                    w = torch.tensor(whole, device=dev)
                    scores = None
                    if spec.new_centroids == "random":
                        scores = torch.stack([ops.random_scores(c, B, Hkv, L, spec.seed, spec.layer_idx)
                                              for c in plan["chunks"]], dim=2).to(dev)
                    picked = decide(*(t.detach().float() for t in (kk.index_select(2, w), dk, counts)),
                                    torch.tensor(plan["n_new"], dtype=torch.int32).to(dev), scores, N,
                                    torch.tensor(plan["resets"], dtype=torch.int32).to(dev))
                    assign = assign.index_copy(2, w, decision("ovq.assign", picked))
        if memo is not None:
            memo["assign"] = assign
    merged = plan["merged"].to(device=dev, dtype=acc).view(1, 1, C, 1).expand(B, Hkv, C, L)
    M = plan["merge"].to(device=dev, dtype=acc)
    cells = torch.cat([F.pad(counts, (0, N - n0))[:, :, None],
                       counts.new_zeros(B, Hkv, C, N).scatter_add_(-1, assign, merged)], dim=2)
    cum = torch.einsum("sc,bhcn->bhsn", M, cells)                    # (B, H_kv, C + 1, N): row C after the group
    index = assign[..., None].expand(B, Hkv, C, L, D)

    def snapshots(d0: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As :func:`_whole_chunks`' (running means of the cells), the cells summed per document."""
        sums = torch.zeros(B, Hkv, C + 1, N, D, dtype=acc, device=dev)
        sums[:, :, 1:].scatter_add_(3, index, x.to(acc) * merged[..., None])
        sums[:, :, 0, :n0] = d0 * counts[..., None]
        sums = torch.einsum("sc,bhcnd->bhsnd", M, sums).div_(cum.clamp(min=1)[..., None])
        return _joined(sums[:, :, :C], x, dt), sums[:, :, C]

    if spec.static_codebook:
        keys, dk_out = _joined(dk[:, :, None], kk, dt), dk
    else:
        keys, dk_out = snapshots(dk, kk)
    values, dv_out = snapshots(dv, vv)
    o = _attend(qq, keys, values, cum[:, :, :C]).reshape(B, H, C * L, D).index_select(2, plan["oidx"].to(dev))
    n_last = plan["last_rows"] if not spec.static_codebook else N
    a, tail = plan["tail_at"], plan["tail"]
    # the unfinished chunk; none: new empty tensors, not empty views (a view would keep the group's keys alive)
    buf_k, buf_v = ((kx[:, :, a:a + tail], vx[:, :, a:a + tail]) if tail else
                    (k.new_empty(B, Hkv, 0, D), v.new_empty(B, Hkv, 0, D)))
    return (o, dk_out[:, :, :n_last].clone(), dv_out[:, :, :n_last].clone(), cum[:, :, C, :n_last].clone(), buf_k,
            buf_v)


def _packed(spec: ops.Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, memo: dict | None, carry: tuple,
            pieces: list[Piece], empty: tuple) -> tuple:
    """Packed documents' pieces in groups of chunk slots (:func:`_packed_group`), the
    state carried from group to group; a group that starts a document starts from ``empty``."""
    # GROUP_CHUNKS chunks' worth of slots, one more per document start (a document's partial last chunk): a
    # recomputed segment of GROUP_CHUNKS chunks stays one group however many documents it holds
    size = GROUP_CHUNKS + sum(p.reset for p in pieces)
    groups = [pieces[g:g + size] for g in range(0, len(pieces), size)]
    sizes = [sum(p.length for p in g) for g in groups]
    dk, dv, counts, _, buf_k, buf_v = carry
    outs = []
    for i, (group, qg, kg, vg) in enumerate(zip(groups, q.split(sizes, 2), k.split(sizes, 2), v.split(sizes, 2))):
        if group[0].reset:
            dk, dv, counts, _, buf_k, buf_v = empty
        o, dk, dv, counts, buf_k, buf_v = _packed_group(spec, qg, kg, vg, dk, dv, counts, buf_k, buf_v, group,
                                                        None if memo is None else memo.setdefault(("packed", i), {}))
        outs.append(o)
    return (torch.cat(outs, dim=2) if len(outs) > 1 else outs[0], dk, dv, counts, counts.log(), buf_k, buf_v)


def chunk_forward(spec: ops.Spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, memo: dict | None, pos: int,
                  dk: torch.Tensor, dv: torch.Tensor, counts: torch.Tensor, log_counts: torch.Tensor,
                  buf_k: torch.Tensor, buf_v: torch.Tensor, pieces: list[Piece] | None = None,
                  empty: tuple | None = None) -> tuple:
    """:func:`mixerzoo_ovq.chunk.chunk_forward` (same arguments, shapes and results) with the whole chunks of the call
    in one batch: a leading piece that completes a buffered chunk and a trailing partial chunk take
    :func:`mixerzoo_ovq.ops.advance` (one step each); ``spec`` must satisfy :func:`mixerzoo_ovq.ops.linear_in_keys`.
    Packed documents (``pieces``, ``empty``): every chunk slot of every document in one batch, partial ones too
    (:func:`_packed_group`), no loop over documents.

    Raises:
        ValueError: options the batched form does not cover (:func:`mixerzoo_ovq.ops.check_linear`).
    """
    ops.check_linear(spec, "ovq")
    L, T = spec.chunk_len, q.shape[2]
    if torch.compiler.is_compiling():  # a dict mutated inside a checkpoint: see mixerzoo_ovq.chunk.chunk_forward
        memo = None
    if pieces is not None:
        return _packed(spec, q, k, v, memo, (dk, dv, counts, log_counts, buf_k, buf_v), pieces, empty)
    first = min((L - buf_k.shape[2]) % L, T)   # the rest of a buffered chunk
    n_whole = (T - first) // L
    # whole chunks in groups of at most GROUP_CHUNKS (a long prefill, not cut into recomputed segments, would
    # otherwise hold every chunk's dictionary snapshot at once)
    groups = [min(GROUP_CHUNKS, n_whole - g) * L for g in range(0, n_whole, GROUP_CHUNKS)]
    sizes = [first, *groups, T - first - n_whole * L]
    qs, ks, vs = q.split(sizes, dim=2), k.split(sizes, dim=2), v.split(sizes, dim=2)
    outs, carry = [], (dk, dv, counts, log_counts, buf_k, buf_v)
    if first:
        o, *carry = ops.advance(spec, qs[0], ks[0], vs[0], pos, *carry)
        outs.append(o)
    B, Hkv = k.shape[:2]
    t = pos + first
    for g, (qg, kg, vg) in enumerate(zip(qs[1:-1], ks[1:-1], vs[1:-1])):
        group_memo = None if memo is None else memo.setdefault(g, {})
        o, dk, dv, counts = _whole_chunks(spec, qg, kg, vg, *carry[:3], t // L, group_memo)
        outs.append(o)
        carry = (dk, dv, counts, counts.log(), k.new_empty(B, Hkv, 0, k.shape[3]), v.new_empty(B, Hkv, 0, v.shape[3]))
        t += qg.shape[2]
    if sizes[-1]:
        o, *carry = ops.advance(spec, qs[-1], ks[-1], vs[-1], t, *carry)
        outs.append(o)
    return (torch.cat(outs, dim=2) if len(outs) > 1 else outs[0], *carry)
