"""``--dataset imagefolder``: ImageNet-style folders streamed from disk through DataLoader workers.

The recipe is the ImageNet one of He et al. (2016), "Identity Mappings in Deep Residual
Networks" [1], whose appendix trains "using the same data augmentation as in [2]"; [2] is He et
al. (2015), "Deep Residual Learning for Image Recognition", section 3.4: "The image is resized
with its shorter side randomly sampled in [256, 480] for scale augmentation. A 224x224 crop is
randomly sampled from an image or its horizontal flip, with the per-pixel mean subtracted. The
standard color augmentation in [Krizhevsky et al. 2012] is used. ... In testing, for comparison
studies we adopt the standard 10-crop testing."

What this module does of it:

- training: shorter side resized (bilinear, PIL) to a size drawn uniformly from the integers of
  ``scale_range`` (default [256, 480]), a ``crop`` x ``crop`` crop (224) at a uniformly drawn
  position, a horizontal flip with probability 1/2 (``flip``);
- normalisation: per channel, with the ImageNet training set's mean and standard deviation as
  fb.resnet.torch (the code [1]'s Table 5 cites) and torchvision use them, in place of [2]'s
  per-pixel mean;
- not done: [2]'s "standard color augmentation" (Krizhevsky et al.'s PCA lighting noise);
- evaluation: shorter side to ``eval_resize`` (256), the centre ``eval_crop`` crop (224); or,
  ``ten_crop``, the 4 corner and the centre crops and their mirror images (torchvision's
  ``TenCrop``, Krizhevsky et al.'s "10-crop testing"), the prediction being the mean of the ten
  softmax outputs, as Krizhevsky et al. average "the predictions made by the network's softmax
  layer on the ten patches". [1]'s Table 5 tests a single 320x320 crop of the image resized to
  320 (``eval_resize 320, eval_crop 320``), since [2]'s scale augmentation makes the 224 crop of
  256 "negatively biased".

Order and determinism, as the in-memory path (``data.Batches``): epoch ``e``'s order is a
permutation drawn from a generator seeded by (seed, e); iteration ``i`` of epoch ``e`` takes
positions ``[p * batch, (p + 1) * batch)`` of it (``p = i mod iterations per epoch``), process
``r`` of ``world`` the ``r``-th slice of ``batch / world``; an epoch drops the remainder. Each
sample's augmentation comes from a generator seeded by (seed, epoch, sample index), drawn in
whichever worker loads it: the batches do not depend on the number of workers, and a run
resumed at iteration ``i`` starts its sampler at ``p`` and sees what an uninterrupted one sees.
"""

from __future__ import annotations

import os
import random
import signal
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from .config import UsageError
from .seeds import derived_seed

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "FolderData", "StreamingBatches", "default_workers",
           "load_imagefolder"]

