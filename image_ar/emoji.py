"""Emoji sprites from Debian's Noto Color Emoji font, named and grouped by Unicode's emoji-test.txt.

The one renderer of the project's emoji data: the image set (`training/data/emoji.py`) and
the moving-emoji clips (`mmgen.video.data`) both draw with it. Installed with the package so
that clips can be made outside a source checkout; it needs the Debian packages below.

    apt-get install fonts-noto-color-emoji unicode-data
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

FONT = "/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf"
EMOJI_TEST = "/usr/share/unicode/emoji/emoji-test.txt"


def parse_emoji_test(path: str = EMOJI_TEST) -> list[tuple[str, str, str, str]]:
    """(emoji, name, group, subgroup) for every fully-qualified line, in file order."""
    entries, group, subgroup = [], None, None
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.startswith("# group:"):
            group = line.split(":", 1)[1].strip()
        elif line.startswith("# subgroup:"):
            subgroup = line.split(":", 1)[1].strip()
        elif line and not line.startswith("#") and "; fully-qualified" in line:
            codepoints, comment = line.split(";", 1)[0], line.split("#", 1)[1].strip()
            emoji = "".join(chr(int(cp, 16)) for cp in codepoints.split())
            name = comment.split(" ", 2)[2] if comment.count(" ") >= 2 else comment
            entries.append((emoji, name, group, subgroup))
    return entries


def render(emoji: str, font: ImageFont.FreeTypeFont, size: int) -> Image.Image | None:
    """The emoji as an RGB square on white, or None when the font draws it as several glyphs."""
    canvas = Image.new("RGBA", (512, 160), (0, 0, 0, 0))
    ImageDraw.Draw(canvas).text((8, 8), emoji, font=font, embedded_color=True)
    box = canvas.getbbox()
    if box is None:
        return None
    width, height = box[2] - box[0], box[3] - box[1]
    if width > 1.3 * 136 or height > 1.3 * 136:  # a sequence the font could not ligate
        return None
    side = max(width, height)
    square = Image.new("RGBA", (side, side), (255, 255, 255, 0))
    square.alpha_composite(canvas.crop(box), ((side - width) // 2, (side - height) // 2))
    white = Image.new("RGBA", square.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, square).convert("RGB").resize((size, size), Image.LANCZOS)
