"""Convolutional zoo models: CIFAR-style ResNet, DenseNet-BC and U-Net.

All three train on synthetic seeded images with cross-entropy (per image for
the classifiers, per pixel for the U-Net) and use BatchNorm and in-place ReLU,
so their steps exercise the runtime's in-place and side-effect handling.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from dtr.zoo.registry import ZooModel, register_model
from dtr.zoo.registry import param_count as _params
from dtr.zoo.registry import seeded as _seeded

__all__ = ["ResNet", "BasicBlock", "DenseNetBC", "UNet", "resnet32", "densenet_bc", "unet",
           "image_batch", "classification_loss"]


def image_batch(channels: int, image_size: int, num_classes: int, dense: bool = False):
    """A ``batch(batch_size, seed)`` function of random images and labels.

    Args:
        channels: image channels.
        image_size: height and width.
        num_classes: labels are drawn from ``range(num_classes)``.
        dense: one label per pixel (segmentation) instead of per image.

    Returns:
        ``batch(batch_size, seed) -> (images, labels)``, images of shape
        ``(batch_size, channels, image_size, image_size)``.
    """

    def batch(batch_size: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(batch_size, channels, image_size, image_size, generator=g)
        shape = (batch_size, image_size, image_size) if dense else (batch_size,)
        y = torch.randint(0, num_classes, shape, generator=g)
        return x, y

    return batch


def classification_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``model(inputs)`` against class indices (per image or per pixel)."""
    return F.cross_entropy(model(inputs), targets)


# --- ResNet (He et al. 2016, the CIFAR variant: 6n+2 layers) ---------------------------------------


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a residual connection (a 1x1 conv-BN projection when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.shortcut(x)
        return self.relu(out)


class ResNet(nn.Module):
    """CIFAR ResNet: a 3x3 stem, three stages of ``n`` basic blocks (widths w, 2w, 4w), pooling, a linear head.

    Args:
        depth: 6n + 2 (32 for ResNet-32).
        width: channels of the first stage.
        num_classes: outputs of the head.

    Raises:
        ValueError: ``depth`` is not of the form 6n + 2 with n >= 1.
    """

    def __init__(self, depth: int = 32, width: int = 16, num_classes: int = 10):
        super().__init__()
        if depth < 8 or (depth - 2) % 6:
            raise ValueError(f"ResNet depth must be 6n + 2 with n >= 1 (got {depth})")
        n = (depth - 2) // 6
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True))
        blocks: List[nn.Module] = []
        c_in = width
        for stage, c_out in enumerate((width, 2 * width, 4 * width)):
            for i in range(n):
                blocks.append(BasicBlock(c_in, c_out, 2 if stage > 0 and i == 0 else 1))
                c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


@register_model("resnet32")
def resnet32(depth: int = 32, width: int = 16, image_size: int = 32, num_classes: int = 10,
             seed: int = 0) -> ZooModel:
    """ResNet-32 for CIFAR-10-sized images (3 stages x 5 basic blocks).

    Args:
        depth: 6n + 2 layers (32: n = 5).
        width: channels of the first stage (16 in the paper).
        image_size: input height and width.
        num_classes: classes of the head and the labels.
        seed: seed of the initial weights.

    Returns:
        The :class:`ZooModel`.
    """
    module = _seeded(seed, lambda: ResNet(depth, width, num_classes))
    shapes = dict(depth=depth, width=width, image_size=image_size, channels=3, num_classes=num_classes,
                  params=_params(module))
    return ZooModel("resnet32", module, image_batch(3, image_size, num_classes), classification_loss, shapes)


# --- DenseNet-BC (Huang et al. 2017: bottleneck layers and compression) ----------------------------


class _DenseLayer(nn.Module):
    def __init__(self, c_in: int, growth: int):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(c_in)
        self.conv1 = nn.Conv2d(c_in, 4 * growth, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(4 * growth)
        self.conv2 = nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False)

    def forward(self, features: List[torch.Tensor]) -> torch.Tensor:
        x = torch.cat(features, 1)
        x = self.conv1(F.relu(self.bn1(x), inplace=True))
        return self.conv2(F.relu(self.bn2(x), inplace=True))


