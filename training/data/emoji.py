"""The emoji image set: Noto Color Emoji rendered at 64x64, labelled by Unicode subgroup.

Sources (Debian packages, nothing else is fetched):
  fonts-noto-color-emoji  /usr/share/fonts/truetype/noto/NotoColorEmoji.ttf (bitmaps at size 109)
  unicode-data            /usr/share/unicode/emoji/emoji-test.txt (groups, subgroups, status)

Every fully-qualified emoji the font draws as one glyph becomes a 64x64 RGB image (transparent
background composited on white, bounding box centred on a square canvas, Lanczos resize);
its class is its subgroup ("face-smiling", "animal-mammal", ...). Subgroups with fewer than
`min_per_class` images are dropped. The split is deterministic: within each class, every
`eval_every`-th image (in file order) is held out for evaluation.

    apt-get install fonts-noto-color-emoji unicode-data
    python -m training.data.emoji --out data/emoji64.npz
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import numpy as np
from PIL import ImageFont

from mmgen.image_ar.emoji import FONT, parse_emoji_test, render  # the one renderer (the video clips use it too)


def build(size: int = 64, min_per_class: int = 8, eval_every: int = 10) -> dict[str, np.ndarray]:
    font = ImageFont.truetype(FONT, 109)
    images, subgroups, names = [], [], []
    for emoji, name, _group, subgroup in parse_emoji_test():
        image = render(emoji, font, size)
        if image is not None:
            images.append(np.asarray(image, dtype=np.uint8))
            subgroups.append(subgroup)
            names.append(name)
    counts = {s: subgroups.count(s) for s in dict.fromkeys(subgroups)}
    classes = [s for s, c in counts.items() if c >= min_per_class]
    index = {s: i for i, s in enumerate(classes)}
    keep = [i for i, s in enumerate(subgroups) if s in index]
    labels = np.array([index[subgroups[i]] for i in keep], dtype=np.int64)
    seen: dict[int, int] = {}
    is_eval = []
    for label in labels:
        seen[label] = seen.get(label, -1) + 1
        is_eval.append(seen[label] % eval_every == eval_every - 1)
    return {
        "images": np.stack([images[i] for i in keep]),
        "labels": labels,
        "is_eval": np.array(is_eval),
        "names": np.array([names[i] for i in keep]),
        "class_names": np.array(classes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/emoji64.npz")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--min-per-class", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=10)
    args = parser.parse_args()
    data = build(args.size, args.min_per_class, args.eval_every)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.npz")
    np.savez_compressed(tmp, **data)
    os.replace(tmp, out)
    digest = hashlib.sha256(data["images"].tobytes()).hexdigest()[:16]
    print(f"wrote {out}: {len(data['labels'])} images, {len(data['class_names'])} classes, "
          f"{int(data['is_eval'].sum())} held out; images sha256[:16]={digest}")


if __name__ == "__main__":
    main()
