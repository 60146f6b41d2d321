"""Batch-invariant attention (`mmgen.batch_invariant`): a row in a padded batch gets exactly
what it gets alone over its own visible keys, and the per-mask row grouping a forward's first
layer works out is reused by its later layers only while the mask is unchanged."""

import torch

from mmgen.batch_invariant import row_groups, rowwise_attention


class Attention(torch.nn.Module):
    is_causal = False
    training = False


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    B, H, q, k, D = 3, 2, 2, 7, 8
    query, key, value = (torch.randn(B, H, n, D, generator=g) for n in (q, k, k))
    mask = torch.ones(B, 1, q, k, dtype=torch.bool)
    mask[0, ..., :3] = False  # left padding
    mask[1, ..., 5:] = False  # right padding (a shorter text beside a longer one)
    mask[2, ..., 2] = False  # a hole (a slot another row took before this one joined)
    return query, key, value, mask


def test_each_row_gets_what_it_gets_alone_over_its_visible_keys():
    module = Attention()
    query, key, value, mask = batch()
    out, _ = rowwise_attention(module, query, key, value, mask, scaling=0.3, dropout=0.0)
    for b in range(3):
        keep = mask[b].any(dim=(0, 1)).nonzero().flatten()
        alone, _ = rowwise_attention(module, query[b:b + 1], key[b:b + 1, :, keep].contiguous(),
                                     value[b:b + 1, :, keep].contiguous(), mask[b:b + 1][..., keep].contiguous(),
                                     scaling=0.3, dropout=0.0)
        assert torch.equal(out[b], alone[0])


def test_the_row_grouping_is_kept_on_the_mask_until_it_changes():
    module = Attention()
    query, key, value, mask = batch()
    first, _ = rowwise_attention(module, query, key, value, mask, scaling=0.3, dropout=0.0)
    calls = row_groups(mask, mask, query.device)
    assert row_groups(mask, mask, query.device) is calls  # the next layer reads it back
    again, _ = rowwise_attention(module, query, key, value, mask, scaling=0.3, dropout=0.0)
    assert torch.equal(first, again)
    mask[0, ..., :3] = True  # changed in place: worked out again
    assert row_groups(mask, mask, query.device) is not calls
    fresh, _ = rowwise_attention(module, query, key, value, mask.clone(), scaling=0.3, dropout=0.0)
    changed, _ = rowwise_attention(module, query, key, value, mask, scaling=0.3, dropout=0.0)
    assert torch.equal(fresh, changed) and not torch.equal(fresh[0], first[0])
