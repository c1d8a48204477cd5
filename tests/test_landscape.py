"""fusedres landscape (Li et al. 2018) on a tiny run trained here (conftest's ``tiny_run``):
the centre is the model's evaluated loss, directions are filter-normalised filter by filter,
a seed gives one surface, an interrupted surface resumes to the uninterrupted one, the
interpolation's end points are the checkpoints' losses, processes split the rows, bad input
exits 2 before anything is written."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fusedres.apps import cli
from fusedres.apps.experiments import figures, hessian, landscape, runs
from fusedres.apps.train import checkpoint as ckpt

BATCH = ["--batches", "1", "--batch-size", "48"]  # 48 training images: a few ms a point
FAST = ["--threads", "1", "--no-progress", *BATCH]


def _surface(out: Path, name: str = "landscape_2d") -> landscape.SurfaceFile:
    return landscape.SurfaceFile.load(out / f"{name}.npz")


def _run(tiny_run, out, *argv) -> int:
    return landscape.main([str(tiny_run), "--out", str(out), *FAST, *argv])


@pytest.fixture(scope="module")
def surface_2d(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("landscape")
    assert _run(tiny_run, out, "--grid", "5", "--seed", "3") == 0
    return out


def test_centre_is_the_models_evaluated_loss(surface_2d, tiny_run):
    s = _surface(surface_2d)
    assert s.done.all() and s.loss.shape == (5, 5) and not np.isnan(s.loss).any()
    assert s.coords[0][2] == 0.0 and s.coords[1][2] == 0.0
    run = runs.open_run(tiny_run)
    with run.use_backend():
        ev = runs.evaluate(run.model, run.train_batches(48, 1))
    assert s.loss[2, 2] == pytest.approx(ev.loss, rel=1e-6, abs=0)
    assert s.accuracy[2, 2] == pytest.approx(1 - ev.error, abs=1e-12)
    doc = json.loads((surface_2d / "landscape_2d.json").read_text())
    assert doc["at"]["trained"]["loss"] == pytest.approx(ev.loss, rel=1e-6, abs=0)
    assert doc["training_images"] == 48 and doc["settings"]["seed"] == 3
    # Away from the trained weights the loss moves.
    assert np.ptp(s.loss) > 1e-3


def test_plots_and_files_are_written(surface_2d):
    names = {p.name for p in surface_2d.iterdir()}
    assert names == {"landscape_2d.npz", "landscape_2d.json", "landscape_2d_contour.png",
                     "landscape_2d_surface.png"}
    for png in ("landscape_2d_contour.png", "landscape_2d_surface.png"):
        assert (surface_2d / png).read_bytes()[:4] == b"\x89PNG"
    # Every axis labelled, every colour mapping with a labelled colour bar, the marker named.
    built = landscape.figures_of(_surface(surface_2d), "a run")
    assert set(built) == {"_contour", "_surface"}
    for fig in built.values():
        assert figures.unlabelled(fig) == [] and figures.overlaps(fig) == []
        assert fig.get_figwidth() == figures.COLUMN_WIDTH
    contour = built["_contour"]
    assert contour.axes[1].get_xlabel() == "α (filter-normalised direction 1)"
    legend = [t.get_text() for t in contour.legends[0].get_texts()]
    assert legend == ["trained weights (α = β = 0)"]
    # The loss colour bar: contour levels as ticks (no 0 on a log scale), clipped at 10 x the
    # minimum or 10 nats and saying so when the grid goes higher.
    bar = next(a for a in contour.axes if a.get_label() == "<colorbar>")
    ticks = [t.get_text() for t in bar.get_yticklabels()]
    assert ticks and "0" not in ticks and all(float(t) > 0 for t in ticks)
    s = _surface(surface_2d)
    top = float(ticks[-1])
    assert top == pytest.approx(min(s.loss.max(), max(10.0, 10 * s.loss.min())), rel=1e-2)
    if s.loss.max() > top * 1.01:
        assert "clipped at" in bar.get_ylabel()
    for fig in built.values():
        figures.pyplot().close(fig)


def test_directions_are_filter_normalised_filter_by_filter(tiny_run):
    model = runs.open_run(tiny_run).model
    d1, d2 = landscape.directions(model, seed=7, count=2)
    params = dict(model.named_parameters())
    assert set(d1) == set(params)
    n_filters = 0
    for name, w in params.items():
        w = w.detach().float().cpu()
        for d in (d1[name], d2[name]):
            assert d.shape == w.shape
            if w.dim() <= 1:  # biases and BatchNorm's weight and bias: not perturbed
                assert not d.any(), name
                continue
            torch.testing.assert_close(d.flatten(1).norm(dim=1), w.flatten(1).norm(dim=1),
                                       rtol=1e-5, atol=1e-7, msg=name)
            n_filters += w.shape[0]
    assert n_filters > 100
    conv = next(n for n, p in params.items() if p.dim() == 4)
    assert not torch.allclose(d1[conv], d2[conv])
    # The same seed: the same directions; another seed: others.
    again = landscape.directions(model, seed=7, count=1)[0]
    assert all(torch.equal(again[n], d1[n]) for n in d1)
    assert not torch.equal(landscape.directions(model, seed=8, count=1)[0][conv], d1[conv])
    # --no-ignore-biasbn moves 1-D parameters along themselves; the rest is unchanged.
    whole = landscape.directions(model, seed=7, count=1, ignore_biasbn=False)[0]
    for name, w in params.items():
        expected = w.detach().float().cpu() if w.dim() <= 1 else d1[name]
        assert torch.equal(whole[name], expected), name


def test_same_seed_same_surface_and_1d_follows_the_x_direction(surface_2d, tiny_run, tmp_path):
    assert _run(tiny_run, tmp_path / "again", "--grid", "5", "--seed", "3") == 0
    a, b = _surface(surface_2d), _surface(tmp_path / "again")
    assert np.array_equal(a.loss, b.loss) and np.array_equal(a.accuracy, b.accuracy)
    assert _run(tiny_run, tmp_path / "other", "--grid", "5", "--seed", "4") == 0
    assert not np.array_equal(_surface(tmp_path / "other").loss, a.loss)
    # The 1-D curve of a seed is the 2-D surface's row at y = 0.
    assert _run(tiny_run, tmp_path / "one", "--grid", "5", "--seed", "3", "--dims", "1") == 0
    one = _surface(tmp_path / "one", "landscape_1d")
    assert one.loss.shape == (5,) and np.array_equal(one.loss, a.loss[2])
    assert (tmp_path / "one" / "landscape_1d.png").exists()


def test_an_interrupted_surface_resumes_to_the_uninterrupted_one(surface_2d, tiny_run, tmp_path,
                                                                 monkeypatch):
    out = tmp_path / "cut"
    save = landscape.SurfaceFile.save
    saves = []

    def save_then_stop(self, path):  # killed right after the second row reached the disk
        save(self, path)
        saves.append(path)
        if len(saves) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(landscape.SurfaceFile, "save", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        _run(tiny_run, out, "--grid", "5", "--seed", "3")
    monkeypatch.setattr(landscape.SurfaceFile, "save", save)
    cut = _surface(out)
    assert cut.done.tolist() == [True, True, False, False, False]
    assert np.isnan(cut.loss[2:]).all()
    assert _run(tiny_run, out, "--grid", "5", "--seed", "3") == 0
    resumed, whole = _surface(out), _surface(surface_2d)
    assert np.array_equal(resumed.loss, whole.loss)
    assert np.array_equal(resumed.accuracy, whole.accuracy)
    assert json.loads((out / "landscape_2d.json").read_text())["rows_resumed"] == 2


def test_other_settings_over_a_saved_surface(surface_2d, tiny_run, tmp_path, capsys):
    out = tmp_path / "s"
    assert _run(tiny_run, out, "--grid", "3") == 0
    before = (out / "landscape_2d.npz").read_bytes()
    for argv, flag in ((["--grid", "5"], "--grid: "), (["--grid", "3", "--seed", "1"], "--seed: "),
                       (["--grid", "3", "--range", "0.5"], "--range: ")):
        capsys.readouterr()
        assert _run(tiny_run, out, *argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and flag in err and "--overwrite" in err, err
        assert (out / "landscape_2d.npz").read_bytes() == before
    # The same settings: nothing left to compute, the same surface.
    assert _run(tiny_run, out, "--grid", "3") == 0
    assert json.loads((out / "landscape_2d.json").read_text())["rows_resumed"] == 3
    assert _run(tiny_run, out, "--grid", "5", "--seed", "3", "--overwrite") == 0
    assert np.array_equal(_surface(out).loss, _surface(surface_2d).loss)


def test_interpolation_end_points_are_the_checkpoints_losses(tiny_run, tmp_path):
    a, b = (tiny_run / "checkpoints" / f"iter_0000000{i}.pt" for i in (3, 6))
    out = tmp_path / "interp"
    assert _run(tiny_run, out, "--interpolate", str(a), str(b), "--range", "0", "1",
                "--grid", "3", "--bn-stats", "keep") == 0
    s = _surface(out, "interpolation")
    assert s.coords[0].tolist() == [0.0, 0.5, 1.0]
    for i, path in ((0, a), (2, b)):
        run = runs.open_run(tiny_run, path)
        with run.use_backend():
            ev = runs.evaluate(run.model, run.train_batches(48, 1))
        assert s.loss[i] == pytest.approx(ev.loss, rel=1e-6, abs=0), path.name
    assert s.loss[0] != s.loss[2]
    doc = json.loads((out / "interpolation.json").read_text())
    assert doc["at"]["A"]["loss"] == pytest.approx(s.loss[0], rel=1e-6)
    assert doc["at"]["B"]["loss"] == pytest.approx(s.loss[2], rel=1e-6)


def _low_variance_checkpoint(tiny_run, path):
    """Checkpoint A of the tiny run with every BatchNorm running variance divided by 20: on
    the path to B, the interpolated variance goes below zero before t = -0.5."""
    payload = ckpt.load(tiny_run / "checkpoints" / "iter_00000003.pt")
    for k, v in payload["model"].items():
        if k.endswith("running_var"):
            payload["model"][k] = v / 20
    payload[ckpt.DIGEST] = ckpt.content_digest(payload)  # an edited checkpoint, not a damaged one
    torch.save(payload, path)
    return path


def test_interpolation_recomputes_batch_norm_and_reports_what_is_not_finite(tiny_run, tmp_path):
    a = _low_variance_checkpoint(tiny_run, tmp_path / "a.pt")
    b = tiny_run / "checkpoints" / "iter_00000006.pt"
    path = ["--interpolate", str(a), str(b), "--grid", "5"]  # t = -0.5, 0, 0.5, 1, 1.5
    # The state's statistics kept: NaN where the variance went negative, said, not drawn.
    assert _run(tiny_run, tmp_path / "keep", *path, "--bn-stats", "keep") == 0
    kept = _surface(tmp_path / "keep", "interpolation")
    bad = ~np.isfinite(kept.loss)
    assert bad[0] and not bad[1:4].any()
    assert np.isnan(kept.accuracy[bad]).all()  # not 10 %: the argmax of NaN means nothing
    doc = json.loads((tmp_path / "keep" / "interpolation.json").read_text())
    assert doc["non_finite"]["points"] == int(bad.sum()) and doc["non_finite"]["at"][0] == {
        "t": -0.5}
    assert "running variance is below zero" in doc["non_finite"]["why"]
    fig = landscape.figures_of(kept, "a run")[""]
    assert figures.unlabelled(fig) == [] and figures.overlaps(fig) == []
    assert fig.legends and fig.axes[0].get_legend() is None  # below the plot, not on it
    loss_line, acc_line = fig.axes[0].lines[0], fig.axes[1].lines[0]
    assert np.isnan(loss_line.get_ydata()[bad]).all() and np.isnan(acc_line.get_ydata()[bad]).all()
    marks = [ln for ln in fig.axes[0].lines if ln.get_label() == "loss not finite here (not drawn)"]
    assert len(marks) == 1 and list(marks[0].get_xdata()) == list(kept.coords[0][bad])
    figures.pyplot().close(fig)
    # The default with --interpolate: recomputed at every point, finite everywhere.
    assert _run(tiny_run, tmp_path / "recompute", *path) == 0
    fresh = _surface(tmp_path / "recompute", "interpolation")
    assert np.isfinite(fresh.loss).all() and np.isfinite(fresh.accuracy).all()
    doc = json.loads((tmp_path / "recompute" / "interpolation.json").read_text())
    assert doc["non_finite"]["points"] == 0 and doc["settings"]["bn_stats"] == "recompute"
    # Its end point B: B's weights with statistics recomputed on the same 48 images.
    run = runs.open_run(tiny_run, b)
    data = run.train_batches(48, 1)
    with run.use_backend():
        landscape.recompute_batch_norm(run.model, data)
        ev = runs.evaluate(run.model, data)
    assert fresh.loss[3] == pytest.approx(ev.loss, rel=1e-5)


def test_recomputed_statistics_are_update_bns(tiny_run):
    """The statistics recomputed with the BatchNorms alone in training mode are
    torch.optim.swa_utils.update_bn's (which puts the whole model in training mode)."""
    run = runs.open_run(tiny_run)
    other = runs.open_run(tiny_run).model
    data = run.train_batches(100, 3)
    with run.use_backend():
        landscape.recompute_batch_norm(run.model, data)
        torch.optim.swa_utils.update_bn(data, other)
    assert not run.model.training
    mine = landscape.batch_norms(run.model)
    theirs = landscape.batch_norms(other)
    assert len(mine) == len(theirs) > 5
    for m, t in zip(mine, theirs):
        torch.testing.assert_close(m.running_mean, t.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m.running_var, t.running_var, rtol=1e-5, atol=1e-6)
        assert m.momentum == 0.1  # put back


