"""Model hooks (mmgen.hooks): attached for one block of work, always detached after it."""

import pytest
import torch

from mmgen.hooks import ModelHook, attach_hook, detach_hook, hooks_attached


class Double(ModelHook):
    def post_forward(self, module, output):
        return output * 2


class Skip(ModelHook):
    """Replaces the whole forward (what token-dropping hooks do)."""

    def new_forward(self, module, x):
        return x


def test_hooks_wrap_forward_and_are_removed_even_on_error():
    layer = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    plain = layer(x)
    with hooks_attached({layer: Double()}, "double"):
        assert torch.equal(layer(x), plain * 2)
    assert torch.equal(layer(x), plain)
    with pytest.raises(RuntimeError, match="boom"):
        with hooks_attached({layer: Skip()}, "skip"):
            assert torch.equal(layer(x), x)
            raise RuntimeError("boom")
    assert torch.equal(layer(x), plain)
    attach_hook(layer, Double(), "double")
    with pytest.raises(ValueError):
        attach_hook(layer, Double(), "double")  # one hook per name
    detach_hook(layer, "double")
    detach_hook(layer, "double")  # nothing left: no error
    assert torch.equal(layer(x), plain)


def test_fastvar_runs_as_hooks_and_leaves_none_on_the_model():
    """FastVAR's pruning is a hook on the pruned blocks for each decode call only: afterwards the
    blocks are plain again and a full decode gives what it gave before."""
    from mmgen.decoding import CachedTokenPruning
    from mmgen.image_ar.var import VARPipeline
    from tests.image_ar.test_var_pipeline import tiny_transformer, tiny_vqvae

    pipe = VARPipeline(tiny_transformer(depth=4), tiny_vqvae())
    pipe.set_progress_bar_config(disable=True)
    plain = pipe([1, 2], generator=torch.Generator().manual_seed(0), output_type="pt").tokens
    pruned = pipe([1, 2], generator=torch.Generator().manual_seed(0), output_type="pt",
                  pruning=CachedTokenPruning(keep={-1: 0.5}, layers=(1, -1))).tokens
    assert not torch.equal(plain, pruned)  # the hooks did run
    assert all(not getattr(block, "_diffusers_hook", None) or not block._diffusers_hook.hooks for block in pipe.transformer.blocks)
    again = pipe([1, 2], generator=torch.Generator().manual_seed(0), output_type="pt").tokens
    assert torch.equal(plain, again)
