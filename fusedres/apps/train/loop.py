"""The training run, :class:`Run`: the loop, checkpoints on a schedule and on SIGTERM/SIGINT,
evaluation, the final report. Its set-up (everything checked before anything is written) is
:class:`~fusedres.apps.train.run_setup.RunSetup`'s, its memory plan and report
:class:`~fusedres.apps.train.run_memory.RunMemory`'s; what it is built from, build.py's."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fusedres
from fusedres.memory import SavedTensorCounter

from . import checkpoint as ckpt
from . import metrics as M
from . import provenance
from .build import _SHORTCUT_ARGS, RECIPE_KEYS
from .naming import variant_label
from .run_memory import RunMemory
from .run_setup import RunSetup
from .step import float_lr_state


class Stopped(SystemExit):
    """The run ended at once by a signal (:meth:`Run._on_signal`): ``code`` is 128 + its
    number. A SystemExit, so that no ``except Exception`` on the way out takes it."""


def crop_average(model: nn.Module, x: torch.Tensor,
                 autocast: contextlib.AbstractContextManager | None = None) -> torch.Tensor:
    """Several crops per image, x (B, crops, C, H, W): the log of the mean over the crops of
    ``model``'s softmax, (B, classes) float32. Krizhevsky et al.'s 10-crop testing averages
    the softmax outputs (not the logits); the log is taken stably, as a logsumexp of
    log-softmaxes. The model as it is: call in eval mode, without grad."""
    b, k = x.shape[:2]
    with autocast if autocast is not None else contextlib.nullcontext():
        out = model(x.flatten(0, 1))
    log_p = out.float().log_softmax(1).view(b, k, -1)
    return torch.logsumexp(log_p, 1) - math.log(k)


class Run(RunSetup, RunMemory):
    """A training run of ``cfg`` (``explicit``: the options the command line set), set up
    and checked on construction; :meth:`train` runs it."""

    def __init__(self, cfg: dict[str, Any], explicit: set[str],
                 scope: contextlib.ExitStack | None = None):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.stop_signal: int | None = None
        self._graceful = False  # see _on_signal
        self._pid = os.getpid()
        self.scope = scope if scope is not None else contextlib.ExitStack()
        self._catch_signals()
        self._setup(cfg, explicit)

    # ------------------------------------------------------------------ checkpoints
    def _state(self) -> dict[str, Any]:
        cfg = dict(self.cfg)
        cfg["out"] = str(self.out)
        cfg["resume"] = None
        return {
            "model": self.model.state_dict(),
            "optimizer": float_lr_state(self.optimizer),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
            "scheduler": {"iteration": self.iteration, "milestones": self.milestones,
                          "warmup_iters": self.cfg["warmup_iters"]},
            "lr_scheduler": self.schedule.state_dict(),
            **({"ema": self.ema.state_dict()} if self.ema is not None else {}),
            "sampler": {"seed": self.cfg["seed"],
                        "epoch": self.iteration // self.batches.iters_per_epoch,
                        "position": self.iteration % self.batches.iters_per_epoch},
            "rng": ckpt.rng_state(),
            "metrics": self.history,
            "accum": self.accum,
            "config": cfg,
            "layout": dict(self.layout),
            "saved_activation_bytes": self.saved_bytes,
            "elapsed_s": self.elapsed,
            "world_size": self.world,
        }

    def save_checkpoint(self) -> None:
        if self.iteration == self.last_saved:
            return
        if self.rank == 0:
            ckpt.save(self.out, self._state(), self.iteration, self.cfg["keep_checkpoints"])
        self.last_saved = self.iteration

    # ------------------------------------------------------------------ metrics
    def _record(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        if self.log is not None:
            self.log.add(record)

    def _all_sum(self, values: list[float]) -> list[float]:
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Test loss and error of the model, or of its EMA with --ema-decay."""
        model = self.model if self.ema is None else self.ema.module
        if self.rss_peaks is not None:  # the evaluation in a window of its own
            self.rss_peaks.mark()
        was_training = model.training
        model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        n = 0
        for x, y in self.batches.eval_batches(self.cfg["eval_batch_size"]):
            if x.dim() == 5:  # (B, crops, C, H, W): --ten-crop
                log_probs = crop_average(model, x, self._autocast())
                loss_sum += F.nll_loss(log_probs, y, reduction="sum").double()
                correct += (log_probs.argmax(1) == y).sum()
            else:
                with self._autocast():
                    out = model(x)
                loss_sum += F.cross_entropy(out.float(), y, reduction="sum").double()
                correct += (out.argmax(1) == y).sum()
            n += len(y)
        model.train(was_training)
        if self.rss_peaks is not None:
            self.rss_peaks.mark()
        loss_sum, correct, n = self._all_sum([loss_sum.item(), float(correct.item()), float(n)])
        return loss_sum / n, 1.0 - correct / n

    def _autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    # ------------------------------------------------------------------ signals
    def _catch_signals(self) -> None:
        """SIGTERM and SIGINT go to :meth:`_on_signal` from the start of the set-up until the
        run's scope closes (fusedres train's main: after the last file is written), so that
        the exit code is 128 + the signal's number whenever one comes, however many. Python
        sets handlers in the main thread only (elsewhere a signal keeps its handler)."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

        def restore():
            for s, h in previous.items():
                signal.signal(s, h)

        self.scope.callback(restore)

    def _on_signal(self, signum, frame):
        """The first signal while the run trains (:meth:`train`) asks the loop to stop: it
        checkpoints at the end of the iteration and the run returns 128 + signal. Any other one
        (a second, or one during the set-up, before a step can be saved) ends the run at once:
        :class:`Stopped`, whose temporary files are removed on the way out (write_atomically)
        or by the next start."""
        if os.getpid() != self._pid:
            # A process forked from the run (a DataLoader worker) inherits the handler: it goes on
            # and ends with the run, which stops its workers itself.
            return
        first = self.stop_signal is None
        if first:
            self.stop_signal = signum
        if not (first and self._graceful):
            raise Stopped(128 + signum)

    def _stop_requested(self) -> bool:
        flag = 0 if self.stop_signal is None else int(self.stop_signal)
        if self.world > 1:
            t = torch.tensor([flag], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = int(t.item())
            if flag and self.stop_signal is None:
                self.stop_signal = flag
        return flag != 0

    # ------------------------------------------------------------------ loop
    def train(self) -> int:
        """Train to the end (0) or to a stop (128 + the signal's number: also when the signal
        came after the last iteration, as the finish was written)."""
        self._rss_pre_step()
        self._graceful = True
        try:
            with self._memory_tracker():
                if self.live is not None:
                    self.live.count(self.model, self.optimizer, *self.data.resident_tensors())
                code = self._loop()
        finally:
            self.batches.close()
        if code == 0:
            self._finish()
        if self.log is not None:
            self.log.close()
        return 128 + int(self.stop_signal) if self.stop_signal is not None else code

    def mixed(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch through MixUp/CutMix, in the batch's memory layout (their roll makes a
        contiguous copy)."""
        fmt = (torch.channels_last if self.cfg["channels_last"] else torch.contiguous_format)
        x, y = self.mix(x, y)
        return x.contiguous(memory_format=fmt), y

    def _train_step(self, x, y, lr: float):
        """One step at learning rate ``lr``: (loss, correct) as device tensors."""
        if self.rss_peaks is not None:  # a window a step: fusedres.memory.ResidentPeaks
            self.rss_peaks.mark()
        self.lr.fill_(lr)  # in place: a kernel on the device's stream, no host read
        measure = self.saved_bytes is None and not self.cfg["compile"]
        counter = SavedTensorCounter(exclude=self.model) if measure else None
        loss, correct = self.run_step(x, y, counter)
        if self.ema is not None:
            self.ema.update_parameters(self.model)
        if measure:
            self.saved_bytes = self._all_sum([float(counter.total_bytes)])[0] / self.world
            self.saved_bytes = int(self.saved_bytes)
        return loss, correct

    def _loop(self) -> int:
        cfg, ipe = self.cfg, self.batches.iters_per_epoch
        n_epochs = math.ceil(self.max_iters / ipe)
        show = cfg["progress"] and self.rank == 0
        self.train_model.train()
        dev = self.device
        a = self.accum
        ep_loss = torch.tensor(a.get("ep_loss", 0.0), dtype=torch.float64, device=dev)
        ep_correct = torch.tensor(a.get("ep_correct", 0), dtype=torch.int64, device=dev)
        ep_seen, ep_time = a.get("ep_seen", 0), a.get("ep_time", 0.0)
        # The window of the next record: its sums, and the time of the part a stop cut short
        # (restored from the checkpoint: :meth:`_stop_between_records`; its sums are over every
        # process, so rank 0 alone takes them back).
        mine = a if self.rank == 0 else {}
        win = [torch.tensor(mine.get("win_loss", 0.0), dtype=torch.float64, device=dev),
               torch.tensor(mine.get("win_correct", 0), dtype=torch.int64, device=dev),
               mine.get("win_seen", 0)]
        win_time = a.get("win_time", 0.0)
        local = self.batches.local

        while self.iteration < self.max_iters:
            epoch = self.iteration // ipe
            bar = None
            if show:
                from tqdm import tqdm
                bar = tqdm(total=min(ipe, self.max_iters - epoch * ipe),
                           initial=self.iteration - epoch * ipe, file=sys.stderr,
                           desc=f"epoch {epoch + 1}/{n_epochs}", dynamic_ncols=True,
                           leave=True)
            t0 = time.perf_counter()
            while self.iteration < self.max_iters and self.iteration // ipe == epoch:
                it = self.iteration
                lr = self.schedule.lr
                x, y = self.batches.train_batch(it)
                if self.mix is not None:
                    x, y = self.mixed(x, y)
                # --log-grad-norms: measured on the steps that end at a multiple of its interval
                # (a multiple of --log-every: read back below with the log record's sync).
                probed = (self.probe is not None
                          and (it + 1) % cfg["log_grad_norms"] == 0)
                if probed:
                    self.probe.arm(self.scaler)
                loss, correct = self._train_step(x, y, lr)
                self.schedule.step()
                win[0] += loss.double() * local
                win[1] += correct
                win[2] += local
                self.iteration += 1
                if bar is not None:
                    bar.update(1)
                epoch_end = self.iteration % ipe == 0 or self.iteration == self.max_iters
                boundary = (self.iteration % cfg["log_every"] == 0 or epoch_end
                            or self.iteration % cfg["checkpoint_every"] == 0
                            or (cfg["eval_every"] and self.iteration % cfg["eval_every"] == 0))
                stop = self._stop_requested()
                if not (boundary or stop):
                    continue
                if not boundary:
                    self._stop_between_records(win, win_time, t0)
                    return self._stopped(bar)
                # Close the timing window (the .item() calls synchronise the device).
                l_sum, c_sum, n = self._all_sum([win[0].item(), float(win[1].item()),
                                                 float(win[2])])
                now = time.perf_counter()
                dt = now - t0 + win_time
                ep_loss += win[0]
                ep_correct += win[1]
                ep_seen += win[2]
                ep_time += dt
                self.elapsed += now - t0
                win_time = 0.0
                win = [torch.zeros_like(win[0]), torch.zeros_like(win[1]), 0]
                rate = n / dt if dt > 0 else float("nan")
                mem = M.peak_memory_bytes(dev)
                record = {"kind": "train", "iteration": self.iteration, "epoch": epoch + 1,
                          "lr": lr, "loss": l_sum / n, "error": 1 - c_sum / n,
                          "images_per_s": rate, "peak_memory_bytes": mem,
                          "time_s": self.elapsed}
                self._record(record)
                if probed:
                    self._record({"kind": "grad_norms", "iteration": self.iteration,
                                  "epoch": epoch + 1, **self.probe.read()})
                if not math.isfinite(record["loss"]) and self.diverged_at is None:
                    self.diverged_at = self.iteration
                    if self.rank == 0:
                        print(f"\nfusedres train: warning: the training loss is "
                              f"{record['loss']} by iteration {self.iteration}: the run has "
                              "diverged (a lower --lr or a longer --warmup-iters may help); "
                              "training goes on to the end", file=sys.stderr)
                if bar is not None:
                    bar.set_postfix(loss=f"{record['loss']:.3f}",
                                    acc=f"{100 * (1 - record['error']):.1f}%",
                                    img_s=f"{rate:.0f}", mem=M.format_bytes(mem), refresh=False)
                if epoch_end or (cfg["eval_every"] and self.iteration % cfg["eval_every"] == 0):
                    test_loss, test_err = self.evaluate()
                    self._record({"kind": "eval", "iteration": self.iteration,
                                  "epoch": epoch + 1, "test_loss": test_loss,
                                  "test_error": test_err})
                    if bar is not None:
                        bar.set_postfix(loss=f"{record['loss']:.3f}",
                                        acc=f"{100 * (1 - record['error']):.1f}%",
                                        test_acc=f"{100 * (1 - test_err):.1f}%",
                                        img_s=f"{rate:.0f}", mem=M.format_bytes(mem))
                if epoch_end:
                    tot = self._all_sum([ep_loss.item(), float(ep_correct.item()),
                                         float(ep_seen)])
                    self._record({"kind": "epoch", "iteration": self.iteration,
                                  "epoch": epoch + 1, "loss": tot[0] / tot[2],
                                  "error": 1 - tot[1] / tot[2], "test_loss": test_loss,
                                  "test_error": test_err, "epoch_time_s": ep_time,
                                  "images_per_s": tot[2] / ep_time if ep_time else None,
                                  "peak_memory_bytes": mem, "time_s": self.elapsed})
                    ep_loss.zero_()
                    ep_correct.zero_()
                    ep_seen, ep_time = 0, 0.0
                self.accum = {"ep_loss": ep_loss.item(), "ep_correct": int(ep_correct.item()),
                              "ep_seen": ep_seen, "ep_time": ep_time,
                              "diverged_at": self.diverged_at}
                if (epoch_end or stop or self.iteration % cfg["checkpoint_every"] == 0
                        or self.iteration == self.max_iters):
                    self.save_checkpoint()
                if stop:
                    return self._stopped(bar)
                t0 = time.perf_counter()
            if bar is not None:
                bar.close()
        return 0

    def _stop_between_records(self, win: list, win_time: float, t0: float) -> None:
        """A stop at an iteration that writes no record: the window so far (its sums over every
        process and its time) goes into the checkpoint (accum's ``win_*``) instead of a record
        of its own, so that the resumed run writes exactly the records an uninterrupted one
        does."""
        dt = time.perf_counter() - t0
        self.elapsed += dt
        l_sum, c_sum, n = self._all_sum([win[0].item(), float(win[1].item()), float(win[2])])
        self.accum = {**self.accum, "win_loss": l_sum, "win_correct": int(c_sum),
                      "win_seen": int(n), "win_time": win_time + dt}
        self.save_checkpoint()

    def _stopped(self, bar) -> int:
        """The checkpointed stop's end: the message, and 128 + the signal's number."""
        if bar is not None:
            bar.close()
        if self.rank == 0:
            name = signal.Signals(self.stop_signal).name
            print(f"fusedres train: {name} received: checkpoint saved at iteration "
                  f"{self.iteration} in {self.out}; continue with --resume", file=sys.stderr)
        return 128 + int(self.stop_signal)

    # ------------------------------------------------------------------ report
    def _finish(self) -> None:
        self.save_checkpoint()
        if self.rank != 0:
            return
        extra = {
            "model": self.cfg["model"] if self.cfg["model"] != "preact_resnet"
            else f"preact_resnet (depth {self.cfg['depth']})",
            "label": variant_label(self.cfg),
            "dataset": self.cfg["dataset"], "iterations": self.iteration,
            "fused": self.cfg["fused"],
            "backend": (fusedres.resolve_backend(self.device) if self.cfg["fused"]
                        else "plain PyTorch"),
            "device": str(self.device), "world_size": self.world,
            "batch_size": self.cfg["batch_size"], "amp": self.cfg["amp"],
            "cuda_graphs": self.cfg["cuda_graphs"], "compile": self.cfg["compile"],
            "channels_last": self.layout["channels_last"],
            "channels_last_origin": self.layout["origin"],
            "layout_reason": self.layout["reason"],
            "threads": torch.get_num_threads(),
            "saved_activation_bytes": self.saved_bytes,
            "memory_kind": ("CUDA max allocated" if self.device.type == "cuda"
                            else "process peak RSS"),
            "parameters": self.parameters,
            "variant": {k: self.cfg[k] for k in ("unit", "shortcut", "norm", "drop_path_rate",
                                                 "drop_path_mode", *_SHORTCUT_ARGS)},
            "recipe": {k: self.cfg[k] for k in RECIPE_KEYS},
            "diverged_at_iteration": self.diverged_at,
            "memory_plan": None if self.plan_summary is None else str(self.plan_summary),
            provenance.KEY: provenance.from_config(self.out),
        }
        extra.update(self._memory_report())
        s = M.summary(self.history, extra)
        if s.get("peak_memory_bytes") is None:
            s["peak_memory_bytes"] = M.peak_memory_bytes(self.device)
        table = M.summary_table(s)
        for name, text in (("summary.json", json.dumps(s, indent=2) + "\n"),
                           ("summary.md", table + "\n")):
            with ckpt.writing(self.out / name):
                ckpt.write_atomically(self.out / name, lambda f, t=text: f.write(t.encode()))
        png = M.plot(self.history, self.out / "curves.png",
                     f"{extra['label']} on {self.cfg['dataset']}")
        print(table)
        if png is not None:
            print(f"curves: {png}")
        if self.log is not None and self.log.tb_note:
            print(f"note: {self.log.tb_note}")