# The ImageNet training set's per-channel mean and standard deviation of [0, 1] RGB
# (fb.resnet.torch datasets/imagenet.lua; torchvision's ImageNet models).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def default_workers(local_world: int | None = None) -> int:
    """DataLoader workers per training process: the CPUs this process may run on, shared by
    the training processes of this machine (``LOCAL_WORLD_SIZE``, set by torchrun), less one
    for the process itself; at most 8, at least 0 (load in the training process)."""
    if local_world is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(0, min(cpus // max(local_world, 1) - 1, 8))


class _Paths:
    """File paths relative to a root, packed in two numpy arrays: a worker forked from the
    training process shares them without touching a Python object per file (a list of 1.28M
    strings would be copied page by page into every worker as reference counts change)."""

    def __init__(self, root: Path, relative: list[str]):
        self.root = str(root)
        encoded = [p.encode() for p in relative]
        self.offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=self.offsets[1:])
        self.bytes = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        rel = self.bytes[self.offsets[i]:self.offsets[i + 1]].tobytes().decode()
        return os.path.join(self.root, rel)


def _scan(folder: Path, class_to_idx: dict[str, int] | None) -> tuple[list[str], list[int],
                                                                     list[str]]:
    """(paths relative to ``folder``, labels, class names) of an ImageFolder tree: one folder
    per class, sorted names; image files found recursively, sorted."""
    classes = sorted(e.name for e in os.scandir(folder) if e.is_dir())
    if class_to_idx is None:
        class_to_idx = {c: i for i, c in enumerate(classes)}
    paths, labels = [], []
    for c in classes:
        if c not in class_to_idx:
            continue
        found = []
        for dirpath, _, files in os.walk(folder / c, followlinks=True):
            found += [os.path.relpath(os.path.join(dirpath, f), folder) for f in files
                      if f.lower().endswith(_EXTENSIONS)]
        found.sort()
        paths += found
        labels += [class_to_idx[c]] * len(found)
    return paths, labels, classes


@dataclass
class FolderData:
    """An imagefolder dataset as the loop sees it: file lists, not pixels. ``image_shape`` is
    the training crop's; ``mean``/``std`` (C,) float32 of [0, 1] RGB."""

    name: str
    root: Path
    classes: list[str]
    train_paths: _Paths
    train_labels: np.ndarray   # (N,) int64
    val_paths: _Paths
    val_labels: np.ndarray
    crop: int
    mean: Tensor
    std: Tensor

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def num_train(self) -> int:
        return len(self.train_labels)

    @property
    def num_test(self) -> int:
        return len(self.val_labels)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (3, self.crop, self.crop)

    def resident_tensors(self) -> tuple[Tensor, ...]:
        return (self.mean, self.std)

    def to(self, device: torch.device) -> FolderData:
        self.mean, self.std = self.mean.to(device), self.std.to(device)
        return self


def load_imagefolder(data_dir: str, crop: int) -> FolderData:
    """Scan ``data_dir``/train and ``data_dir``/val (torchvision's ImageFolder layout: one
    folder per class; the classes are train's, in sorted order). A missing or empty folder is
    a :class:`UsageError` naming --data-dir."""
    root = Path(data_dir)
    if not root.is_dir():
        raise UsageError(f"--data-dir: {str(root)!r} does not exist (--dataset imagefolder "
                         "needs a folder holding train/ and val/)")
    splits = {}
    class_to_idx = None
    for split in ("train", "val"):
        folder = root / split
        if not folder.is_dir():
            raise UsageError(f"--data-dir: {str(root)!r} has no {split}/ folder (--dataset "
                             f"imagefolder needs train/ and val/, one subfolder per class)")
        paths, labels, classes = _scan(folder, class_to_idx)
        if not classes:
            raise UsageError(f"--data-dir: {str(folder)!r} has no class folders")
        if class_to_idx is None:
            class_to_idx = {c: i for i, c in enumerate(classes)}
        else:
            unknown = sorted(set(classes) - set(class_to_idx))
            if unknown:
                raise UsageError(f"--data-dir: {str(folder)!r} has classes that train/ has not: "
                                 f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
        if not paths:
            raise UsageError(f"--data-dir: {str(folder)!r} holds no images "
                             f"({', '.join(_EXTENSIONS)})")
        splits[split] = (_Paths(folder, paths), np.asarray(labels, dtype=np.int64))
    return FolderData("imagefolder", root, list(class_to_idx), *splits["train"], *splits["val"],
                      crop, torch.tensor(IMAGENET_MEAN), torch.tensor(IMAGENET_STD))


# --------------------------------------------------------------------------- per-sample work

def _load_rgb(path: str):
    from PIL import Image

    with open(path, "rb") as f:
        img = Image.open(f)
        return img.convert("RGB")


def _to_uint8(img) -> Tensor:
    """(C, H, W) uint8 of a PIL image."""
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)


def _resize_shorter(img, size: int):
    """Shorter side to ``size``, aspect kept (torchvision's ``Resize(size)`` on PIL images:
    bilinear, antialiased)."""
    from torchvision.transforms import functional as TF

    return TF.resize(img, size)


def augment_image(img, rng: random.Random, scale_range: tuple[int, int], crop: int,
                  flip: bool):
    """[2]'s scale augmentation, crop and flip of one PIL image, drawn from ``rng`` in a fixed
    order (size, top, left, flip), whatever ``flip`` says."""
    from PIL import Image

    size = rng.randint(scale_range[0], scale_range[1])
    img = _resize_shorter(img, size)
    w, h = img.size
    top, left = rng.randint(0, h - crop), rng.randint(0, w - crop)
    mirror = rng.random() < 0.5
    img = img.crop((left, top, left + crop, top + crop))
    if flip and mirror:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    return img


def eval_crops(img, resize: int, crop: int, ten_crop: bool) -> Tensor:
    """(C, crop, crop) uint8, the centre crop of ``img`` with its shorter side at ``resize``;
    ``ten_crop``: (10, C, crop, crop), torchvision's TenCrop order (corners top-left,
    top-right, bottom-left, bottom-right, centre; then the same of the mirror image)."""
    from torchvision.transforms import functional as TF

    img = _resize_shorter(img, resize)
    if not ten_crop:
        return _to_uint8(TF.center_crop(img, [crop, crop]))
    return torch.stack([_to_uint8(c) for c in TF.ten_crop(img, [crop, crop])])


class _TrainImages(Dataset):
    """Item ``(index, epoch)``: the augmented crop (C, H, W) uint8 and its label."""

    def __init__(self, data: FolderData, seed: int, scale_range, flip: bool):
        self.paths, self.labels = data.train_paths, data.train_labels
        self.seed, self.scale_range, self.crop, self.flip = (seed, tuple(scale_range), data.crop,
                                                             flip)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, key: tuple[int, int]) -> tuple[Tensor, int]:
        index, epoch = key
        rng = random.Random(derived_seed(self.seed, f"augment:{epoch}", index))
        img = augment_image(_load_rgb(self.paths[index]), rng, self.scale_range, self.crop,
                            self.flip)
        return _to_uint8(img), int(self.labels[index])


