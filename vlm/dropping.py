"""Visual token dropping for VLMs, as hooks on transformers' own modules (`mmgen.hooks`).

Policies (frozen dataclasses, picked by `make_dropping("fastv:layer=2,keep_ratio=0.25")`):

- `FastV` (Chen et al. 2024, arXiv 2403.06764): after layer K, keep the visual tokens the last
  prompt token attended to most in layer K-1 (head mean); anchor K=2, R=0.75 (keep 0.25).
- `VisionZip` (Yang et al. 2024, arXiv 2412.04467): before the LM, keep the dominant visual
  tokens by the vision encoder's attention (CLS attention in CLIP; mean attention received in
  SigLIP and Qwen's tower, which have no CLS) plus a few contextual tokens, each the mean of the remaining tokens
  most similar to it.
- `MustDrop` (Liu et al. 2024, arXiv 2411.10803): merge spatially adjacent similar visual
  tokens before the LM, filter by the text's dual attention (global mean + individual max over
  the text queries) after layer K, and evict the visual KV the first output token attends to
  least at decode.

How it runs. A `Prefill` attaches hooks for one prefill only: on the language model (trunk)
a pre-forward gathers the tokens a pre-LM stage keeps into a shorter left-padded sequence,
merged embeddings included; on decoder layers >= K a pre-forward gathers hidden states, rotary
tables and the mask at layer K and hands the shorter ones to every later layer. Attention stays
SDPA: the few scores a policy needs are recomputed from the attention module's own projections
and rotary function on its captured inputs. Every kept token keeps its ORIGINAL position ids
(1-D for LLaVA / Idefics3, the 3-D M-RoPE ids transformers computed on the full sequence for
Qwen2.5-VL), so keep_ratio 1.0 computes exactly what the unpruned model does. Video tokens are
visual tokens like image tokens (each policy counts, scores and drops them; MustDrop never
merges an image token with a video's).

After the prefill all layers hold the same kept slots (the core's `SlotKVCache` has one slot
axis): layers before K are gathered to the final kept set, so at decode new tokens no longer
see the dropped tokens in those layers either (FastV's prefill-only code keeps them there; this
is the cheaper, cache-compacting variant, and the one a decode with one KV layout can run).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Optional, Union

import torch

from mmgen.decoding import parse_decoding
from mmgen.hooks import ModelHook, hooks_attached

from mmgen.vlm.layout import visual_token_ids


# -------------------------------------------------------------------------------- policies
def _check_ratio(name: str, value: Any, low_open: bool = True) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value <= 1):
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")


def _check_layer(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"layer must be an integer >= 0, got {value!r}")


@dataclass(frozen=True)
class FastV:
    """Drop the visual tokens least attended by the last prompt token after layer `layer`
    (scores from layer `layer - 1`, or layer 0's own attention for layer 0); keep `keep_ratio`
    of each row's visual tokens (FastV's R = 1 - keep_ratio)."""

    layer: int = 2
    keep_ratio: float = 0.25
    name: ClassVar[str] = "fastv"

    def __post_init__(self):
        _check_layer(self.layer)
        _check_ratio("keep_ratio", self.keep_ratio)

    @property
    def identity(self) -> bool:
        return self.keep_ratio >= 1


@dataclass(frozen=True)
class VisionZip:
    """Keep `keep_ratio` of each row's visual tokens before the LM: dominant ones by the vision
    encoder's attention, plus `contextual` x that budget of contextual tokens (VisionZip's 10 of
    64), each the mean of the remaining tokens most similar to it, at its own position."""

    keep_ratio: float = 0.25
    contextual: float = 0.15
    name: ClassVar[str] = "visionzip"

    def __post_init__(self):
        _check_ratio("keep_ratio", self.keep_ratio)
        if isinstance(self.contextual, bool) or not isinstance(self.contextual, (int, float)) or not 0 <= self.contextual < 1:
            raise ValueError(f"contextual must be a number in [0, 1), got {self.contextual!r}")

    @property
    def identity(self) -> bool:
        return self.keep_ratio >= 1


@dataclass(frozen=True)
class MustDrop:
    """Three stages (MustDrop): visual tokens whose cosine similarity to their left neighbour
    exceeds `merge_threshold` merge into it before the LM; after layer `layer` the text's dual
    attention keeps `keep_ratio` of the row's original visual tokens (half by the global mean
    attention of the text queries, the rest by their individual max); at the first decode step
    the visual KV the newest token attends to least is evicted down to `decode_keep` of it.
    keep_ratio 1.0 turns every stage off."""

    keep_ratio: float = 0.25
    layer: int = 2
    merge_threshold: float = 0.9
    decode_keep: float = 0.5
    name: ClassVar[str] = "mustdrop"

    def __post_init__(self):
        _check_ratio("keep_ratio", self.keep_ratio)
        _check_layer(self.layer)
        _check_ratio("decode_keep", self.decode_keep)
        if isinstance(self.merge_threshold, bool) or not isinstance(self.merge_threshold, (int, float)) or not -1 <= self.merge_threshold <= 1:
            raise ValueError(f"merge_threshold must be a number in [-1, 1], got {self.merge_threshold!r}")

    @property
    def identity(self) -> bool:
        return self.keep_ratio >= 1


Policy = Union[FastV, VisionZip, MustDrop]
DROPPING_POLICIES: dict[str, type] = {"fastv": FastV, "visionzip": VisionZip, "mustdrop": MustDrop}


def make_dropping(spec: Union[None, str, Policy]) -> Optional[Policy]:
    """A policy from None, a policy object or a spec ("fastv", "fastv:layer=2,keep_ratio=0.25")."""
    if spec is None or isinstance(spec, tuple(DROPPING_POLICIES.values())):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"dropping must be None, a policy object or a spec such as 'fastv:keep_ratio=0.25', got {spec!r}")
    name, options = parse_decoding(spec)
    if name not in DROPPING_POLICIES:
        raise ValueError(f"unknown dropping policy {name!r}: use one of {sorted(DROPPING_POLICIES)}")
    cls = DROPPING_POLICIES[name]
    valid = sorted(f.name for f in fields(cls))
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for dropping {name!r}; valid options: {valid}")
    return cls(**options)


# -------------------------------------------------------------------------------- report
@dataclass
class DroppingReport:
    """What one prefill dropped. Per row: `image_tokens` (visual tokens of the prompt, video tokens included),
    `kept_tokens` (visual tokens in the cache after the prefill), `prompt_tokens` (unpadded,
    before / `kept_prompt_tokens` after), `merged_tokens` (merged into a neighbour or a
    contextual token before the LM), `evicted_tokens` (visual KV evicted at decode) and
    `kept_slots` (each row's kept prompt tokens as indices of the unpruned, padded prompt).
    Analytic prefill FLOPs of the language model per layer (multiply-add = 2), summed over rows,
    full vs pruned: `attention_flops_*` (q/k/v/o projections + causal scores and values) and
    `mlp_flops_*` (gated MLP). The vision encoder and the LM head are not counted."""

    policy: str
    image_tokens: list[int]
    kept_tokens: list[int]
    prompt_tokens: list[int]
    kept_prompt_tokens: list[int]
    attention_flops_full: list[float]
    mlp_flops_full: list[float]
    attention_flops_pruned: list[float]
    mlp_flops_pruned: list[float]
    merged_tokens: list[int] = field(default_factory=list)
    evicted_tokens: list[int] = field(default_factory=list)
    kept_slots: list[list[int]] = field(default_factory=list)

    @property
    def prefill_flops_full(self) -> float:
        return sum(self.attention_flops_full) + sum(self.mlp_flops_full)

    @property
    def prefill_flops_pruned(self) -> float:
        return sum(self.attention_flops_pruned) + sum(self.mlp_flops_pruned)

    @property
    def flops_saved(self) -> float:
        """Share of the LM's prefill FLOPs the dropping removed."""
        return 1 - self.prefill_flops_pruned / self.prefill_flops_full if self.prefill_flops_full else 0.0


def layer_flops(config: Any, n: torch.Tensor) -> tuple[float, float]:
    """(attention, MLP) FLOPs of one decoder layer over rows of `n` [R] tokens each."""
    d, heads = config.hidden_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None) or d // heads
    n = n.double()
    proj = 2 * n * d * (2 * heads * hd + 2 * kv * hd)
    scores = 4 * heads * hd * n * (n + 1) / 2  # q.k and p.v over the causal triangle
    return float((proj + scores).sum()), float((6 * n * d * config.intermediate_size).sum())


