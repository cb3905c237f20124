"""A small CNN on scikit-learn's 8x8 handwritten digits, trained in a few seconds on CPU."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn


def digits_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test); images (N, 1, 8, 8) in [0, 1], stratified 75/25 split."""
    data = load_digits()
    x = (data.images / 16.0).astype(np.float32)[:, None]
    x_tr, x_te, y_tr, y_te = train_test_split(x, data.target, test_size=0.25, random_state=seed,
                                              stratify=data.target)
    return (torch.from_numpy(x_tr), torch.from_numpy(y_tr).long(), torch.from_numpy(x_te),
            torch.from_numpy(y_te).long())


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AvgPool2d(2),
        )
        self.head = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, epochs: int, lr: float = 2e-3,
          batch_size: int = 32, seed: int = 0, optimizer: torch.optim.Optimizer | None = None) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    opt = optimizer or torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), batch_size):
            idx = order[i:i + batch_size]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
    model.eval()
    return model


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return float((model(x).argmax(1) == y).float().mean()) * 100.0


def trained_digits_cnn(seed: int = 0, epochs: int = 12) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    data = digits_data(seed)
    model = train(DigitsCNN(), data[0], data[1], epochs=epochs, seed=seed)
    return model, data
