"""``--dataset imagefolder``: a tree of generated JPEGs streamed through DataLoader workers.

Runs finish and write their metrics; a run stopped and resumed (mid-epoch, with a different
number of workers, and killed by SIGTERM sent to its whole process group) ends with exactly the
weights of an uninterrupted one; the augmentation is a function of (seed, epoch, image);
ten-crop evaluation equals the softmax averaged over ten crops cut by hand; a bad --data-dir is
exit 2 with nothing written. preact_resnet18 (ImageNet family) on 32-pixel crops, CPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from fusedres import models
from fusedres.apps.train import checkpoint as ckpt
from fusedres.apps.train import main
from fusedres.apps.train.config import UsageError, resolve
from fusedres.apps.train.imagefolder import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    EpochSampler,
    StreamingBatches,
    default_workers,
    load_imagefolder,
)
from fusedres.apps.train.loop import crop_average

CLASSES = ("ant", "bee", "cat")
N_TRAIN, N_VAL = 6, 3          # per class: 18 training images, 9 validation images
BATCH = 6                      # 3 iterations per epoch
CROP, SCALE, EVAL_RESIZE = 32, (36, 48), 36


def _write_tree(root: Path) -> Path:
    """3 classes of JPEGs of different sizes (40x48 and up, some portrait), each class its own
    mean colour."""
    rng = np.random.default_rng(0)
    for split, n in (("train", N_TRAIN), ("val", N_VAL)):
        for c, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(n):
                h, w = 40 + 3 * i, 48 - 2 * i if i % 2 else 48 + 5 * i
                base = np.zeros(3)
                base[c] = 120
                pixels = np.clip(base + rng.normal(60, 40, (h, w, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"img{i}.JPEG", quality=90)
    return root


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return _write_tree(tmp_path_factory.mktemp("tree"))


def _args(tree: Path, out: Path, *extra: str) -> list[str]:
    return ["--dataset", "imagefolder", "--data-dir", str(tree), "--model", "preact_resnet18",
            "--crop-size", str(CROP), "--scale-range", *map(str, SCALE), "--batch-size",
            str(BATCH), "--eval-batch-size", "4", "--threads", "1", "--warmup-iters", "2",
            "--milestones", "5", "--lr", "0.02", "--checkpoint-every", "2", "--log-every", "1",
            "--eval-every", "4", "--no-progress", "--seed", "5", "--out", str(out), *extra]


def _final(out: Path, iteration: int):
    state = ckpt.load(ckpt.latest(out))
    assert state["iteration"] == iteration
    return state


def _assert_same_weights(a, b):
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for pid, s in a["optimizer"]["state"].items():
        assert torch.equal(b["optimizer"]["state"][pid]["momentum_buffer"], s["momentum_buffer"])


def _records(out: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == kind]


N_ITERS = 8  # 2 2/3 epochs


@pytest.fixture(scope="module")
def uninterrupted(tree, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    assert main(_args(tree, out, "--max-iters", str(N_ITERS), "--workers", "0")) == 0
    return out


# --------------------------------------------------------------------------- runs

def test_run_writes_metrics_and_evaluations(uninterrupted):
    names = {p.name for p in uninterrupted.iterdir()}
    assert {"config.yaml", "metrics.jsonl", "summary.json", "checkpoints"} <= names
    summary = json.loads((uninterrupted / "summary.json").read_text())
    assert summary["dataset"] == "imagefolder" and summary["iterations"] == N_ITERS
    # Evaluations every 4 iterations and at each epoch end (3, 6) and at the end.
    assert [r["iteration"] for r in _records(uninterrupted, "eval")] == [3, 4, 6, 8]
    assert all(np.isfinite(r["test_loss"]) for r in _records(uninterrupted, "eval"))
    assert [r["iteration"] for r in _records(uninterrupted, "epoch")] == [3, 6, 8]
    saved = yaml.safe_load((uninterrupted / "config.yaml").read_text())
    assert (saved["crop_size"], saved["scale_range"], saved["eval_resize"], saved["eval_crop"],
            saved["ten_crop"]) == (CROP, list(SCALE), SCALE[0], CROP, False)


@pytest.mark.parametrize("first, then", [("2", "0"), ("0", "2")])
def test_stopped_mid_epoch_and_resumed_equals_uninterrupted(tree, tmp_path, uninterrupted,
                                                            first, then):
    """Stopped at iteration 4 (mid-epoch 2), resumed with another number of workers: the same
    weights, momentum and evaluations as the uninterrupted run with none."""
    out = tmp_path / "run"
    assert main(_args(tree, out, "--max-iters", "4", "--workers", first)) == 0
    assert main(["--out", str(out), "--resume", "--max-iters", str(N_ITERS),
                 "--workers", then]) == 0
    _assert_same_weights(_final(out, N_ITERS), _final(uninterrupted, N_ITERS))
    assert _records(out, "eval") == _records(uninterrupted, "eval")


def test_sigterm_to_the_process_group_with_workers_checkpoints_and_resumes(tree, tmp_path,
                                                                          uninterrupted):
    """SIGTERM to the run and its 2 loader workers (a batch scheduler's way): the run saves
    a checkpoint and exits 143, no worker is left behind, and the resumed run ends as the
    uninterrupted one."""
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "fusedres.apps.train",
           *_args(tree, out, "--max-iters", str(N_ITERS), "--workers", "2",
                  "--checkpoint-every", "1")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    deadline = time.monotonic() + 120
    while not ckpt.list_checkpoints(out):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM received: checkpoint saved" in err
    stopped = _final(out, ckpt.load(ckpt.latest(out))["iteration"])["iteration"]
    assert stopped < N_ITERS
    for _ in range(100):  # the workers end with the run
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("loader workers outlived the run")
    assert main(["--out", str(out), "--resume", "--workers", "0"]) == 0
    _assert_same_weights(_final(out, N_ITERS), _final(uninterrupted, N_ITERS))


def test_ten_crop_run_records_its_evaluation(tree, tmp_path):
    out = tmp_path / "run"
    assert main(_args(tree, out, "--max-iters", "3", "--workers", "0", "--ten-crop")) == 0
    (record,) = _records(out, "eval")
    assert record["iteration"] == 3 and np.isfinite(record["test_loss"])
    # The same evaluation by hand from the final weights: every validation image's ten crops.
    state = _final(out, 3)
    model = models.preact_resnet18(num_classes=3)
    model.load_state_dict(state["model"])
    model.eval()
    data = load_imagefolder(str(tree), CROP)
    nll, correct = 0.0, 0
    with torch.no_grad():
        for i in range(data.num_test):
            probs = _hand_ten_crop_probs(model, data.val_paths[i])
            nll -= probs[data.val_labels[i]].log().item()
            correct += int(probs.argmax() == data.val_labels[i])
    assert record["test_loss"] == pytest.approx(nll / data.num_test, rel=1e-4)
    assert record["test_error"] == pytest.approx(1 - correct / data.num_test)


# --------------------------------------------------------------------------- evaluation

def _resize_shorter(img: Image.Image, size: int) -> Image.Image:
    w, h = img.size
    if w <= h:
        return img.resize((size, int(size * h / w)), Image.BILINEAR)
    return img.resize((int(size * w / h), size), Image.BILINEAR)


def _hand_ten_crop_probs(model, path: str) -> torch.Tensor:
    """The mean softmax over the 4 corner and centre crops of the image and of its mirror
    image, each crop through the model alone."""
    img = _resize_shorter(Image.open(path).convert("RGB"), EVAL_RESIZE)
    x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    x = (x - mean) / std
    _, h, w = x.shape
    top, left = int(round((h - CROP) / 2)), int(round((w - CROP) / 2))
    corners = [(0, 0), (0, w - CROP), (h - CROP, 0), (h - CROP, w - CROP), (top, left)]
    crops = [im[:, t:t + CROP, s:s + CROP] for im in (x, x.flip(2)) for t, s in corners]
    probs = [model(c.unsqueeze(0)).softmax(1)[0] for c in crops]
    return torch.stack(probs).mean(0)


def test_ten_crop_average_equals_the_crops_by_hand(tree):
    torch.manual_seed(0)
    model = models.preact_resnet18(num_classes=3).eval()
    with torch.no_grad():  # confident, crop-dependent outputs: softmax and logit means differ
        model.fc.weight.mul_(30)
    data = load_imagefolder(str(tree), CROP)
    batches = StreamingBatches(data, BATCH, 0, True, SCALE, EVAL_RESIZE, CROP, True,
                               torch.device("cpu"), workers=0)
    x, y = next(iter(batches.eval_batches(4)))
    assert x.shape == (4, 10, 3, CROP, CROP) and y.tolist() == data.val_labels[:4].tolist()
    with torch.no_grad():
        got = crop_average(model, x)
        want = torch.stack([_hand_ten_crop_probs(model, data.val_paths[i]) for i in range(4)])
        logit_mean = model(x.flatten(0, 1)).view(4, 10, -1).mean(1).log_softmax(1)
    torch.testing.assert_close(got, want.log(), rtol=1e-4, atol=1e-5)
    assert (got - logit_mean).abs().max() > 1e-2  # the softmax is averaged, not the logits
    # Without --ten-crop: the centre crop alone, the fifth of the ten.
    centre = StreamingBatches(data, BATCH, 0, True, SCALE, EVAL_RESIZE, CROP, False,
                              torch.device("cpu"), workers=0)
    xc, _ = next(iter(centre.eval_batches(4)))
    assert torch.equal(xc, x[:, 4])


# --------------------------------------------------------------------------- augmentation

def _batches(tree, seed=0, workers=0, **kw):
    data = load_imagefolder(str(tree), CROP)
    return StreamingBatches(data, BATCH, seed, True, SCALE, EVAL_RESIZE, CROP, False,
                            torch.device("cpu"), workers=workers, **kw)


def test_augmentation_is_a_function_of_seed_epoch_and_image(tree):
    one, again = _batches(tree, seed=3), _batches(tree, seed=3, workers=2)
    assert one.iters_per_epoch == 3
    for it in (4, 0, 1, 5):  # any order, any number of workers: no hidden state
        xa, ya = one.train_batch(it)
        xb, yb = again.train_batch(it)
        assert xa.shape == (BATCH, 3, CROP, CROP)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    again.close()
    # Another seed: other crops.
    assert not torch.equal(_batches(tree, seed=4).train_batch(0)[0], one.train_batch(0)[0])
    # The same image in two epochs: other crops.
    ds = one.train_set
    for index in range(4):
        a, label = ds[(index, 0)]
        assert torch.equal(a, ds[(index, 0)][0])
        assert not torch.equal(a, ds[(index, 1)][0])
        assert label == ds[(index, 1)][1]


def test_epochs_visit_distinct_images_and_processes_split_the_global_batch():
    n, batch = 20, 6
    full = EpochSampler(n, batch, seed=1, rank=0, world=1)
    halves = [EpochSampler(n, batch, seed=1, rank=r, world=2) for r in (0, 1)]
    for epoch in (0, 1):
        for s in (full, *halves):
            s.epoch, s.start = epoch, 0
        items = list(full)
        assert len(items) == 3 * batch and len({i for i, _ in items}) == 3 * batch
        assert {e for _, e in items} == {epoch}
        parts = [list(h) for h in halves]
        for pos in range(3):
            glob = items[pos * batch:(pos + 1) * batch]
            assert parts[0][pos * 3:(pos + 1) * 3] + parts[1][pos * 3:(pos + 1) * 3] == glob
    # A resumed sampler starts at its iteration of the epoch.
    full.epoch, full.start = 1, 2
    assert list(full) == items[2 * batch:]
    assert len(full) == batch
    # Each epoch its own order.
    full.start = 0
    orders = []
    for epoch in (0, 1):
        full.epoch = epoch
        orders.append([i for i, _ in full])
    assert orders[0] != orders[1]


def test_default_workers_share_the_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert default_workers(local_world=1) == 8
    assert default_workers(local_world=4) == 3
    assert default_workers(local_world=8) == 1
    assert default_workers(local_world=16) == 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_workers() == 7


# --------------------------------------------------------------------------- configuration

def test_imagefolder_defaults_are_the_papers_and_only_for_imagefolder():
    cfg, _ = resolve(["--dataset", "imagefolder"])
    assert (cfg["crop_size"], cfg["scale_range"], cfg["eval_resize"], cfg["eval_crop"],
            cfg["ten_crop"], cfg["workers"]) == (224, [256, 480], 256, 224, False, None)
    cfg, _ = resolve(["--config", "imagenet_resnet200"])
    assert (cfg["model"], cfg["dataset"], cfg["batch_size"], cfg["lr"], cfg["momentum"],
            cfg["weight_decay"], cfg["warmup_iters"], cfg["epochs"]) == (
        "preact_resnet200", "imagefolder", 256, 0.1, 0.9, 1e-4, 0, 90)
    assert cfg["lr_decay"] == 0.1
    # /10 at epochs 30 and 60 of 90: fractions of the run.
    from fusedres.apps.train.build import milestones
    ipe = 1281167 // 256  # ImageNet-1k's training set
    assert milestones(cfg, 90 * ipe) == [30 * ipe, 60 * ipe]
    with pytest.raises(UsageError, match="--crop-size: only with --dataset imagefolder"):
        resolve(["--dataset", "digits", "--crop-size", "32"])
    with pytest.raises(UsageError, match="--scale-range: expected --crop-size"):
        resolve(["--dataset", "imagefolder", "--scale-range", "200", "480"])
    with pytest.raises(UsageError, match="--eval-crop: 300 is larger than --eval-resize 256"):
        resolve(["--dataset", "imagefolder", "--eval-crop", "300"])


def _bad_tree(tmp_path: Path, kind: str) -> Path:
    root = tmp_path / "data"
    if kind == "missing":
        return root
    (root / "train" / "ant").mkdir(parents=True)
    Image.new("RGB", (40, 48)).save(root / "train" / "ant" / "a.jpg")
    if kind == "no-val":
        return root
    (root / "val").mkdir()
    if kind == "val-without-classes":
        return root
    (root / "val" / "ant").mkdir()
    if kind == "val-without-images":
        (root / "val" / "ant" / "notes.txt").write_text("no images here")
        return root
    (root / "val" / "bee").mkdir()
    Image.new("RGB", (40, 48)).save(root / "val" / "bee" / "b.jpg")
    return root  # "unknown-class": val/bee, which train/ lacks


@pytest.mark.parametrize("kind, match", [
    ("missing", "does not exist"),
    ("no-val", "has no val/ folder"),
    ("val-without-classes", "has no class folders"),
    ("val-without-images", "holds no images"),
    ("unknown-class", "has classes that train/ has not: bee"),
])
def test_bad_data_dir_is_exit_2_naming_it_and_nothing_is_written(tmp_path, capsys, kind, match):
    root = _bad_tree(tmp_path, kind)
    out = tmp_path / "run"
    assert main(_args(root, out, "--max-iters", "1")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("fusedres train: error: --data-dir: ") and match in err, err
    assert not out.exists()