# -------------------------------------------------------------------------------- helpers
def left_pack(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index [R, S'], valid [R, S']) gathering each row's kept slots, in order, to the right
    end of S' = the largest count (left padding; padding entries index slot 0)."""
    rows, s = keep.shape
    counts = keep.sum(1, keepdim=True)
    width = int(counts.max()) if rows else 0
    dest = torch.where(keep, width - counts + keep.long().cumsum(1) - 1, width)
    index = torch.zeros(rows, width + 1, dtype=torch.long, device=keep.device)
    index = index.scatter(1, dest, torch.arange(s, device=keep.device).expand(rows, s))[:, :width]
    valid = torch.arange(width, device=keep.device) >= width - counts
    return torch.where(valid, index, 0), valid


def gather_seq(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """x gathered along its sequence axis `dim` by index [R, S'] (rows on axis dim - 1)."""
    shape = [1] * x.dim()
    shape[dim - 1], shape[dim] = index.shape
    view = index.view(shape).expand(*x.shape[:dim - 1], *index.shape, *x.shape[dim + 1:])
    return x.gather(dim, view)


def top_per_row(scores: torch.Tensor, eligible: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Bool [R, S]: each row's `counts[r]` highest-scoring eligible slots (ties: lower slot)."""
    masked = torch.where(eligible, scores.float(), -torch.inf)
    order = masked.argsort(dim=1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    return eligible & (rank < counts[:, None])


def attention_to_keys(attn: torch.nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      queries: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """Head-mean causal attention probabilities [R, Q, S] of the slots `queries` [R, Q] over all
    S slots, recomputed from a decoder attention module's own projections and rotary function
    (its SDPA forward returns no weights). `h` is the module's input (normed hidden states)."""
    rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    rows, s, _ = h.shape
    hd = attn.head_dim
    hq = gather_seq(h, queries, 1)
    q = attn.q_proj(hq).view(rows, queries.shape[1], -1, hd).transpose(1, 2)
    k = attn.k_proj(h).view(rows, s, -1, hd).transpose(1, 2)
    q, _ = rotary(q, q, gather_seq(cos, queries, 1), gather_seq(sin, queries, 1))
    k, _ = rotary(k, k, cos, sin)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = (q.float() @ k.float().transpose(-1, -2)) * attn.scaling
    slots = torch.arange(s, device=h.device)
    visible = key_valid[:, None, :] & (slots[None, None, :] <= queries[:, :, None])
    logits = logits.masked_fill(~visible[:, None], -torch.inf)
    return logits.softmax(-1).nan_to_num(0.0).mean(1)


def pack_mask(mask: Any, index: torch.Tensor, valid: torch.Tensor) -> Any:
    """A layer's attention mask over left-packed rows (`index` [R, S'] into the mask's slots,
    `valid` [R, S'] the kept ones): a 4-D mask [R, 1, S, S] keeps its own pattern (causal,
    sliding window, prefix-LM) between the kept slots, None (SDPA's implicit causal mask) becomes
    the causal mask; a dict by layer type is packed per type. Bool for SDPA, additive for eager
    (the mask's float dtype). A query always sees itself, so padding queries never produce NaN."""
    if isinstance(mask, dict):
        return {kind: pack_mask(m, index, valid) for kind, m in mask.items()}
    s = valid.shape[1]
    eye = torch.eye(s, dtype=torch.bool, device=valid.device)
    if mask is None:
        allowed = eye.cumsum(0).bool()[None] & valid[:, None, :]  # key <= query
        return (allowed | eye)[:, None]
    rows = valid.shape[0]
    full = mask.expand(rows, 1, mask.shape[2], mask.shape[3])
    packed = full.gather(2, index[:, None, :, None].expand(-1, 1, -1, full.shape[3]))
    packed = packed.gather(3, index[:, None, None, :].expand(-1, 1, s, -1))
    if mask.dtype == torch.bool:
        return (packed & valid[:, None, None, :]) | eye
    low = torch.finfo(mask.dtype).min
    return packed.masked_fill(~valid[:, None, None, :], low).masked_fill(eye, 0.0)


class Capture(ModelHook):
    """Remembers a module's keyword inputs (attention modules are called with keywords); with
    `every`, the inputs of each call in order (a vision tower runs once for images, once for videos)."""

    def __init__(self, store: dict, key: str, every: bool = False):
        super().__init__()
        self.store, self.key, self.every = store, key, every

    def pre_forward(self, module, *args, **kwargs):
        if self.every:
            self.store.setdefault(self.key, []).append((args, kwargs))
        else:
            self.store[self.key] = (args, kwargs)
        return args, kwargs


class _Call(ModelHook):
    """Rewrites a module's inputs through `fn(module, args, kwargs) -> (args, kwargs)`."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def pre_forward(self, module, *args, **kwargs):
        return self.fn(module, args, kwargs)


# -------------------------------------------------------------------------------- the prefill
class Prefill:
    """One pruned prefill of a `VLMTokenModel`'s transformers model: `hooks()` attaches what the
    policy needs for the duration of the model call; afterwards `finish(kv)` makes every cache
    layer hold the final kept slots, and `index` [R, S'] / `valid` give them as original slots."""

    def __init__(self, policy: Policy, model: Any, trunk: Any, input_ids: torch.Tensor, mask: torch.Tensor):
        self.policy, self.model, self.trunk = policy, model, trunk
        self.config = model.config.get_text_config()
        layers = self.config.num_hidden_layers
        self.layer = getattr(policy, "layer", None)
        if self.layer is not None and self.layer >= layers:
            raise ValueError(f"dropping layer {self.layer} is past the language model's {layers} layers")
        # [R, S] visual slots: image and video tokens alike, by kind in the order the model
        # encodes them (images, then videos), the tower's calls in VisionZip
        self.kinds = [(input_ids == token) & mask.bool() for token in visual_token_ids(model.config)]
        self.image = torch.stack(self.kinds).any(0)
        self.visual_ids = torch.where(self.image, input_ids, -1)  # each visual slot's token, -1 elsewhere
        self.mask = mask.bool()
        rows, s = mask.shape
        self.index = torch.arange(s, device=mask.device).expand(rows, s)  # current slots -> original
        self.valid = self.mask.clone()
        self.stage1 = None  # (index, valid) after the pre-LM stage, as original slots
        self.store: dict = {}
        self.early_index = None  # index into the stage-1 layout for the layers before K
        self.merged = torch.zeros(rows, dtype=torch.long, device=mask.device)

    # ---- hooks
    def hooks(self):
        p, hooks = self.policy, {}
        if isinstance(p, (VisionZip, MustDrop)):
            hooks[self.trunk] = _Call(self._pre_lm)
        if isinstance(p, VisionZip):
            attn, kind = self._vision_attention()
            hooks[attn] = Capture(self.store, "vision", every=True)
            self.vision_kind = kind
            if kind == "qwen":  # its grid gives the window order the scores come in
                hooks[self.model.model.visual] = Capture(self.store, "visual", every=True)
        if self.layer is not None:
            layers = self.trunk.layers
            if self.layer > 0:
                hooks[layers[self.layer - 1].self_attn] = Capture(self.store, "scores")
            for i in range(self.layer, len(layers)):
                hooks[layers[i]] = _Call(self._in_lm if i == self.layer else self._later)
        return self._with_deepstack(hooks_attached(hooks, "mmgen_dropping"))

    @contextlib.contextmanager
    def _with_deepstack(self, hooks):
        """Qwen3-VL adds vision features to the visual tokens' hidden states after its first
        layers (deepstack, `trunk._deepstack_process`), at the visual slots of the unpruned
        prompt: for the prefill its visual mask and features follow the kept slots."""
        process = getattr(self.trunk, "_deepstack_process", None)
        with hooks:
            if process is None:
                yield
                return
            def kept_only(hidden, visual_pos_masks, visual_embeds):
                current = gather_seq(visual_pos_masks.to(hidden.device), self.index, 1) & self.valid
                kept = torch.zeros(visual_pos_masks.shape, dtype=torch.long, device=hidden.device)
                kept = kept.scatter_reduce(1, self.index, self.valid.long(), reduce="amax").bool()
                return process(hidden, current, visual_embeds[kept[visual_pos_masks.to(hidden.device)]])
            self.trunk._deepstack_process = kept_only
            try:
                yield
            finally:
                del self.trunk._deepstack_process

    # ---- pre-LM stage (VisionZip, MustDrop's merging)
    def _pre_lm(self, trunk, args, kwargs):
        embeds, mask = kwargs["inputs_embeds"], kwargs["attention_mask"]
        if isinstance(self.policy, VisionZip):
            keep, embeds = self._visionzip(embeds)
        else:
            keep, embeds = self._merge_neighbours(embeds)
        keep = keep | (self.mask & ~self.image)
        index, valid = left_pack(keep)
        self.index, self.valid, self.stage1 = index, valid, (index, valid)
        kwargs["inputs_embeds"] = gather_seq(embeds, index, 1)
        # A 2-D padding mask becomes the packed rows'; the model's own 4-D masks (a dict by
        # layer type: prefix-LM images, sliding windows) keep their pattern over the kept slots.
        kwargs["attention_mask"] = valid.to(mask.dtype) if torch.is_tensor(mask) and mask.dim() == 2 else pack_mask(mask, index, valid)
        pos = kwargs.get("position_ids")
        if pos is not None:
            kwargs["position_ids"] = gather_seq(pos, index, pos.dim() - 1)
        return args, kwargs

    def _visionzip(self, embeds):
        p = self.policy
        n_image = self.image.sum(1)
        budget = torch.ceil(n_image.double() * p.keep_ratio).long()
        n_ctx = torch.floor(budget.double() * p.contextual).long()
        scores = torch.zeros(self.image.shape, device=embeds.device)
        flat, start = self._vision_scores().to(embeds.device), 0
        for kind in self.kinds:  # images' scores, then videos' (the model encodes them in that order)
            count = int(kind.sum())
            scores[kind] = flat[start:start + count]
            start += count
        dominant = top_per_row(scores, self.image, budget - n_ctx)
        keep, embeds = dominant.clone(), embeds.clone()
        for r in range(embeds.shape[0]):  # contextual merge: small, per row
            rest = (self.image[r] & ~dominant[r]).nonzero().squeeze(1)
            c = int(n_ctx[r])
            if c == 0 or rest.numel() == 0:
                continue
            targets = rest[torch.linspace(0, rest.numel() - 1, c, device=rest.device).round().long().unique()]
            x = torch.nn.functional.normalize(embeds[r, rest].float(), dim=-1)
            t = torch.nn.functional.normalize(embeds[r, targets].float(), dim=-1)
            group = (x @ t.T).argmax(1)  # each remaining token joins its most similar target
            sums = torch.zeros(len(targets), embeds.shape[-1], device=embeds.device).index_add_(0, group, embeds[r, rest].float())
            counts = torch.bincount(group, minlength=len(targets)).clamp_min(1)[:, None]
            embeds[r, targets] = (sums / counts).to(embeds.dtype)
            keep[r, targets] = True
            self.merged[r] = rest.numel() - len(targets)
        return keep, embeds

    def _merge_neighbours(self, embeds):
        """MustDrop's local spatial merging, along raster order: a visual token merges into its
        left neighbour's group when their cosine similarity exceeds the threshold; the group's
        mean sits at its first token (and position)."""
        e = torch.nn.functional.normalize(embeds.float(), dim=-1)
        sim = (e[:, 1:] * e[:, :-1]).sum(-1)
        link = torch.zeros_like(self.image)
        same = self.visual_ids[:, 1:] == self.visual_ids[:, :-1]  # an image token never merges into a video's
        link[:, 1:] = self.image[:, 1:] & self.image[:, :-1] & same & (sim > self.policy.merge_threshold)
        group = (~link).long().cumsum(1) - 1  # [R, S]: each slot's group (the anchor's rank)
        rows, s, d = embeds.shape
        flat = (group + torch.arange(rows, device=group.device)[:, None] * s).view(-1)
        sums = torch.zeros(rows * s, d, device=embeds.device).index_add_(0, flat, embeds.float().view(-1, d))
        counts = torch.zeros(rows * s, device=embeds.device).index_add_(0, flat, torch.ones_like(flat, dtype=torch.float))
        mean = (sums[flat] / counts[flat, None]).view(rows, s, d).to(embeds.dtype)
        anchors = self.image & ~link
        self.merged = link.sum(1)
        return anchors, torch.where(anchors[..., None], mean, embeds)

    def _vision_attention(self):
        inner = self.model.model
        if hasattr(inner, "image_newline"):
            raise ValueError(f"VisionZip is not available for LLaVA-NeXT's layout (model_type {self.model.config.model_type!r}): "
                             "its any-resolution tiles, unpadding and newline tokens do not map the vision tower's attention "
                             "onto the prompt's image tokens; use fastv or mustdrop")
        if hasattr(inner, "vision_tower"):  # LLaVA: CLIP, the layer whose output is the feature
            tower = inner.vision_tower
            layers = (tower.vision_model if hasattr(tower, "vision_model") else tower).encoder.layers
            select = self.model.config.vision_feature_layer
            if not isinstance(select, int):
                raise ValueError("VisionZip needs a single vision_feature_layer")
            return layers[select if select >= 0 else len(layers) + select].self_attn, "cls"
        if hasattr(inner, "vision_model"):  # Idefics3 / SmolVLM: SigLIP, no CLS
            return inner.vision_model.encoder.layers[-1].self_attn, "mean"
        if hasattr(getattr(inner, "visual", None), "blocks"):  # Qwen2-VL / Qwen2.5-VL / Qwen3-VL: no CLS, patch merger
            return inner.visual.blocks[-1].attn, "qwen"
        raise ValueError(f"VisionZip is not available for {self.model.config.model_type}: it reads a CLIP, SigLIP or Qwen "
                         "vision encoder's attention (LLaVA, Idefics3, Qwen2-VL); use fastv or mustdrop")

    def _vision_scores(self) -> torch.Tensor:
        """Each visual token's score, flat in the model's feature order (the tower runs once for
        a batch's images, then once for its videos)."""
        present = sum(bool(kind.any()) for kind in self.kinds)
        calls = len(self.store["vision"])
        if calls != present:
            raise ValueError(f"VisionZip read {calls} vision tower run(s) for {present} kind(s) of visual tokens in "
                             f"{self.model.config.model_type}; use fastv or mustdrop")
        return torch.cat([self._tower_scores(call) for call in range(calls)])

    def _tower_scores(self, call: int) -> torch.Tensor:
        """The scores of the tower's `call`-th run: the CLS token's attention (CLIP) or the mean
        attention received (SigLIP, pooled over the connector's pixel-shuffle groups), head
        mean, recomputed from the captured layer input."""
        attn = self._vision_attention()[0]
        if self.vision_kind == "qwen":
            return self._qwen_vision_scores(attn, call)
        args, kwargs = self.store["vision"][call]
        h = kwargs.get("hidden_states", args[0] if args else None)
        n, s, _ = h.shape
        heads = attn.num_heads
        q = attn.q_proj(h).view(n, s, heads, -1).transpose(1, 2).float()
        k = attn.k_proj(h).view(n, s, heads, -1).transpose(1, 2).float()
        probs = ((q @ k.transpose(-1, -2)) * attn.scale).softmax(-1).mean(1)  # [n, s, s]
        if self.vision_kind == "cls":
            scores = probs[:, 0]
            if self.model.config.vision_feature_select_strategy == "default":
                scores = scores[:, 1:]
            return scores.reshape(-1)
        received = probs.mean(1)  # [n, s]
        connector = self.model.model.connector
        pooled = connector.pixel_shuffle(received[..., None], self.model.config.scale_factor)
        return pooled.sum(-1).reshape(-1)

    def _qwen_vision_scores(self, attn, call: int) -> torch.Tensor:
        """Mean attention each merged visual token receives in the vision tower's last block
        (Qwen has no CLS): the block's packed sequence [patches, dim] is split by its
        `cu_seqlens` (whole images, or windows for a windowed block), the patches' received
        attention summed over each merger group, and Qwen2.5-VL's window order undone, so the
        scores line up with the image (or video) tokens of the prompt."""
        args, kwargs = self.store["vision"][call]
        h = kwargs.get("hidden_states", args[0] if args else None)
        cu = kwargs.get("cu_seqlens", args[1] if len(args) > 1 else None)
        cos, sin = kwargs["position_embeddings"]
        seq = h.shape[0]
        q, k, _ = attn.qkv(h).reshape(seq, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        q, k = sys.modules[type(attn).__module__].apply_rotary_pos_emb_vision(q, k, cos, sin)
        received = []
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            qs, ks = q[start:end].transpose(0, 1).float(), k[start:end].transpose(0, 1).float()  # [heads, n, d]
            received.append(((qs @ ks.transpose(-1, -2)) * attn.scaling).softmax(-1).mean(0).mean(0))
        visual = self.model.model.visual
        merged = torch.cat(received).view(-1, visual.spatial_merge_unit).sum(1)
        if hasattr(visual, "fullatt_block_indexes"):  # Qwen2.5-VL ran its blocks in window order
            v_args, v_kwargs = self.store["visual"][call]
            grid = v_kwargs.get("grid_thw", v_args[1] if len(v_args) > 1 else None)
            window_index, _ = sys.modules[type(visual).__module__].get_vision_window_index(
                grid, spatial_merge_size=visual.spatial_merge_size, window_size=visual.window_size,
                patch_size=visual.patch_size, kwargs={})
            merged = merged[torch.argsort(window_index)]
        return merged

    # ---- in-LM stage (FastV, MustDrop's dual-attention filter)
    def _in_lm(self, layer, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"]
        if self.layer > 0:
            a_args, a_kwargs = self.store["scores"]
            source, h = self.trunk.layers[self.layer - 1].self_attn, a_kwargs["hidden_states"]
        else:
            source, h = layer.self_attn, layer.input_layernorm(hidden)
        image = gather_seq(self.image, self.index, 1) & self.valid  # visual slots, current layout
        rows, s = image.shape
        n_image = self.image.sum(1)
        budget = torch.ceil(n_image.double() * self.policy.keep_ratio).long()
        slots = torch.arange(s, device=image.device).expand(rows, s)
        if isinstance(self.policy, FastV):
            probs = attention_to_keys(source, h, cos, sin, slots[:, -1:], self.valid)  # the last prompt token
            keep = top_per_row(probs[:, 0], image, budget)
        else:  # MustDrop: the text tokens after the row's first visual token guide the filter
            text = self.valid & ~image & (image.long().cumsum(1) > 0)
            probs = attention_to_keys(source, h, cos, sin, slots, self.valid)  # [R, S, S], few rows of text matter
            weight = text[:, :, None].float()
            glob = (probs * weight).sum(1) / weight.sum(1).clamp_min(1)
            indiv = (probs * weight).amax(1)
            first = top_per_row(glob, image, (budget + 1) // 2)
            keep = first | top_per_row(indiv, image & ~first, budget - first.sum(1))
        keep = keep | (self.valid & ~image)
        index, valid = left_pack(keep)
        self.early_index = index
        self.index, self.valid = gather_seq(self.index, index, 1), valid
        hidden = gather_seq(hidden, index, 1)
        self.pruned = dict(position_embeddings=(gather_seq(cos, index, 1), gather_seq(sin, index, 1)))
        pos = kwargs.get("position_ids")
        if pos is not None:
            self.pruned["position_ids"] = gather_seq(pos, index, pos.dim() - 1)
        args = (hidden, *args[1:]) if args else args
        if not args:
            kwargs["hidden_states"] = hidden
        return self._later(layer, args, kwargs)

    def _later(self, layer, args, kwargs):
        # Each layer's own mask (full, sliding-window or prefix-LM), over the kept slots.
        kwargs.update(self.pruned, attention_mask=pack_mask(kwargs.get("attention_mask"), self.early_index, self.valid))
        return args, kwargs

    # ---- after the model call
    def finish(self, kv: Any) -> None:
        """Layers before K hold the pre-K layout: gather them to the final kept slots."""
        if self.early_index is None:
            return
        for i in range(self.layer):
            layer = kv.layers[i]
            index = self.early_index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)

    def report(self) -> DroppingReport:
        full = self.mask.sum(1)
        kept_image = (gather_seq(self.image, self.index, 1) & self.valid).sum(1)
        kept = self.valid.sum(1)
        before_k = self.stage1[1].sum(1) if self.stage1 is not None else full
        cfg, layers = self.config, self.config.num_hidden_layers
        k = self.layer if self.layer is not None else 0
        full_f = [layer_flops(cfg, full)] * layers
        pruned_f = [layer_flops(cfg, before_k if i < k else kept) for i in range(layers)]
        spec = self.policy.name + ":" + ",".join(f"{f.name}={getattr(self.policy, f.name)}" for f in fields(self.policy))
        return DroppingReport(
            policy=spec, image_tokens=self.image.sum(1).tolist(), kept_tokens=kept_image.tolist(),
            prompt_tokens=full.tolist(), kept_prompt_tokens=kept.tolist(),
            attention_flops_full=[a for a, _ in full_f], mlp_flops_full=[m for _, m in full_f],
            attention_flops_pruned=[a for a, _ in pruned_f], mlp_flops_pruned=[m for _, m in pruned_f],
            merged_tokens=self.merged.tolist(), evicted_tokens=[0] * len(full),
            kept_slots=[row[ok].tolist() for row, ok in zip(self.index, self.valid)],
        )


def decode_eviction(policy: Policy, trunk: Any, h_store: dict, kv: Any, slot_mask: torch.Tensor,
                    visual: torch.Tensor) -> torch.Tensor:
    """MustDrop's output-aware cache policy: the newest committed token's attention (layer K,
    head mean, recomputed from the captured input of that layer's attention) over each row's
    visual slots (`slot_mask` [R, S]: the slots that token sees); returns the drop mask [R, S]
    evicting all but `decode_keep` of them."""
    attn = trunk.layers[policy.layer].self_attn
    args, kwargs = h_store["decode"]
    h = kwargs["hidden_states"][:, :1]
    cos, sin = (t[:, :1] for t in kwargs["position_embeddings"])
    rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    rows = h.shape[0]
    q = attn.q_proj(h).view(rows, 1, -1, attn.head_dim).transpose(1, 2)
    q, _ = rotary(q, q, cos, sin)
    keys = kv.layers[policy.layer].keys  # rotary already applied, written by this forward
    s = slot_mask.shape[1]
    keys = keys[:, :, :s].repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
    logits = (q.float() @ keys.float().transpose(-1, -2))[:, :, 0] * attn.scaling  # [R, H, S]
    probs = logits.masked_fill(~slot_mask[:, None], -torch.inf).softmax(-1).nan_to_num(0.0).mean(1)
    live = visual & slot_mask[:, : visual.shape[1]]
    live = torch.nn.functional.pad(live, (0, s - live.shape[1]))
    counts = live.sum(1)
    keep = top_per_row(probs, live, torch.ceil(counts.double() * policy.decode_keep).long())
    return live & ~keep
