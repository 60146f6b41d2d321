import pytest
import torch

from mmgen.cache import StaticKVCache

from tests.conftest import tiny_transformer


def test_mask_follows_each_rows_positions():
    cache = StaticKVCache(1, 2, 1, 8, 4)
    cache.advance(torch.tensor([2, 5]))
    mask = cache.attention_mask(cache.positions(2))[:, 0]
    assert mask.shape == (2, 2, 8)
    assert mask[0, 0].tolist() == [True] * 3 + [False] * 5
    assert mask[1, 1].tolist() == [True] * 7 + [False]
    cache.rollback(torch.tensor([1, 1]))
    assert cache.positions(1).flatten().tolist() == [1, 1]


@torch.no_grad()
def test_rollback_then_refeed_equals_fresh_forward():
    model = tiny_transformer()
    labels = torch.tensor([1, 4])
    tokens = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))

    # Feed 5 tokens, keep 2, then feed 4 others over the rejected tail.
    cache = model.setup_cache(2, 20)
    model.forward_hidden(model.embed_conditions(labels), cache.positions(1), cache)
    cache.advance(1)
    model.forward_hidden(model.tok_embeddings(tokens[:, :5]), cache.positions(5), cache)
    cache.advance(2)
    refed = model.forward_hidden(model.tok_embeddings(tokens[:, 5:]), cache.positions(4), cache)

    fresh = model.setup_cache(2, 20)
    model.forward_hidden(model.embed_conditions(labels), fresh.positions(1), fresh)
    fresh.advance(1)
    sequence = torch.cat([tokens[:, :2], tokens[:, 5:]], dim=1)
    expected = model.forward_hidden(model.tok_embeddings(sequence), fresh.positions(6), fresh)[:, 2:]
    torch.testing.assert_close(refed, expected, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_rows_at_different_lengths_do_not_interact():
    model = tiny_transformer()
    labels = torch.tensor([2, 7])
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    committed = torch.tensor([1, 4])

    cache = model.setup_cache(2, 16)
    model.forward_hidden(model.embed_conditions(labels), cache.positions(1), cache)
    cache.advance(1)
    model.forward_hidden(model.tok_embeddings(tokens[:, :4]), cache.positions(4), cache)
    cache.advance(committed)
    # Row 0 now sits after 1 token, row 1 after 4; feed each its continuation.
    nxt = torch.stack([tokens[0, 1:4], tokens[1, 4:7]])
    batched = model.forward_hidden(model.tok_embeddings(nxt), cache.positions(3), cache)

    for row in range(2):
        alone = model.setup_cache(1, 16)
        model.forward_hidden(model.embed_conditions(labels[row : row + 1]), alone.positions(1), alone)
        alone.advance(1)
        n = int(committed[row])
        seq = torch.cat([tokens[row, :n], nxt[row]])[None]
        expected = model.forward_hidden(model.tok_embeddings(seq), alone.positions(seq.shape[1]), alone)[:, n:]
        torch.testing.assert_close(batched[row : row + 1], expected, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_cached_decoding_equals_full_causal_forward():
    model = tiny_transformer()
    labels = torch.tensor([3, 5])
    tokens = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(2))
    full, _ = model(tokens[:, :-1], labels)
    cache = model.setup_cache(2, 20)
    first = model.forward_hidden(model.embed_conditions(labels), cache.positions(1), cache)
    cache.advance(1)
    rest = model.forward_hidden(model.tok_embeddings(tokens[:, :-1]), cache.positions(11), cache)
    torch.testing.assert_close(torch.cat([first, rest], 1), full, rtol=1e-5, atol=1e-5)


class _Layer:
    def __init__(self, keys, values):
        self.keys, self.values = keys, values


class _Store:
    """A stand-in for transformers' DynamicCache: layers of [R, H, S, D] keys/values, crop(-n)."""

    def __init__(self, rows, slots, layers=2):
        self.layers = [_Layer(torch.arange(rows * slots, dtype=torch.float32).view(rows, 1, slots, 1) + 1000 * i,
                              -torch.arange(rows * slots, dtype=torch.float32).view(rows, 1, slots, 1)) for i in range(layers)]

    def crop(self, n):
        for layer in self.layers:
            layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]

    def append(self, n):
        for layer in self.layers:
            rows, _, s, _ = layer.keys.shape
            new = torch.arange(s, s + n, dtype=torch.float32).view(1, 1, n, 1).expand(rows, 1, n, 1) + 100 * torch.arange(rows).view(rows, 1, 1, 1)
            layer.keys, layer.values = torch.cat([layer.keys, new], 2), torch.cat([layer.values, -new], 2)


def test_slot_cache_commit_rewind_and_compaction_keep_each_rows_tokens_in_order():
    from mmgen.cache import SlotKVCache

    store = _Store(rows=2, slots=3)
    cache = SlotKVCache(store, torch.ones(2, 3, dtype=torch.bool), prompt_length=3, compact_ratio=None)
    mask, positions = cache.open(4)
    store.append(4)
    assert mask.shape == (2, 7) and positions.tolist() == [[3, 4, 5, 6]] * 2
    cache.commit(torch.tensor([4, 1]))
    assert cache.positions.tolist() == [7, 4] and cache.mask[:, 3:].tolist() == [[True] * 4, [True, False, False, False]]
    kept_row1 = store.layers[0].keys[1, 0, :, 0][cache.mask[1]].tolist()
    cache.compact(4)  # row 1's single kept slot moves right; its keys come along
    assert cache.mask[:, 3:].tolist() == [[True] * 4, [False, False, False, True]]
    assert store.layers[0].keys[1, 0, :, 0][cache.mask[1]].tolist() == kept_row1
    cache.rewind(torch.tensor([2, 1]))
    assert cache.positions.tolist() == [5, 4] and cache.mask.sum(1).tolist() == [5, 4]


def test_slot_cache_eviction_and_recent_window():
    from mmgen.cache import CachePolicy, SlotKVCache

    store = _Store(rows=2, slots=10)
    cache = SlotKVCache(store, torch.ones(2, 10, dtype=torch.bool), prompt_length=10, compact_ratio=None)
    drop = torch.zeros(2, 10, dtype=torch.bool)
    drop[0, 3:6] = True  # token dropping: row 0 loses three prompt tokens
    cache.evict(drop)
    assert cache.mask.sum(1).tolist() == [7, 10] and cache.positions.tolist() == [10, 10]  # positions stay
    cache.keep(CachePolicy())  # global: nothing more leaves
    assert cache.mask.sum(1).tolist() == [7, 10]
    cache.keep(CachePolicy.parse("sink:2,window:4"))
    assert cache.mask[0].nonzero().flatten().tolist() == [0, 1, 6, 7, 8, 9]
    assert cache.mask[1].nonzero().flatten().tolist() == [0, 1, 6, 7, 8, 9]


@pytest.mark.parametrize("version, keyword", [("5.23.0", "past_key_values"), ("5.24.0", "cache"), ("5.40.0.dev0", "cache"),
                                              ("6.1.2", "cache")])
def test_transformers_models_get_their_cache_under_their_versions_keyword(monkeypatch, version, keyword):
    """transformers 5.24 renamed every model's `past_key_values` argument to `cache` (the old name
    warns, and goes in 5.40): adapters pass `**transformers_cache(store)`."""
    import transformers

    from mmgen.cache import _cache_keyword, transformers_cache

    monkeypatch.setattr(transformers, "__version__", version)
    _cache_keyword.cache_clear()
    try:
        assert transformers_cache("store") == {keyword: "store"}
    finally:
        _cache_keyword.cache_clear()
