"""Rendered text-line images with known ground truth, for OCR calibration and evaluation.

Lines are windows of real English prose (public-domain sentences in corpus_en.txt) or
digit-heavy strings (dates, prices, times, codes), drawn with PIL in several TrueType fonts
on light backgrounds.  Everything is a function of the seed.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFilter, ImageFont

CORPUS_PATH = Path(__file__).with_name("corpus_en.txt")
# DejaVu 2.37 (fonts/LICENSE: Bitstream Vera terms), shipped with netquant: the rendered lines, and so every
# measurement made on them, are the same on every machine, whatever fonts it has installed
DEJAVU_DIR = Path(__file__).with_name("fonts")
DEJAVU_FACES = ("DejaVuSans.ttf", "DejaVuSerif.ttf", "DejaVuSans-Bold.ttf", "DejaVuSansMono.ttf",
                "DejaVuSerif-Bold.ttf", "DejaVuSansCondensed.ttf")
MAX_ASPECT = 320 / 48  # widest line (w / h) the recognizer sees without squeezing


@dataclass(frozen=True)
class TextLine:
    """One rendered line: its ground-truth text and an RGB image."""

    text: str
    image: Image.Image


@functools.cache
def corpus_words() -> tuple[str, ...]:
    """Words of the bundled English corpus, in reading order."""
    return tuple(CORPUS_PATH.read_text(encoding="utf-8").split())


@functools.cache
def _font_sources() -> tuple[str | None, ...]:
    """netquant's DejaVu faces plus PIL's bundled default font (None)."""
    return (*(str(DEJAVU_DIR / f) for f in DEJAVU_FACES), None)


@functools.cache
def _font(source: str | None, size: int) -> ImageFont.FreeTypeFont:
    if source is None:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1: a real TrueType font (Aileron)
    return ImageFont.truetype(source, size=size)


def _numeric_text(rng: random.Random) -> str:
    """A digit-heavy line: dates, prices, times, quantities, reference codes."""
    kind = rng.randrange(7)
    if kind == 0:
        return f"{rng.randint(1, 28):02d}/{rng.randint(1, 12):02d}/{rng.randint(1950, 2030)}"
    if kind == 1:
        return f"Total ${rng.randint(1, 9999)}.{rng.randint(0, 99):02d}"
    if kind == 2:
        return f"Open {rng.randint(6, 11):02d}:{rng.choice(('00', '15', '30', '45'))} to {rng.randint(16, 23)}:00"
    if kind == 3:
        return f"Tel {rng.randint(100, 999)}-{rng.randint(100, 999)}-{rng.randint(1000, 9999)}"
    if kind == 4:
        return f"No. {rng.randint(10, 99999)}, Room {rng.randint(1, 950)}"
    if kind == 5:
        return f"{rng.randint(2, 500)} items at {rng.randint(1, 99)}.{rng.randint(0, 99):02d} each"
    return f"Order {rng.randint(1000, 999999)} {rng.choice(('A', 'B', 'C', 'X', 'K'))}{rng.randint(1, 99)}"


def _prose_text(rng: random.Random, max_words: int) -> str:
    words = corpus_words()
    n = rng.randint(2, max_words)
    start = rng.randrange(len(words) - n)
    return " ".join(words[start:start + n])


def _fit(text: str, font: ImageFont.FreeTypeFont, height: int, pad_x: int) -> str:
    """Drop trailing words until the image (text + margins) is no wider than MAX_ASPECT * height."""
    words = text.split(" ")
    while len(words) > 1 and int(font.getlength(" ".join(words))) + 2 * pad_x > MAX_ASPECT * height:
        words.pop()
    return " ".join(words)


def render_line(text: str, rng: random.Random) -> TextLine:
    """Draw `text` with a random font, size, colours and margins; the text may be shortened to fit."""
    source = rng.choice(_font_sources())
    size = rng.randint(26, 34)
    font = _font(source, size)
    ascent, descent = font.getmetrics()
    pad_y = rng.randint(3, 8)
    height = ascent + descent + 2 * pad_y
    pad_x = rng.randint(3, 12)
    text = _fit(text, font, height, pad_x)
    width = int(font.getlength(text)) + 2 * pad_x
    bg = rng.randint(185, 255)
    tint = [max(0, min(255, bg + rng.randint(-15, 15))) for _ in range(3)]
    ink = rng.randint(0, 80)
    fg = tuple(max(0, min(255, ink + rng.randint(-20, 20))) for _ in range(3))
    image = Image.new("RGB", (width, height), tuple(tint))
    ImageDraw.Draw(image).text((pad_x, pad_y), text, font=font, fill=fg)
    if rng.random() < 0.3:
        image = image.filter(ImageFilter.GaussianBlur(radius=rng.uniform(0.3, 0.8)))
    return TextLine(text=text, image=image)


def make_text_lines(count: int, seed: int = 0, *, numeric_fraction: float = 0.3,
                    max_words: int = 5) -> list[TextLine]:
    """`count` rendered lines, deterministic in `seed`; about `numeric_fraction` are digit-heavy."""
    rng = random.Random(seed)
    lines = []
    for _ in range(count):
        text = _numeric_text(rng) if rng.random() < numeric_fraction else _prose_text(rng, max_words)
        lines.append(render_line(text, rng))
    return lines
