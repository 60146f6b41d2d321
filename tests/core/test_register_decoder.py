"""A decoder kind defined outside the core is one `register_decoder` call: every pipeline of its
family then takes it by name, in Python and on the command line, with its options from the
spec; a taken or malformed name is refused."""

from dataclasses import dataclass

import pytest
import torch

import mmgen
from mmgen.cli import main
from mmgen.decoding import (
    DECODERS,
    Autoregressive,
    ExactAcceptance,
    Proposer,
    register_decoder,
    unregister_decoder,
)
from mmgen.sampling import one_hot


@dataclass
class RepeatDrafts(Autoregressive):
    """A toy decoder for the registry: draft `every` copies of the newest token, verified by the
    exact rule (so as lossless as any draft)."""

    every: int = 1

    @property
    def window(self) -> int:  # tokens per row per forward: sizes the cache (`Decoder.capacity`)
        return self.every + 1

    def roles(self, model, num_tokens, generator):
        return RepeatProposer(self.every), ExactAcceptance()


class RepeatProposer(Proposer):
    def __init__(self, num_draft: int):
        self.num_draft = num_draft

    def propose(self, run):
        drafts = run.newest().expand(-1, self.num_draft).clone()
        return drafts, one_hot(drafts, run.vocab_size)  # deterministic drafts: one-hot laws


@pytest.fixture
def registered():
    register_decoder("token", "repeat", RepeatDrafts)
    yield
    unregister_decoder("token", "repeat")


def test_a_registered_decoder_runs_by_name_everywhere(registered, tmp_path, capsys):
    pipe = mmgen.load_pipeline("emoji64")
    pipe.set_progress_bar_config(disable=True)
    assert "repeat" in type(pipe).decoders()
    ar = pipe([3, 40], decoding="ar", temperature=0, generator=torch.Generator().manual_seed(0), output_type="pt")
    out = pipe([3, 40], decoding="repeat:every=3", temperature=0, generator=torch.Generator().manual_seed(0), output_type="pt")
    assert isinstance(pipe.decoder("repeat:every=3"), RepeatDrafts) and pipe.decoder("repeat:every=3").every == 3
    assert torch.equal(out.tokens, ar.tokens)  # greedy: the exact rule keeps AR's tokens
    assert main(["generate", "image", "--class-labels", "3", "--decoding", "repeat:every=2", "--out", str(tmp_path),
                 "--json"]) == 0
    assert len(list(tmp_path.glob("*.png"))) == 1
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['often'\] for decoding 'repeat'"):
        pipe.decoder("repeat:often=2")


def test_bad_registrations_are_refused(registered):
    with pytest.raises(ValueError, match="already registered for token models"):
        register_decoder("token", "repeat", RepeatDrafts)
    with pytest.raises(ValueError, match="already registered"):
        register_decoder("token", "sjd", RepeatDrafts)
    with pytest.raises(ValueError, match="unknown decoder family 'tokens'"):
        register_decoder("tokens", "other", RepeatDrafts)
    with pytest.raises(ValueError, match="lowercase name"):
        register_decoder("token", "Bad:Name", RepeatDrafts)
    unregister_decoder("token", "repeat")
    assert "repeat" not in DECODERS
    register_decoder("token", "repeat", RepeatDrafts)  # the fixture's teardown removes it again
