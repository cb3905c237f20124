"""CNNs trained here on CPU to a real accuracy, for accuracy claims (random weights are only for exactness tests).

Task: rendered glyph classification. 36 classes (digits and capital letters), each image 64 x 64 RGB: the glyph in one
of the DejaVu faces (or PIL's default font), random size, position, rotation (+-20 degrees), ink / paper colours, a
distractor glyph fragment at the border, blur and Gaussian noise. Every image is a function of (split seed, index).
Models: MobileNetV2 (torchvision's architecture: inverted residual blocks, ReLU6, BatchNorm; width 0.5 or 1.0) and
ResNet-18 (torchvision's BasicBlock layout; RECIPES: epochs and how many of the training images, sized for one
core), trained with AdamW + one-cycle schedule, label smoothing, seeded; state dicts
and ONNX exports (opset 17, BatchNorm folded) are cached in $NETQUANT_CACHE/cnns.

    python benchmarks/trained_cnns.py [--models mobilenetv2_050 resnet18]   # trains what is not cached, prints accuracy
"""

from __future__ import annotations

import argparse
import math
import random
import string
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter

from netquant.api.zoo import cache_dir
from netquant.data.text_render import _font, _font_sources

CLASSES = string.digits + string.ascii_uppercase
SIZE = 64
MEAN = (0.5, 0.5, 0.5)
STD = (0.25, 0.25, 0.25)


# ---------------------------------------------------------------------------------------------------- data
def render_glyph(label: int, rng: random.Random) -> Image.Image:
    paper = tuple(rng.randint(150, 255) for _ in range(3))
    ink = tuple(rng.randint(0, 110) for _ in range(3))
    img = Image.new("RGB", (SIZE * 2, SIZE * 2), paper)
    draw = ImageDraw.Draw(img)
    source = rng.choice(_font_sources())
    font = _font(source, rng.randint(52, 84))
    # a fragment of another glyph near the border: the model must find the centred one
    other = _font(rng.choice(_font_sources()), rng.randint(40, 70))
    draw.text((rng.choice((-10, 90)), rng.randint(0, 90)), rng.choice(CLASSES), fill=ink, font=other)
    box = draw.textbbox((0, 0), CLASSES[label], font=font)
    w, h = box[2] - box[0], box[3] - box[1]
    x = SIZE - w // 2 - box[0] + rng.randint(-8, 8)
    y = SIZE - h // 2 - box[1] + rng.randint(-8, 8)
    draw.text((x, y), CLASSES[label], fill=ink, font=font)
    img = img.rotate(rng.uniform(-20, 20), resample=Image.BILINEAR, fillcolor=paper)
    img = img.crop((SIZE // 2, SIZE // 2, SIZE * 3 // 2, SIZE * 3 // 2))
    if rng.random() < 0.5:
        img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.2)))
    return img


def to_tensor(img: Image.Image, noise: float, rng: np.random.Generator) -> np.ndarray:
    x = np.asarray(img, dtype=np.float32) / 255.0
    x = x + rng.normal(0, noise, x.shape).astype(np.float32)
    x = (x - np.array(MEAN, np.float32)) / np.array(STD, np.float32)
    return x.transpose(2, 0, 1)


