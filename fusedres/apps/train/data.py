"""Datasets held whole in memory (on the training device), deterministic batches, augmentation;
:func:`open_data`, the loop's one entry, also opens the streamed ``imagefolder`` path
(fusedres.apps.train.imagefolder) for datasets too large to hold.

The batch of iteration ``i`` is a pure function of (seed, i): the epoch's permutation comes from
a generator seeded by (seed, epoch) and the augmentation (translation by padding + random crop,
horizontal flip) from one seeded by (seed, i), drawn for the whole global batch; each process
takes its slice. So a resumed run sees exactly the batches an uninterrupted one would, with any
number of processes, and the augmentation itself runs batched on the device (the GPU when
training on one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import UsageError
from .seeds import derived_seed

__all__ = ["Data", "derived_seed", "load", "open_data"]


@dataclass
class Data:
    name: str
    train_x: Tensor        # (N, C, H, W) uint8 (CIFAR) or float32 in [0, 1] (digits)
    train_y: Tensor        # (N,) int64
    test_x: Tensor
    test_y: Tensor
    mean: Tensor           # (C,) float32 of the [0, 1]-scaled training images
    std: Tensor
    num_classes: int

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.train_x.shape[1:])

    @property
    def num_train(self) -> int:
        return len(self.train_y)

    @property
    def num_test(self) -> int:
        return len(self.test_y)

    def resident_tensors(self) -> tuple[Tensor, ...]:
        """What the dataset keeps on the device (the memory plan counts it)."""
        return (self.train_x, self.train_y, self.test_x, self.test_y, self.mean, self.std)

    def to(self, device: torch.device) -> Data:
        for f in ("train_x", "train_y", "test_x", "test_y", "mean", "std"):
            setattr(self, f, getattr(self, f).to(device))
        return self


def _scaled(x: Tensor) -> Tensor:
    return x.float().div_(255.0) if x.dtype == torch.uint8 else x.float()


def _channel_stats(x: Tensor) -> tuple[Tensor, Tensor]:
    xs = _scaled(x).transpose(0, 1).reshape(x.shape[1], -1)
    return xs.mean(1), xs.std(1)


def _load_digits() -> Data:
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:
        raise UsageError(f"--dataset digits: needs scikit-learn ({e})") from None
    bunch = load_digits()
    images = torch.as_tensor(bunch.images, dtype=torch.float32).div_(16.0).unsqueeze(1)
    labels = torch.as_tensor(bunch.target, dtype=torch.int64)
    # A fixed split, 20% held out, stratified: every 5th image of each class after a
    # deterministic shuffle.
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    test_mask = torch.zeros(len(labels), dtype=torch.bool)
    for c in range(10):
        members = order[labels[order] == c]
        test_mask[members[::5]] = True
    train_x, train_y = images[~test_mask], labels[~test_mask]
    mean, std = _channel_stats(train_x)
    return Data("digits", train_x, train_y, images[test_mask], labels[test_mask], mean, std, 10)


def _load_cifar(name: str, data_dir: str, download: bool, explicit_dir: bool) -> Data:
    import torchvision

    cls = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
    root = Path(data_dir)
    if explicit_dir and not root.is_dir():
        raise UsageError(f"--data-dir: {str(root)!r} does not exist")
    sets = []
    for train in (True, False):
        try:
            sets.append(cls(str(root), train=train, download=False))
            continue
        except RuntimeError:
            if not download:
                raise UsageError(
                    f"--dataset {name}: not found in {str(root)!r} (the standard "
                    f"{cls.base_folder} folder) and --no-download is set") from None
        try:
            sets.append(cls(str(root), train=train, download=True))
        except Exception as e:  # no network, disk full, ...
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UsageError(
                f"--dataset {name}: not in {str(root)!r} and the download failed ({reason}); "
                "put the standard files there with --data-dir, or use --dataset digits"
            ) from None
    (tr, te) = sets

    def tensors(ds):
        x = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
        return x, torch.as_tensor(ds.targets, dtype=torch.int64)

    train_x, train_y = tensors(tr)
    test_x, test_y = tensors(te)
    mean, std = _channel_stats(train_x)
    return Data(name, train_x, train_y, test_x, test_y, mean, std,
                10 if name == "cifar10" else 100)


def _load_synthetic() -> Data:
    """Random CIFAR-shaped images and labels (fixed seed): measures speed and memory of the
    training loop without data; nothing to learn."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2560, 3, 32, 32), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 10, (2560,), generator=g)
    mean, std = _channel_stats(x[:2048])
    return Data("synthetic", x[:2048], y[:2048], x[2048:], y[2048:], mean, std, 10)


def load(name: str, data_dir: str, download: bool, explicit_dir: bool) -> Data:
    if name == "digits":
        return _load_digits()
    if name == "synthetic":
        return _load_synthetic()
    return _load_cifar(name, data_dir, download, explicit_dir)


