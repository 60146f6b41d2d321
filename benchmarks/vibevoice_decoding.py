"""Per-latent latency of VibeVoice (next-token diffusion): transformers' `generate` against
mmgen's causal continuous decoder on the same weights, in one process, interleaved, medians;
and what a speculative window costs (one AR step against one k-latent verify forward).

    python -m benchmarks.vibevoice_decoding --size tiny --latents 32 --repeats 5
    python -m benchmarks.vibevoice_decoding --size official --latents 6 --repeats 3 --threads 2

`official` builds random weights in VibeVoice-1.5B's configuration (Qwen2.5-1.5B backbone,
σ-VAE acoustic tokenizer and semantic encoder of transformers' defaults, 4-layer diffusion
head, 10 DPM-Solver++ steps); `tiny` the test model. Random backbones stop at once, so both
are made to keep speaking (`tests.audio.tiny.keep_speaking`) and every method decodes the
whole budget. The latents of mmgen's AR decode are checked against `generate`'s (same initial
noise) before any time is reported. Timings include each method's per-latent audio decoding
(generate decodes every latent as it goes, as mmgen's model must for the next input).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def build(size: str):
    """A `LatentTTSPipeline` with random weights that keeps speaking."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    from tests.audio import tiny

    if size == "tiny":
        return tiny.tiny_vibevoice(0, speak=1.0)
    from transformers import VibeVoiceConfig, VibeVoiceForConditionalGeneration

    from mmgen.audio.latent_pipeline import LatentTTSPipeline

    torch.manual_seed(0)
    text = dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6)
    config = VibeVoiceConfig(text_config=text, pad_token_id=tiny.VV_EOS, eos_token_id=tiny.VV_EOS,
                             audio_bos_token_id=tiny.VV_AUDIO_BOS, audio_eos_token_id=tiny.VV_AUDIO_EOS,
                             audio_token_id=tiny.VV_AUDIO)
    model = VibeVoiceForConditionalGeneration(config).eval()
    tiny.keep_speaking(model, 20.0)  # channel 0 carries less of the normalised hidden state at this width
    processor = tiny.tiny_vibevoice(0).processor  # the byte tokenizer's ids are the config's special ids
    processor.feature_extractor.sampling_rate = 24000
    return LatentTTSPipeline(model, processor)


def generate_latents(pipe, conditions, latents: int, table: torch.Tensor):
    """transformers' `generate`, its head's initial noise for latent t taken from table[:, t, 0]."""
    import transformers.models.vibevoice.generation_vibevoice as module

    real, step = torch.randn, [0]

    def randn(*shape, **kwargs):
        if len(shape) == 2 and shape[1] == table.shape[-1]:
            x = table[:, step[0], 0]
            step[0] += 1
            return torch.cat([x, torch.zeros_like(x)])
        return real(*shape, **kwargs)

    module.torch.randn = randn
    try:
        return pipe.model.generate(input_ids=conditions.input_ids, attention_mask=conditions.attention_mask,
                                   max_new_tokens=latents, guidance_scale=1.0, return_dict_in_generate=True)
    finally:
        module.torch.randn = real


def window_latency(pipe, conditions, width: int, repeats: int) -> float:
    """Median seconds of one forward of `width` latents (conv decoding of each, both backbone
    passes) plus the head on every position, on a cache warmed with 4 latents."""
    model = pipe.latent_model()
    times = []
    for _ in range(repeats):
        state = model.start(conditions, 64, True)
        x = torch.randn(state.batch_size, 4, model.token_dim)
        model.forward(state, x)
        model.commit(state, torch.full((state.batch_size,), 4))
        window = torch.randn(state.batch_size, width, model.token_dim)
        noise = torch.randn(state.batch_size, width, model.head_steps + 1, model.token_dim)
        start = time.perf_counter()
        model.sample(model.forward(state, window), noise, 1.0, torch.ones(state.batch_size, width))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("tiny", "official"), default="tiny")
    p.add_argument("--latents", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--window", type=int, default=4, help="latents of the verify forward timed against one AR step")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from mmgen.decoding import CausalContinuousSpeculative
    from mmgen.sampling import SamplingConfig

    pipe = build(args.size)
    params = sum(q.numel() for q in pipe.model.parameters())
    conditions, budget = pipe.prepare("Hello there, how are you today?", max_new_frames=args.latents)
    model = pipe.latent_model()
    table = torch.randn(1, budget, model.head_steps + 1, model.token_dim, generator=torch.Generator().manual_seed(0))
    methods = {
        "transformers generate": lambda: generate_latents(pipe, conditions, budget, table),
        "mmgen ar": lambda: CausalContinuousSpeculative().generate(model, conditions, budget, SamplingConfig(),
                                                                   torch.Generator().manual_seed(0)),
    }
    times: dict[str, list[float]] = {name: [] for name in methods}
    results = {}
    with torch.no_grad():
        for _ in range(args.repeats):  # interleaved
            for name, run in methods.items():
                start = time.perf_counter()
                results[name] = run()
                times[name].append(time.perf_counter() - start)
        ours = results["mmgen ar"]
        assert int(ours.lengths[0]) == budget, "the model stopped early"
        audio = model.decode(ours.tokens[0])
        reference = results["transformers generate"].audio[0][0]
        assert audio.shape == reference.shape and float((audio - reference).abs().max()) <= 1e-4 * max(float(reference.abs().max()), 1e-3), \
            "mmgen's latents differ from generate's"
        step = window_latency(pipe, conditions, 1, args.repeats)
        verify = window_latency(pipe, conditions, args.window, args.repeats)
    report = {"size": args.size, "parameters": params, "latents": budget, "threads": torch.get_num_threads(), "methods": {},
              "ar_step_s": step, f"verify{args.window}_s": verify, "verify_over_step": verify / step}
    for name, values in times.items():
        report["methods"][name] = {"s_per_latent": statistics.median(values) / budget,
                                   "spread": (max(values) - min(values)) / statistics.median(values)}
    print(json.dumps(report, indent=1))
    base = report["methods"]["transformers generate"]["s_per_latent"]
    print(f"| VibeVoice {args.size} ({params / 1e6:.1f}M) | " + " | ".join(
        f"{name}: {m['s_per_latent'] * 1000:.1f} ms/latent ({base / m['s_per_latent']:.2f}x)" for name, m in report["methods"].items())
        + f" | AR step {step * 1000:.1f} ms, {args.window}-latent verify {verify * 1000:.1f} ms ({verify / step:.2f}x) |")


if __name__ == "__main__":
    main()
