"""Quality proxies for generated images that need no download: a classifier trained here.

A small timm classifier (random init, trained on the same image set as the generators) gives
two figures: the *class accuracy* of generated samples (does an image of class c look like
class c?) and an *FID-proxy*, the Fréchet distance between its penultimate features on
generated samples and on the real data set. They are proxies, not FID: the feature space is
this classifier's, not Inception's, and the values are only comparable across runs scored by
the same bundled classifier, with the same number of samples (the Fréchet distance is biased
upwards for small sample counts). `docs/benchmarks.md` shows how they move with known
degradations.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from mmgen.hub import folder_file, load_state_dict, load_strict, read_json, save_safetensors
from mmgen.inference import inference
from mmgen.quality import feature_statistics, frechet_distance


@dataclass
class ClassifierConfig:
    architecture: str = "resnet10t"
    num_classes: int = 74
    image_size: int = 64


def build_classifier(config: ClassifierConfig) -> torch.nn.Module:
    import timm

    return timm.create_model(config.architecture, pretrained=False, num_classes=config.num_classes)


class ImageQualityProxies:
    """Class accuracy and FID-proxy of images, scored by a bundled classifier.

    Images are float tensors [N, 3, H, W] in [0, 1] (a pipeline's `output_type="pt"`).
    """

    def __init__(self, classifier: torch.nn.Module, config: ClassifierConfig, reference_mean: torch.Tensor, reference_cov: torch.Tensor):
        self.classifier = classifier.eval()
        self.config = config
        self.reference_mean, self.reference_cov = reference_mean.double(), reference_cov.double()

    @classmethod
    def from_pretrained(cls, folder: Union[str, os.PathLike]) -> "ImageQualityProxies":
        # Never through a link out of the folder (`folder_file`).
        config = ClassifierConfig(**read_json(folder_file(folder, "config.json")))
        model = build_classifier(config)
        load_strict(model, load_state_dict(folder_file(folder, "model.safetensors")), source=str(folder))
        reference = load_state_dict(folder_file(folder, "reference_statistics.safetensors"))
        return cls(model, config, reference["mean"], reference["cov"])

    @classmethod
    def fit(cls, classifier: torch.nn.Module, config: ClassifierConfig, real_images: torch.Tensor) -> "ImageQualityProxies":
        """A scorer whose reference statistics are the classifier's features on `real_images`."""
        scorer = cls(classifier, config, torch.zeros(1), torch.zeros(1, 1))
        scorer.reference_mean, scorer.reference_cov = feature_statistics(scorer.features_and_logits(real_images)[0])
        return scorer

    def save_pretrained(self, folder: Union[str, os.PathLike], dtype: Optional[torch.dtype] = None) -> None:
        """Write config, weights (floating tensors in `dtype` if given) and reference statistics."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.config.__dict__, indent=2) + "\n")
        state = self.classifier.state_dict()
        if dtype is not None:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        save_safetensors(state, folder / "model.safetensors")
        save_safetensors({"mean": self.reference_mean.float(), "cov": self.reference_cov.float()}, folder / "reference_statistics.safetensors")

    @inference
    def features_and_logits(self, images: torch.Tensor, batch_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"expected images [N, 3, H, W] in [0, 1], got shape {tuple(images.shape)}")
        device = next(self.classifier.parameters()).device
        features, logits = [], []
        for chunk in images.split(batch_size):
            x = chunk.to(device, torch.float32) * 2 - 1  # the classifier was trained on [-1, 1]
            if x.shape[-1] != self.config.image_size:
                x = torch.nn.functional.interpolate(x, size=self.config.image_size, mode="bilinear", antialias=True)
            pooled = self.classifier.forward_head(self.classifier.forward_features(x), pre_logits=True)
            features.append(pooled.cpu())
            logits.append(self.classifier.get_classifier()(pooled).cpu())
        return torch.cat(features), torch.cat(logits)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """{"accuracy", "fid_proxy", "num_images"} for images meant to show classes `labels`."""
        features, logits = self.features_and_logits(images)
        mean, cov = feature_statistics(features)
        return {
            "accuracy": float((logits.argmax(-1) == labels.cpu()).float().mean()),
            "fid_proxy": frechet_distance(mean, cov, self.reference_mean, self.reference_cov),
            "num_images": len(images),
        }