class _EvalImages(Dataset):
    def __init__(self, data: FolderData, resize: int, crop: int, ten_crop: bool):
        self.paths, self.labels = data.val_paths, data.val_labels
        self.resize, self.crop, self.ten_crop = resize, crop, ten_crop

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        img = _load_rgb(self.paths[index])
        return eval_crops(img, self.resize, self.crop, self.ten_crop), int(self.labels[index])


class EpochSampler(Sampler):
    """This process's ``(index, epoch)`` items of one epoch, from iteration ``start`` of it on
    (set ``epoch`` and ``start`` before each ``iter``). ``batch`` is the global batch."""

    def __init__(self, n: int, batch: int, seed: int, rank: int, world: int):
        self.n, self.batch, self.seed, self.rank, self.world = n, batch, seed, rank, world
        self.local = batch // world
        self.iters_per_epoch = n // batch
        self.epoch, self.start = 0, 0

    def permutation(self, epoch: int) -> Tensor:
        g = torch.Generator().manual_seed(derived_seed(self.seed, "order", epoch))
        return torch.randperm(self.n, generator=g)

    def indices(self, epoch: int, position: int) -> list[int]:
        """This process's sample indices of the batch at ``position`` of ``epoch``."""
        perm = self.permutation(epoch)
        lo = position * self.batch + self.rank * self.local
        return perm[lo:lo + self.local].tolist()

    def __iter__(self):
        perm = self.permutation(self.epoch)
        epoch = self.epoch
        for pos in range(self.start, self.iters_per_epoch):
            lo = pos * self.batch + self.rank * self.local
            for i in perm[lo:lo + self.local].tolist():
                yield (i, epoch)

    def __len__(self) -> int:
        return (self.iters_per_epoch - self.start) * self.local


