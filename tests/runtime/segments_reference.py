"""What a decode step over a stored sequence must give, from the segments the store decodes."""

import torch


def explicit_kv(seg):
    """Exact, Recent and every Mid epoch of a Segments, decompressed to explicit K/V."""
    ks, vs = [seg.exact[0]], [seg.exact[1]]
    if seg.recent is not None:
        ks.append(seg.recent[0])
        vs.append(seg.recent[1])
    for mk, mv in seg.retired + ((seg.mid,) if seg.mid is not None else ()):
        ks.append(mk.coefficients @ mk.vectors.transpose(1, 2) + mk.mean[:, None])
        vs.append(mv.coefficients @ mv.vectors.transpose(1, 2) + mv.mean[:, None])
    return torch.cat(ks, 1), torch.cat(vs, 1)


def float64_decode(cache, seq, q, k_new, v_new, scale):
    """float64 attention of q [Hq, 1, d] over the new token and the stored (unprojected) segments of `seq`."""
    seg = cache.segments(seq)
    keys, values = [k_new], [v_new]
    for part in (seg.exact, seg.recent, seg.mid):
        if part is not None:
            keys.append(part[0])
            values.append(part[1])
    assert not seg.retired and not seg.mid_projected
    group = q.shape[0] // k_new.shape[0]
    kk = torch.cat(keys, 1).double().repeat_interleave(group, 0)
    vv = torch.cat(values, 1).double().repeat_interleave(group, 0)
    return torch.softmax(q.double() @ kk.transpose(1, 2) * scale, -1) @ vv