def test_a_checkpoint_of_another_model_or_cut_short_exits_2(tiny_run, tmp_path, capsys):
    from fusedres import models

    payload = ckpt.load(tiny_run / "checkpoints" / "iter_00000006.pt")
    r14 = set(payload["model"])
    payload["model"] = models.preact_resnet(20, num_classes=10, in_chans=1).state_dict()
    extra = len(set(payload["model"]) - r14)  # units layer1.2, layer2.2, layer3.2
    payload[ckpt.DIGEST] = ckpt.content_digest(payload)
    torch.save(payload, tmp_path / "r20.pt")
    data = (tiny_run / "checkpoints" / "iter_00000006.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[:100])
    (tmp_path / "text.pt").write_bytes(b"x")  # a 1-byte text file: not pickled objects
    for name, match in (("r20.pt", "does not fit the run's model ResNet-14: full pre-activation "
                                   "unit, identity shortcut, BatchNorm, no drop-path "
                                   f"({extra} unexpected key(s), first layer1.2.bn1.bias)"),
                        ("cut.pt", "cannot be loaded: it is truncated or corrupt (PytorchStream"
                                   "Reader failed reading zip archive: failed finding central "
                                   "directory)"),
                        ("text.pt", "cannot be loaded: it is not a file torch.save writes (it "
                                    "does not begin as a zip archive)")):
        out = tmp_path / f"out-{name}"
        assert _run(tiny_run, out, "--checkpoint", str(tmp_path / name)) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.endswith(match), err
        assert not out.exists()


def test_rows_split_over_processes_and_merge():
    rows = list(range(7))
    parts = [landscape.split_rows(rows, r, 3) for r in range(3)]
    assert parts == [[0, 3, 6], [1, 4], [2, 5]]
    settings = {"grid": 7}
    coords = [np.arange(7.0), np.arange(7.0)]
    whole = landscape.SurfaceFile.empty(settings, coords)
    merged = landscape.SurfaceFile.empty(settings, coords)
    for part_rows in parts:
        part = landscape.SurfaceFile.empty(settings, coords)
        for r in part_rows:
            values = np.arange(7.0) + 10 * r
            part.set_row(r, values, values / 100)
            whole.set_row(r, values, values / 100)
        merged.merge(part)
    assert merged.done.all()
    assert np.array_equal(merged.loss, whole.loss)
    assert np.array_equal(merged.accuracy, whole.accuracy)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_two_processes_give_the_one_process_surface(surface_2d, tiny_run, tmp_path):
    out = tmp_path / "two"
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
         "-m", "fusedres.apps.experiments.landscape", str(tiny_run), "--out", str(out), *FAST,
         "--grid", "5", "--seed", "3"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert sorted(p.name for p in out.glob("*.npz")) == ["landscape_2d.npz"]  # parts merged
    two, one = _surface(out), _surface(surface_2d)
    assert two.done.all()
    assert np.array_equal(two.loss, one.loss) and np.array_equal(two.accuracy, one.accuracy)
    assert json.loads((out / "landscape_2d.json").read_text())["processes"] == 2


@pytest.mark.parametrize("argv, match", [
    (["--grid", "0"], "--grid: expected at least 2 points per axis (one point is no curve nor "
                      "surface), got 0"),
    (["--grid", "1"], "--grid: expected at least 2 points per axis (one point is no curve nor "
                      "surface), got 1"),
    (["--bn-stats", "fresh"], "argument --bn-stats: invalid choice: 'fresh'"),
    (["--range", "1", "1"], "--range: expected A < B, got 1 1"),
    (["--range", "-1"], "--range: expected R > 0"),
    (["--range", "1", "2", "3"], "--range: expected A B or R, got 3 values"),
    (["--batches", "0"], "--batches: expected at least 1 batch, got 0"),
    (["--checkpoint", "/nonexistent.pt"], "--checkpoint: '/nonexistent.pt' does not exist"),
    (["--interpolate", "/nonexistent.pt", "/nonexistent2.pt"],
     "--interpolate: '/nonexistent.pt' does not exist"),
    (["--interpolate", "a", "b", "--dims", "2"], "--dims: --interpolate gives a 1-D path"),
    (["--dims", "3"], "argument --dims: invalid choice"),
])
def test_bad_input_exits_2_before_writing(tiny_run, tmp_path, capsys, argv, match):
    out = tmp_path / "out"
    assert cli.main(["landscape", str(tiny_run), "--out", str(out), *FAST, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err
    assert not out.exists()


def test_a_run_without_checkpoints_exits_2(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert landscape.main([str(empty), *FAST]) == 2
    assert "RUN: no checkpoint in" in capsys.readouterr().err
    assert list(empty.iterdir()) == []


# --------------------------------------------------------------------------- --trajectory

def test_pca_directions_are_the_paths_principal_components():
    """Rows in a known plane: the two directions span it, their variance ratios are sklearn
    PCA's, and the uncentred projections give the rows back (the final weights at 0)."""
    from sklearn.decomposition import PCA

    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(50, 2, generator=g, dtype=torch.float64))[0].T
    coeffs = torch.randn(7, 2, generator=g, dtype=torch.float64) * torch.tensor([3.0, 0.5])
    rows = coeffs @ basis
    dirs, ratio, proj = landscape.pca_directions(rows)
    assert torch.allclose(proj @ dirs, rows, atol=1e-10)
    assert torch.allclose(dirs @ dirs.T, torch.eye(2, dtype=torch.float64), atol=1e-12)
    ref = PCA(n_components=2).fit(rows.numpy())
    assert ratio.tolist() == pytest.approx(ref.explained_variance_ratio_.tolist(), rel=1e-9)
    assert ratio.sum().item() == pytest.approx(1.0)
    assert (proj[0] <= 0).all()  # the path starts at negative coordinates
    with pytest.raises(ValueError, match="at least 2 rows"):
        landscape.pca_directions(rows[:1])


@pytest.fixture(scope="module")
def trajectory_run(tmp_path_factory):
    """conftest's tiny run with a checkpoint at every iteration, all kept (6)."""
    from conftest import TINY_RUN
    from fusedres.apps.train import main

    out = tmp_path_factory.mktemp("trajectory") / "run"
    argv = [*TINY_RUN, "--out", str(out)]
    argv[argv.index("--checkpoint-every") + 1] = "1"
    assert main([*argv, "--keep-checkpoints", "10"]) == 0
    return out


def test_trajectory_projects_the_checkpoints_on_their_pca_plane(trajectory_run, tmp_path):
    from sklearn.decomposition import PCA

    out = tmp_path / "t"
    assert _run(trajectory_run, out, "--trajectory", "--grid", "5") == 0
    doc = json.loads((out / "trajectory.json").read_text())
    path = doc["settings"]["trajectory"]
    assert path["iterations"] == [1, 2, 3, 4, 5, 6]
    assert (path["x"][-1], path["y"][-1]) == (0.0, 0.0)  # the final weights at the origin
    assert doc["settings"]["bn_stats"] == "recompute"
    # The oracle: sklearn's PCA of the checkpoints' parameters (not 1-D ones) minus the final.
    run = runs.open_run(trajectory_run)
    names = [n for n, p in run.model.named_parameters() if p.dim() > 1]
    states = [torch.load(p, weights_only=True)["model"]
              for p in ckpt.list_checkpoints(trajectory_run)]
    flat = np.stack([torch.cat([s[n].double().flatten() for n in names]).numpy()
                     for s in states])
    deltas = flat[:-1] - flat[-1]
    pca = PCA(n_components=2).fit(deltas)
    assert path["explained_variance"] == pytest.approx(pca.explained_variance_ratio_.tolist(),
                                                       rel=1e-6)
    want = deltas @ pca.components_.T
    got = np.array([path["x"][:-1], path["y"][:-1]]).T
    assert np.abs(got) == pytest.approx(np.abs(want), rel=1e-6, abs=1e-9)  # up to each sign
    # The grid holds the path; its centre value is the final weights' loss, statistics recomputed.
    s = _surface(out, "trajectory")
    assert s.coords[0][0] < min(path["x"]) and s.coords[0][-1] > max(path["x"])
    assert s.coords[1][0] < min(path["y"]) and s.coords[1][-1] > max(path["y"])
    assert s.done.all() and np.isfinite(s.loss).all()
    with run.use_backend():
        data = run.train_batches(48, 1)
        landscape.recompute_batch_norm(run.model, data)
        ev = runs.evaluate(run.model, data)
    assert doc["at"]["trained"]["loss"] == pytest.approx(ev.loss, rel=1e-6)
    # The figure: axes name the directions with their explained variance, the path is drawn.
    built = landscape.figures_of(s, "a run")
    contour = built["_contour"]
    for fig in built.values():
        assert figures.unlabelled(fig) == [] and figures.overlaps(fig) == []
    pct = [f"{100 * r:.1f} % of the variance" for r in path["explained_variance"]]
    ax = contour.axes[0]
    assert contour.axes[1].get_xlabel().startswith(f"PC1 ({pct[0]})")
    assert ax.get_ylabel().startswith(f"PC2 ({pct[1]})")
    drawn = next(ln for ln in ax.lines if ln.get_label().startswith("training path"))
    assert list(drawn.get_xdata()) == path["x"] and list(drawn.get_ydata()) == path["y"]
    for fig in built.values():
        figures.pyplot().close(fig)
    assert {p.name for p in out.iterdir()} == {"trajectory.npz", "trajectory.json",
                                               "trajectory_contour.png",
                                               "trajectory_surface.png"}


def test_trajectory_needs_three_earlier_checkpoints(tiny_run, tmp_path, capsys):
    out = tmp_path / "t"
    assert _run(tiny_run, out, "--trajectory") == 2
    err = capsys.readouterr().err.strip()
    assert "--trajectory: 1 checkpoint(s) of" in err and "needs at least 3" in err, err
    assert len(err.splitlines()) == 1 and not out.exists()
    for argv, match in ((["--dims", "1"], "--dims: --trajectory gives a 2-D surface"),
                        (["--interpolate", "a", "b"], "--trajectory: not with --interpolate")):
        assert _run(tiny_run, out, "--trajectory", *argv) == 2
        assert match in capsys.readouterr().err


# --------------------------------------------------------------------------- --hessian

def _tiny_net():
    """A network small enough for its explicit Hessian (232 parameters): conv, BatchNorm in
    evaluation mode with statistics of its own, ReLU, a linear classifier."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3, padding=1), torch.nn.BatchNorm2d(3),
                              torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(48, 4))
    net = net.double()
    with torch.no_grad():
        net.train()
        net(torch.randn(32, 1, 4, 4, dtype=torch.float64))
    batches = [(torch.randn(n, 1, 4, 4, dtype=torch.float64), torch.randint(0, 4, (n,)))
               for n in (10, 6)]
    return net.eval(), batches


def _explicit_hessian(net, batches):
    from torch.func import functional_call

    names = [n for n, _ in net.named_parameters()]
    shapes = [p.shape for _, p in net.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    buffers = dict(net.named_buffers())
    total = sum(len(y) for _, y in batches)

    def loss(v):
        parts = torch.split(v, [s.numel() for s in shapes])
        params = {n: t.view(s) for n, t, s in zip(names, parts, shapes)}
        return sum(len(y) / total * torch.nn.functional.cross_entropy(
            functional_call(net, {**params, **buffers}, (x,)), y) for x, y in batches)

    return torch.autograd.functional.hessian(loss, flat)


def test_hessian_products_and_extremes_match_the_explicit_hessian():
    """torch.func's products are H v for the explicit Hessian of the same loss (BatchNorm with
    its running statistics), and Lanczos from a random start finds its extreme eigenvalues;
    with too few steps the Ritz values lie inside the spectrum and say they did not converge."""
    net, batches = _tiny_net()
    H = _explicit_hessian(net, batches)
    hvp, n = hessian.hessian_vector_product(net, batches)
    assert n == H.shape[0] == 232
    v = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert hvp(v) == pytest.approx(H @ v, abs=1e-10)
    eig = torch.linalg.eigvalsh(H)
    assert eig[0] < 0 < eig[-1]  # a saddle: both ends matter
    start = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    found = hessian.lanczos_extremes(hvp, n, 200, 1e-8, start)
    assert found["converged"]
    assert found["min"] == pytest.approx(float(eig[0]), rel=1e-6)
    assert found["max"] == pytest.approx(float(eig[-1]), rel=1e-6)
    early = hessian.lanczos_extremes(hvp, n, 3, 1e-8, start)
    assert not early["converged"] and early["iterations"] == 3
    assert float(eig[0]) <= early["min"] and early["max"] <= float(eig[-1])


def test_hessian_map_over_the_surface_grid(tiny_run, tmp_path):
    """--hessian: lambda_min and lambda_max at every second point of the surface's grid, the
    centre computed on the plain twin of the trained network (the same loss as the surface's
    centre, running statistics), the files and a figure that fits a column."""
    out = tmp_path / "h"
    assert _run(tiny_run, out, "--grid", "5", "--hessian", "--hessian-every", "2",
                "--hessian-iters", "6") == 0
    with np.load(out / "hessian_2d.npz") as z:
        assert list(z["x"]) == [-1.0, 0.0, 1.0] and list(z["y"]) == [-1.0, 0.0, 1.0]
        lam_min, lam_max = z["lam_min"], z["lam_max"]
        assert z["done"].all() and (lam_min <= lam_max).all()
    doc = json.loads((out / "hessian_2d.json").read_text())
    surface = _surface(out)
    run = runs.open_run(tiny_run)
    twin = hessian.plain_twin(run)
    twin.load_state_dict(run.model.state_dict())
    data = run.train_batches(48, 1)
    assert runs.evaluate(twin, data).loss == pytest.approx(float(surface.loss[2, 2]), rel=1e-5)
    hvp, n = hessian.hessian_vector_product(twin, data)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):  # Rayleigh quotients lie between the extremes
        v = torch.randn(n, dtype=torch.float64, generator=g)
        q = float(v @ hvp(v) / (v @ v))
        assert doc["centre"]["lam_min"] - 1e-6 <= q <= doc["centre"]["lam_max"] + 1e-6
    assert doc["centre"]["ratio"] == pytest.approx(
        abs(doc["centre"]["lam_min"] / doc["centre"]["lam_max"]))
    assert {"hessian_2d.npz", "hessian_2d.json", "hessian_2d.png"} <= {
        p.name for p in out.iterdir()}
    # A rerun with the same settings has nothing left to compute; other settings are refused.
    assert _run(tiny_run, out, "--grid", "5", "--hessian", "--hessian-every", "2",
                "--hessian-iters", "6") == 0
    assert _run(tiny_run, out, "--grid", "5", "--hessian", "--hessian-every", "2",
                "--hessian-iters", "7") == 2


def test_hessian_figure_fits_a_column():
    from fusedres.apps.experiments import landscape_plots

    x = y = np.linspace(-1, 1, 5)
    ratio = np.abs(np.add.outer(y, x)) / 2
    lam = np.exp(np.add.outer(y ** 2, x ** 2))
    fig = landscape_plots.hessian_figure(x, y, ratio, lam, (0.0, 0.0),
                                         landscape_plots.DIRECTION_LABELS, "a run, seed 0")
    assert figures.unlabelled(fig) == [] and figures.overlaps(fig) == []
    assert fig.get_figwidth() == figures.COLUMN_WIDTH
    figures.pyplot().close(fig)


@pytest.mark.parametrize("argv, match", [
    (["--hessian", "--dims", "1"], "--hessian: maps the 2-D grid"),
    (["--hessian-every", "0"], "--hessian-every: expected K >= 1"),
    (["--hessian-tol", "0"], "--hessian-tol: expected a tolerance > 0"),
])
def test_bad_hessian_options_exit_2(tiny_run, tmp_path, capsys, argv, match):
    out = tmp_path / "x"
    assert _run(tiny_run, out, *argv) == 2
    assert match in capsys.readouterr().err and not out.exists()