def make_split(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` images [N, 3, 64, 64] (normalized) and labels, a function of `seed`."""
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    labels = np.array([i % len(CLASSES) for i in range(count)], dtype=np.int64)
    rng.shuffle(labels)  # type: ignore[arg-type]
    images = np.stack([to_tensor(render_glyph(int(label), rng), rng.uniform(0.0, 0.06), nrng) for label in labels])
    return images, labels


def dataset(name: str) -> tuple[np.ndarray, np.ndarray]:
    """'train' (24k), 'calib' (512, disjoint seed), 'val' (2k, held out): cached .npz."""
    counts = {"train": (24000, 1), "calib": (512, 2), "val": (2000, 3)}
    count, seed = counts[name]
    path = cache_dir() / "cnns" / f"glyphs36_{name}_{count}_s{seed}.npz"
    if path.is_file():
        data = np.load(path)
        return data["x"], data["y"]
    path.parent.mkdir(parents=True, exist_ok=True)
    x, y = make_split(count, seed)
    np.savez(path, x=x, y=y)
    return x, y


# ---------------------------------------------------------------------------------------------------- models
def _divisible(v: float, d: int = 8) -> int:
    new = max(d, int(v + d / 2) // d * d)
    return new + d if new < 0.9 * v else new


class ConvBNAct(torch.nn.Sequential):
    def __init__(self, cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1, act: bool = True) -> None:
        layers: list[torch.nn.Module] = [torch.nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                                         torch.nn.BatchNorm2d(cout)]
        if act:
            layers.append(torch.nn.ReLU6(inplace=True))
        super().__init__(*layers)


class InvertedResidual(torch.nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.use_res = stride == 1 and cin == cout
        layers: list[torch.nn.Module] = [] if expand == 1 else [ConvBNAct(cin, hidden, 1)]
        layers += [ConvBNAct(hidden, hidden, 3, stride, groups=hidden), ConvBNAct(hidden, cout, 1, act=False)]
        self.conv = torch.nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(torch.nn.Module):
    """torchvision's MobileNetV2 layout (t, c, n, s settings), width multiplier, classifier on global average pool."""

    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1))

    def __init__(self, classes: int, width: float = 1.0) -> None:
        super().__init__()
        cin = _divisible(32 * width)
        last = _divisible(1280 * max(1.0, width))
        layers: list[torch.nn.Module] = [ConvBNAct(3, cin, stride=2)]
        for t, c, n, s in self.SETTINGS:
            cout = _divisible(c * width)
            for i in range(n):
                layers.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        layers.append(ConvBNAct(cin, last, 1))
        self.features = torch.nn.Sequential(*layers)
        self.classifier = torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.Linear(last, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.nn.functional.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


class BasicBlock(torch.nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else torch.nn.Sequential(
            torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(torch.nn.Module):
    """torchvision's ResNet-18 layout (7x7 stem, max pool, 4 stages of 2 BasicBlocks)."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False), torch.nn.BatchNorm2d(64),
                                        torch.nn.ReLU(inplace=True), torch.nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = torch.nn.Sequential(*blocks)
        self.fc = torch.nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))


@dataclass(frozen=True)
class Recipe:
    build: str
    epochs: int
    lr: float
    batch: int = 128
    images: int = 24000  # the first `images` of the training split


# sized for one core of a shared 2-core host (one step of 128 images: MobileNetV2 0.5 ~0.5 s, 1.0 ~1.4 s, ResNet-18
# ~2.5 s; MobileNetV2 1.0: 3 epochs of 12000 images, ~7 minutes)
RECIPES = {"mobilenetv2_050": Recipe("mobilenetv2_050", 4, 4e-3, images=12000),
           "mobilenetv2_100": Recipe("mobilenetv2_100", 3, 4e-3, images=12000),
           "resnet18": Recipe("resnet18", 3, 2e-3, images=6000)}


def build(name: str) -> torch.nn.Module:
    if name.startswith("mobilenetv2"):
        return MobileNetV2(len(CLASSES), int(name.rsplit("_", 1)[1]) / 100)
    if name == "resnet18":
        return ResNet18(len(CLASSES))
    raise ValueError(f"unknown model '{name}'; choose one of {sorted(RECIPES)}")


def accuracy(predict, x: np.ndarray, y: np.ndarray, batch: int = 256) -> float:
    correct = 0
    for i in range(0, len(x), batch):
        correct += int((predict(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum())
    return 100.0 * correct / len(x)


def train(name: str, seed: int = 0) -> tuple[Path, dict]:
    """The trained model's ONNX file (cached) and its training facts."""
    recipe = RECIPES[name]
    folder = cache_dir() / "cnns"
    folder.mkdir(parents=True, exist_ok=True)
    subset = "" if recipe.images == 24000 else f"_n{recipe.images}"
    stem = f"{name}_glyphs36_e{recipe.epochs}{subset}_s{seed}"
    onnx_path, info_path = folder / f"{stem}.onnx", folder / f"{stem}.json"
    if onnx_path.is_file() and info_path.is_file():
        import json

        return onnx_path, json.loads(info_path.read_text())
    torch.manual_seed(seed)
    model = build(name)
    x, y = dataset("train")
    x, y = x[:recipe.images], y[:recipe.images]
    xv, yv = dataset("val")
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.05)
    steps = recipe.epochs * math.ceil(len(x) / recipe.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, recipe.lr, total_steps=steps, pct_start=0.15)
    gen = np.random.default_rng(seed)
    t0 = time.perf_counter()
    for epoch in range(recipe.epochs):
        model.train()
        order = gen.permutation(len(x))
        for i in range(0, len(x), recipe.batch):
            idx = order[i:i + recipe.batch]
            loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x[idx])), torch.from_numpy(y[idx]),
                                                     label_smoothing=0.1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        model.eval()
        with torch.no_grad():
            acc = accuracy(lambda b: model(torch.from_numpy(b)).numpy(), xv, yv)
        print(f"{name} epoch {epoch + 1}/{recipe.epochs}: loss {loss.item():.3f}, val {acc:.2f}% "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    info = {"model": name, "val_accuracy": acc, "train_seconds": time.perf_counter() - t0, "epochs": recipe.epochs,
            "train_images": len(x), "threads": torch.get_num_threads(),
            "parameters": sum(p.numel() for p in model.parameters())}
    torch.onnx.export(model, (torch.zeros(1, 3, SIZE, SIZE),), str(onnx_path), input_names=["x"],
                      output_names=["logits"], dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}},
                      opset_version=17, dynamo=False)
    import json

    info_path.write_text(json.dumps(info, indent=1))
    return onnx_path, info


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["mobilenetv2_050", "resnet18"])
    args = parser.parse_args()
    import onnxruntime as ort

    xv, yv = dataset("val")
    for name in args.models:
        path, info = train(name)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        acc = accuracy(lambda b, s=session: s.run(None, {"x": b})[0], xv, yv)
        print(f"{name}: {info['parameters'] / 1e6:.2f}M parameters, val accuracy torch {info['val_accuracy']:.2f}% / "
              f"onnxruntime {acc:.2f}%, trained in {info['train_seconds'] / 60:.1f} min")


if __name__ == "__main__":
    main()