def open_data(cfg: dict, explicit_dir: bool, device: torch.device, rank: int = 0,
              world: int = 1):
    """(data, batches) of a run: ``data`` describes the dataset (``name``, ``num_classes``,
    ``image_shape``, ``num_train``, ``num_test``, ``resident_tensors()``), ``batches`` serves
    it (``train_batch(i)``, ``eval_batches(n)``, ``local``, ``iters_per_epoch``,
    ``eval_scale``, ``describe()``, ``close()``). In memory on ``device`` (:class:`Batches`),
    or streamed from disk for ``imagefolder``
    (:class:`fusedres.apps.train.imagefolder.StreamingBatches`)."""
    if cfg["dataset"] == "imagefolder":
        from . import imagefolder

        data = imagefolder.load_imagefolder(cfg["data_dir"], cfg["crop_size"]).to(device)
        batches = imagefolder.StreamingBatches(
            data, cfg["batch_size"], cfg["seed"], cfg["flip"], cfg["scale_range"],
            cfg["eval_resize"], cfg["eval_crop"], cfg["ten_crop"], device, cfg["workers"],
            rank, world, cfg["channels_last"])
        return data, batches
    data = load(cfg["dataset"], cfg["data_dir"], cfg["download"], explicit_dir).to(device)
    return data, Batches(data, cfg["batch_size"], cfg["seed"], cfg["pad"], cfg["flip"], rank,
                         world, cfg["channels_last"])


class Batches:
    """Training and evaluation batches for one process of ``world``.

    ``batch_size`` is the global batch; each process gets ``batch_size // world`` samples.
    An epoch is ``len(train) // batch_size`` iterations (the remainder, a different random
    subset each epoch, is skipped so that every batch has the same shape).
    """

    eval_scale = 1.0  # the evaluation forward's images per evaluated image (one, whole)

    def __init__(self, data: Data, batch_size: int, seed: int, pad: int, flip: bool,
                 rank: int = 0, world: int = 1, channels_last: bool = False):
        if batch_size % world:
            raise UsageError(f"--batch-size: {batch_size} does not split over {world} "
                             "processes")
        n = len(data.train_y)
        if batch_size > n:
            raise UsageError(f"--batch-size: {batch_size} is larger than the {n} training "
                             f"images of {data.name}")
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.pad, self.flip, self.rank, self.world = pad, flip, rank, world
        self.local = batch_size // world
        self.iters_per_epoch = n // batch_size
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self._perm_epoch, self._perm = -1, None
        c = data.mean.numel()
        self._mean = data.mean.view(1, c, 1, 1)
        self._std = data.std.view(1, c, 1, 1)

    def _permutation(self, epoch: int) -> Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(derived_seed(self.seed, "order", epoch))
            self._perm = torch.randperm(len(self.data.train_y), generator=g)
            self._perm_epoch = epoch
        return self._perm

    def normalise(self, x: Tensor) -> Tensor:
        return ((_scaled(x) - self._mean) / self._std).contiguous(
            memory_format=self.memory_format)

    def train_batch(self, iteration: int) -> tuple[Tensor, Tensor]:
        """(x, y) of this process for ``iteration``: x (local, C, H, W) float32 normalised."""
        epoch, pos = divmod(iteration, self.iters_per_epoch)
        idx = self._permutation(epoch)[pos * self.batch_size:(pos + 1) * self.batch_size]
        g = torch.Generator().manual_seed(derived_seed(self.seed, "augment", iteration))
        offsets = torch.randint(0, 2 * self.pad + 1, (self.batch_size, 2), generator=g)
        flips = torch.rand(self.batch_size, generator=g) < 0.5
        sl = slice(self.rank * self.local, (self.rank + 1) * self.local)
        device = self.data.train_x.device
        idx, offsets, flips = idx[sl].to(device), offsets[sl].to(device), flips[sl].to(device)
        x = self.normalise(self.data.train_x[idx])
        x = augment(x, offsets, flips if self.flip else None, self.pad)
        return x.contiguous(memory_format=self.memory_format), self.data.train_y[idx]

    def eval_batches(self, batch_size: int):
        """This process's share of the test set (every world-th image), in order."""
        n = len(self.data.test_y)
        mine = torch.arange(self.rank, n, self.world, device=self.data.test_x.device)
        for start in range(0, len(mine), batch_size):
            idx = mine[start:start + batch_size]
            yield self.normalise(self.data.test_x[idx]), self.data.test_y[idx]

    def describe(self) -> str | None:
        """A line for the run's banner beyond the data line (none here)."""
        return None

    def close(self) -> None:
        """Nothing to release (the streamed path ends its workers)."""


def augment(x: Tensor, offsets: Tensor, flips: Tensor | None, pad: int) -> Tensor:
    """Batched translation and flip. x (B, C, H, W); offsets (B, 2) in [0, 2*pad] (the crop's
    top-left corner in the zero-padded image); flips (B,) bool or None."""
    if pad:
        b, c, h, w = x.shape
        xp = F.pad(x, (pad, pad, pad, pad))
        rows = offsets[:, 0:1] + torch.arange(h, device=x.device)          # (B, H)
        cols = offsets[:, 1:2] + torch.arange(w, device=x.device)          # (B, W)
        n_idx = torch.arange(b, device=x.device).view(b, 1, 1, 1)
        c_idx = torch.arange(c, device=x.device).view(1, c, 1, 1)
        x = xp[n_idx, c_idx, rows.view(b, 1, h, 1), cols.view(b, 1, 1, w)]
    if flips is not None:
        x = torch.where(flips.view(-1, 1, 1, 1), x.flip(3), x)
    return x