class _Transition(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.bn = nn.BatchNorm2d(c_in)
        self.conv = nn.Conv2d(c_in, c_out, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool2d(self.conv(F.relu(self.bn(x), inplace=True)), 2)


class DenseNetBC(nn.Module):
    """DenseNet-BC for CIFAR: three dense blocks of (depth - 4) / 6 bottleneck layers, compression 0.5.

    Every layer reads the concatenation of all earlier feature maps of its
    block (a fresh ``torch.cat`` per layer, as in the reference
    implementation), so memory grows quadratically with the block length.

    Args:
        depth: total depth, 6m + 4 (40, 100, ...).
        growth: channels each layer adds (k).
        num_classes: outputs of the head.

    Raises:
        ValueError: ``depth`` is not 6m + 4 with m >= 1.
    """

    def __init__(self, depth: int = 100, growth: int = 12, num_classes: int = 10):
        super().__init__()
        if depth < 10 or (depth - 4) % 6:
            raise ValueError(f"DenseNet-BC depth must be 6m + 4 with m >= 1 (got {depth})")
        m = (depth - 4) // 6
        c = 2 * growth
        self.stem = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.blocks = nn.ModuleList()
        self.transitions = nn.ModuleList()
        for b in range(3):
            layers = nn.ModuleList()  # (a module list of module lists: typed as such in forward)
            for i in range(m):
                layers.append(_DenseLayer(c + i * growth, growth))
            self.blocks.append(layers)
            c += m * growth
            if b < 2:
                self.transitions.append(_Transition(c, c // 2))
                c //= 2
        self.bn = nn.BatchNorm2d(c)
        self.head = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b, block in enumerate(self.blocks):
            layers: nn.ModuleList = block  # type: ignore[assignment]  # (each block is a ModuleList)
            features = [x]
            for layer in layers:
                features.append(layer(features))
            x = torch.cat(features, 1)
            if b < len(self.transitions):
                x = self.transitions[b](x)
        x = F.relu(self.bn(x), inplace=True)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


@register_model("densenet-bc")
def densenet_bc(depth: int = 100, growth: int = 12, image_size: int = 32, num_classes: int = 10,
                seed: int = 0) -> ZooModel:
    """DenseNet-BC (k = 12) for CIFAR-10-sized images.

    Args:
        depth: 6m + 4 layers (100: 16 bottleneck layers per block).
        growth: the growth rate k.
        image_size: input height and width.
        num_classes: classes of the head and the labels.
        seed: seed of the initial weights.

    Returns:
        The :class:`ZooModel`.
    """
    module = _seeded(seed, lambda: DenseNetBC(depth, growth, num_classes))
    shapes = dict(depth=depth, growth=growth, compression=0.5, image_size=image_size, channels=3,
                  num_classes=num_classes, params=_params(module))
    return ZooModel("densenet-bc", module, image_batch(3, image_size, num_classes), classification_loss, shapes)


# --- U-Net (Ronneberger et al. 2015, with BatchNorm and padded convolutions) -----------------------


def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
                         nn.Conv2d(c_out, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
                         nn.ReLU(inplace=True))


class UNet(nn.Module):
    """A U-Net: ``levels`` max-pool downsamplings, transposed-conv upsamplings, skip concatenations.

    Args:
        channels: input channels.
        num_classes: output channels (per-pixel classes).
        width: channels of the first level; each level doubles them.
        levels: number of downsamplings (the image size must divide by 2**levels).
    """

    def __init__(self, channels: int = 3, num_classes: int = 4, width: int = 8, levels: int = 4):
        super().__init__()
        widths = [width * 2 ** i for i in range(levels + 1)]
        self.inc = _double_conv(channels, widths[0])
        self.down = nn.ModuleList(_double_conv(widths[i], widths[i + 1]) for i in range(levels))
        self.up = nn.ModuleList(nn.ConvTranspose2d(widths[i + 1], widths[i], 2, stride=2)
                                for i in reversed(range(levels)))
        self.up_conv = nn.ModuleList(_double_conv(2 * widths[i], widths[i]) for i in reversed(range(levels)))
        self.out = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inc(x)
        skips = []
        for down in self.down:
            skips.append(x)
            x = down(F.max_pool2d(x, 2))
        for up, conv, skip in zip(self.up, self.up_conv, reversed(skips)):
            x = conv(torch.cat([skip, up(x)], 1))
        return self.out(x)


@register_model("unet")
def unet(width: int = 8, levels: int = 4, image_size: int = 64, num_classes: int = 4, seed: int = 0) -> ZooModel:
    """A small U-Net for per-pixel classification of random images.

    Args:
        width: channels of the first level (8: levels of 8, 16, 32, 64, 128).
        levels: number of downsamplings.
        image_size: input height and width, a multiple of ``2 ** levels``.
        num_classes: classes per pixel.
        seed: seed of the initial weights.

    Returns:
        The :class:`ZooModel`.

    Raises:
        ValueError: ``image_size`` does not divide by ``2 ** levels``.
    """
    if image_size % 2 ** levels:
        raise ValueError(f"image_size must be a multiple of 2**levels = {2 ** levels} (got {image_size})")
    module = _seeded(seed, lambda: UNet(3, num_classes, width, levels))
    shapes = dict(width=width, levels=levels, image_size=image_size, channels=3, num_classes=num_classes,
                  params=_params(module))
    return ZooModel("unet", module, image_batch(3, image_size, num_classes, dense=True), classification_loss, shapes)