def _worker_init(worker_id: int) -> None:
    # SIGINT/SIGTERM are the training process's to handle (it checkpoints, then ends the
    # workers); a worker killed by one sent to the whole process group would fail the batch
    # being loaded before that checkpoint. A worker still ends with its parent (DataLoader
    # watches it).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class StreamingBatches:
    """The imagefolder counterpart of ``data.Batches``: the same interface (``train_batch``,
    ``eval_batches``, ``local``, ``iters_per_epoch``, ``memory_format``), batches read by a
    DataLoader. ``batch_size`` is the global batch."""

    def __init__(self, data: FolderData, batch_size: int, seed: int, flip: bool,
                 scale_range, eval_resize: int, eval_crop: int, ten_crop: bool,
                 device: torch.device, workers: int | None = None, rank: int = 0, world: int = 1,
                 channels_last: bool = False):
        if batch_size % world:
            raise UsageError(f"--batch-size: {batch_size} does not split over {world} "
                             "processes")
        if batch_size > data.num_train:
            raise UsageError(f"--batch-size: {batch_size} is larger than the {data.num_train} "
                             f"training images of {data.root}")
        self.data, self.batch_size, self.rank, self.world = data, batch_size, rank, world
        self.local = batch_size // world
        self.iters_per_epoch = data.num_train // batch_size
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.device = device
        self.workers = default_workers() if workers is None else workers
        self.eval_resize, self.eval_crop, self.ten_crop = eval_resize, eval_crop, ten_crop
        self.crops = 10 if ten_crop else 1
        # Activations of the evaluation forward relative to a training batch of as many images
        # (for the memory planner): crops per image times their area relative to the training
        # crop's.
        self.eval_scale = self.crops * (eval_crop / data.crop) ** 2
        self.sampler = EpochSampler(data.num_train, batch_size, seed, rank, world)
        self.train_set = _TrainImages(data, seed, scale_range, flip)
        self.eval_set = _EvalImages(data, eval_resize, eval_crop, ten_crop)
        self._pin = device.type == "cuda"
        self.loader: DataLoader | None = None  # made at the first batch
        self._iter, self._next = None, None
        c = data.mean.numel()
        self._mean = data.mean.view(c, 1, 1)
        self._std = data.std.view(c, 1, 1)

    def describe(self) -> str:
        """The banner's line."""
        return (f"imagefolder {self.data.root}: {self.data.num_classes} classes; "
                f"{self.workers} loader workers per process; eval "
                f"{'ten crops' if self.ten_crop else 'centre crop'} {self.eval_crop} of "
                f"{self.eval_resize}")

    def normalise(self, x: Tensor) -> Tensor:
        """uint8 (..., C, H, W) from a loader to normalised float32 on the device; the
        trailing (C, H, W) in the run's memory format."""
        x = x.to(self.device, non_blocking=self._pin)
        shape = x.shape
        x = x.reshape(-1, *shape[-3:]).float().div_(255.0)
        x = ((x - self._mean) / self._std).contiguous(memory_format=self.memory_format)
        return x.view(shape)

    def train_batch(self, iteration: int) -> tuple[Tensor, Tensor]:
        """(x, y) of this process for ``iteration``: x (local, C, crop, crop) float32."""
        if iteration != self._next:  # a new epoch, or a jump (resume): start the sampler there
            self.sampler.epoch, self.sampler.start = divmod(iteration, self.iters_per_epoch)
            if self.loader is None:
                # Persistent workers: forked once, reused by every epoch's iterator.
                self.loader = DataLoader(
                    self.train_set, batch_size=self.local, sampler=self.sampler,
                    num_workers=self.workers, pin_memory=self._pin,
                    persistent_workers=self.workers > 0,
                    worker_init_fn=_worker_init if self.workers else None)
            self._iter = iter(self.loader)
        x, y = next(self._iter)
        nxt = iteration + 1
        self._next = nxt if nxt % self.iters_per_epoch else None
        return self.normalise(x), y.to(self.device, non_blocking=self._pin)

    def eval_batches(self, batch_size: int):
        """This process's share of val/ (every world-th image), in order: x (B, C, H, W), or
        (B, 10, C, H, W) with ten crops, y (B,)."""
        mine = list(range(self.rank, self.data.num_test, self.world))
        loader = DataLoader(self.eval_set, batch_size=batch_size, sampler=mine,
                            num_workers=self.workers, pin_memory=self._pin,
                            worker_init_fn=_worker_init if self.workers else None)
        for x, y in loader:
            yield self.normalise(x), y.to(self.device, non_blocking=self._pin)

    def close(self) -> None:
        """End the loader's workers (dropping the last references to the loader and its
        iterator does: the iterator's finaliser shuts them down); a later batch starts anew."""
        self._iter = self._next = None
        self.loader = None
