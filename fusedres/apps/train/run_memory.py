"""The run's memory, :class:`RunMemory` (a base of :class:`fusedres.apps.train.loop.Run`):
the plan under --memory-budget / --activation-budget and whether it fits the device, what the
plan counts as resident, the live-tensor tracker and the resident-set figures on CPU, and the
report of the predicted peaks beside the measured ones."""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import fusedres
from fusedres.memory import LiveTensorTracker, PlanError, SavedTensorCounter

from . import metrics as M
from .build import _AMP, _first_line, _param_groups
from .config import UsageError, parse_bytes

AUTO_MARGIN_FRACTION, AUTO_MARGIN_BYTES = 0.05, 256 * 2 ** 20


def auto_budget(device: torch.device) -> int:
    """``--memory-budget auto``: the free GPU memory (on CPU, MemAvailable) minus a margin of
    5% of the device's total + 256 MiB: headroom for what the budget does not bound (cuDNN's
    workspaces, the caching allocator's reserved but unallocated blocks; on a GPU the plan
    states both, ``plan.cuda``; the CUDA context is already out of the free figure)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
    else:
        info = {}
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    key, value = line.split(":", 1)
                    info[key] = int(value.split()[0]) * 1024
        except (OSError, ValueError):
            raise UsageError("--memory-budget auto: cannot read the available memory "
                             "(/proc/meminfo); give a size such as 4GiB") from None
        free, total = info.get("MemAvailable", 0), info.get("MemTotal", 0)
    budget = int(free - AUTO_MARGIN_FRACTION * total - AUTO_MARGIN_BYTES)
    if budget <= 0:
        raise UsageError(f"--memory-budget auto: only {free / 2 ** 30:.2f} GiB free on "
                         f"{device.type}, less than the margin")
    return budget


def _rss_figures(run) -> tuple[int | None, int | None, int | None, int | None]:
    """Of ``run`` (a :class:`Run`) on CPU under a budget: (the peak resident set above the
    baseline, its rise over the pre-step resident set, the figure the budget bounds: the peak
    allocated memory above the baseline's, or the resident set's where Linux does not tell the
    two apart, the mapped files' pages added since the baseline or None); all None
    elsewhere."""
    if run.device.type != "cpu" or run.rss_baseline is None:
        return None, None, None, None
    peaks = run.rss_peaks
    if peaks is None:
        peak = fusedres.memory.peak_rss_bytes()
        rss = max(peak, run.rss_setup_peak or 0) - run.rss_baseline
        steps = None if run.rss_pre_step is None else peak - run.rss_pre_step
        return rss, steps, rss, None
    peaks.mark()
    rss = peaks.peak_total - run.rss_baseline
    steps = (None if run.rss_pre_step is None
             else max(peaks.window_peaks[1:], default=run.rss_pre_step) - run.rss_pre_step)
    return rss, steps, peaks.allocated_above_baseline, peaks.file_above_baseline


class RunMemory:
    """The memory half of :class:`~fusedres.apps.train.loop.Run`: its plan (set-up), the
    trackers around the steps and the report (finish)."""

    def _device_fit(self, total_bytes: int) -> str | None:
        """On a GPU, before the first step: whether --memory-budget (or the plan's predicted
        max_memory_reserved, when larger) + cuDNN's workspace allowance + the CUDA context fit
        the device's ``total_bytes``; the warning naming the figures when they do not."""
        p = self.plan_summary
        if p is None or p.cuda is None:
            return None
        return fusedres.memory.device_fit_warning(p.cuda, self.memory_budget, total_bytes)

    def _data_bytes(self) -> int:
        """Bytes of the dataset this process keeps on the device (one count per storage)."""
        d = self.data
        tensors = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                   for t in d.resident_tensors()}
        return sum(tensors.values())

    def _resident_bytes(self) -> int:
        """What the plan counts as resident beside the step: the dataset's tensors; on CPU
        with --memory-budget, what loading it added to the resident set when that is more
        (the loader's imports, its freed buffers that stay mapped)."""
        return max(self._data_bytes(), self.data_rss or 0)

    def _plan(self, model):
        cfg = self.cfg
        budget, flag = None, "--activation-budget"
        if cfg["memory_budget"] is not None:
            flag = "--memory-budget"
            budget = (auto_budget(self.device) if cfg["memory_budget"] == "auto"
                      else parse_bytes(cfg["memory_budget"]))
        activation = (None if cfg["activation_budget"] is None
                      else parse_bytes(cfg["activation_budget"], "--activation-budget"))
        self.memory_budget = budget
        # One micro-batch's activations at a time under --accum-steps.
        shape = (self.batches.local // cfg["accum_steps"], *self.data.image_shape)
        # The trainer's optimizer, as the planner simulates it (class and hyperparameters).
        if cfg["optimizer"] == "adamw":
            spec = torch.optim.AdamW(_param_groups(model, cfg), lr=cfg["lr"],
                                     betas=tuple(cfg["betas"]))
        else:
            spec = torch.optim.SGD(_param_groups(model, cfg), lr=cfg["lr"],
                                   momentum=cfg["momentum"], nesterov=cfg["nesterov"])
        n_eval = min(cfg["eval_batch_size"], math.ceil(self.data.num_test / self.world))
        # Ten crops, or crops larger than the training one (imagefolder): the evaluation
        # forward as a batch of training-sized images (activations scale with the pixels).
        n_eval = math.ceil(n_eval * self.batches.eval_scale)
        try:
            # Under --amp the weights' half copies that autocast saves count too.
            # On CPU the budget bounds the process above its baseline (the allocator's slack
            # included; the plan sets glibc's thresholds, already set above).
            process = self.rss_baseline is not None and budget is not None
            return fusedres.memory.plan(
                model, shape, budget, dtype=self.amp_dtype_for_plan(),
                autocast=_AMP[cfg["amp"]] is not None, activation_budget=activation,
                optimizer=spec, eval_batch_size=n_eval,
                resident_bytes=self._resident_bytes() + self._ema_bytes(model),
                channels_last=cfg["channels_last"], process=process,
                baseline_bytes=self.rss_baseline if process else None,
                cuda_capability=(torch.cuda.get_device_capability(self.device)
                                 if self.device.type == "cuda" else (9, 0)))
        except PlanError as e:
            hint = ("; or lower --eval-batch-size" if "eval forward is the peak" in str(e)
                    else "")
            raise UsageError(f"{flag} {cfg[flag[2:].replace('-', '_')]}: {_first_line(e)}"
                             f"{hint}") from None
        except (ValueError, RuntimeError, MemoryError) as e:
            raise UsageError(f"{flag} {cfg[flag[2:].replace('-', '_')]}: "
                             f"{_first_line(e)}") from None

    def _ema_bytes(self, model: nn.Module) -> int:
        """--ema-decay: the average's copy of the weights and buffers, resident beside the
        step (0 without)."""
        if self.cfg["ema_decay"] is None:
            return 0
        return sum(t.numel() * t.element_size()
                   for t in (*model.parameters(), *model.buffers()))

    def _saved_bytes_on_meta(self, model: nn.Module) -> int | None:
        import copy

        try:
            meta = copy.deepcopy(model).to("meta")
            n = self.batches.local // self.cfg["accum_steps"]  # one micro-batch's forward
            x = torch.empty((n, *self.data.image_shape), device="meta")
            y = torch.zeros(n, dtype=torch.int64, device="meta")
            with SavedTensorCounter(exclude=meta) as counter:
                F.cross_entropy(meta(x), y)
            return counter.total_bytes
        except Exception:  # a model that cannot run on meta: no count, no failure
            return None

    def amp_dtype_for_plan(self):
        return _AMP[self.cfg["amp"]] or torch.float32

    def _memory_tracker(self) -> contextlib.AbstractContextManager:
        """On CPU, with a plan to check, the live-tensor tracker over the run (the figure the
        plan predicts); on a GPU the CUDA allocator's own peak serves."""
        if (self.plan_summary is None or self.device.type != "cpu" or self.world > 1
                or self.cfg["compile"]):
            return contextlib.nullcontext()
        self.live = LiveTensorTracker()
        return self.live

    def _rss_pre_step(self) -> None:
        """On CPU with --memory-budget: the resident set once the data, the model and the
        optimizer are built, before the first step, and the peak until then. The peak is
        reset to it where Linux allows, so that the report also gives the rise over the steps
        (else the peak is the process's lifetime one and that figure an upper bound)."""
        self.rss_pre_step, self.rss_setup_peak, self.rss_peak_since_pre_step = None, None, False
        if self.device.type == "cpu" and self.rss_baseline is not None:
            if self.rss_peaks is not None:  # the set-up's window; each step then has its own
                self.rss_peaks.mark()
                self.rss_setup_peak = self.rss_peaks.peak_total
                self.rss_peak_since_pre_step = self.rss_peaks.resettable
            else:
                self.rss_setup_peak = fusedres.memory.peak_rss_bytes()
                self.rss_peak_since_pre_step = fusedres.memory.reset_peak_rss()
            self.rss_pre_step = fusedres.memory.rss_bytes()

    def _memory_report(self) -> dict[str, Any]:
        """Predicted and measured peak side by side (stderr), a warning when the measured one
        exceeds --memory-budget; the figures for summary.json."""
        p = self.plan_summary
        if p is None or p.step is None:
            return {}
        cuda = self.device.type == "cuda"
        reserved = None
        if cuda:
            # The allocator replay's figure (cuBLAS's workspace included) when there is one.
            pred = p.cuda.allocated if p.cuda is not None else (p.cuda_step or p.step).peak_bytes
            measured, kind = torch.cuda.max_memory_allocated(self.device), "CUDA max allocated"
            reserved = torch.cuda.max_memory_reserved(self.device)
            pred_text = f"{M.format_bytes(pred)}"
        else:
            pred = p.step.peak_bytes
            measured = None if self.live is None else self.live.peak_bytes
            kind = "live tensors (LiveTensorTracker)"
            tensors = p.step.tensor_peak_bytes + p.step.resident
            pred_text = (f"{M.format_bytes(pred)} = tensors {M.format_bytes(tensors)} (the data at "
                         f"what loading it added to the resident set) + kernel workspace "
                         f"{M.format_bytes(p.step.workspace)} (not seen by the tracker)")
        lines = [f"memory: predicted peak {pred_text}; measured {M.format_bytes(measured)} "
                 f"({kind})"]
        if reserved is not None and p.cuda is not None:
            setting = ("expandable_segments:True" if p.cuda.expandable
                       else "default segments; expandable_segments:True is predicted "
                       + M.format_bytes(p.cuda.reserved_expandable))
            lines.append(f"memory: max_memory_reserved predicted {M.format_bytes(p.cuda.reserved)}"
                         f" ({setting}); measured {M.format_bytes(reserved)}")
        # On CPU the process: its peak above the baseline the budget counts from (torch and
        # fusedres imported, before the data and the model: Run._setup), beside the plan's
        # prediction of it (the step's peak + the allocator's slack). The budget bounds the
        # memory allocated; the resident set also holds pages of mapped files, reported beside
        # it (fusedres.memory.ResidentPeaks says why they are told apart).
        rss, rss_steps, bounded, files = _rss_figures(self)
        proc = p.process
        if rss is not None:
            text = "process memory above its baseline: "
            if proc is not None:
                text += (f"predicted {M.format_bytes(proc.above_baseline)} (the step "
                         f"{M.format_bytes(proc.tensors)} + allocator slack "
                         f"{M.format_bytes(proc.slack)}); ")
            text += (f"measured {M.format_bytes(bounded)} "
                     + ("allocated" if files is not None else "of resident set")
                     + f" (baseline {M.format_bytes(self.rss_baseline)} resident: torch and "
                       f"fusedres imported, before the data and the model)")
            if files is not None:
                text += (f"; peak RSS {M.format_bytes(rss)} above the baseline, with "
                         f"{M.format_bytes(files)} more of mapped files' pages (the libraries' "
                         f"code; not bounded)")
            if rss_steps is not None:
                text += (f"; the steps added {M.format_bytes(rss_steps)} to the resident set "
                         f"before the first"
                         + ("" if self.rss_peak_since_pre_step else " (an upper bound)"))
            lines.append(text)
        budget = self.memory_budget
        if budget is not None and measured is not None and measured > budget:
            lines.append(f"warning: the measured peak {M.format_bytes(measured)} exceeds "
                         f"--memory-budget {self.cfg['memory_budget']} "
                         f"({M.format_bytes(budget)})")
        if budget is not None and bounded is not None and bounded > budget:
            released = proc.released if proc is not None else fusedres.memory.released()
            lines.append(f"warning: the process's peak above its baseline, "
                         f"{M.format_bytes(bounded)}, exceeds --memory-budget "
                         f"{self.cfg['memory_budget']} ({M.format_bytes(budget)})"
                         + ("" if released else
                            "; freed blocks stay resident (FUSEDRES_RELEASE_FREED_MEMORY=0, or "
                            "glibc's MALLOC_ thresholds set in the environment)"))
        for line in lines:
            print(f"fusedres train: {line}", file=sys.stderr)
        return {"memory_budget_bytes": budget, "predicted_peak_bytes": pred,
                "predicted_cuda_peak_bytes": None if p.cuda_step is None
                else p.cuda_step.peak_bytes,
                "predicted_cuda_reserved_bytes": None if p.cuda is None else p.cuda.reserved,
                "measured_cuda_reserved_bytes": reserved,
                "device_warning": self.device_warning,
                "measured_peak_bytes": measured, "measured_peak_kind": kind,
                "predicted_process_bytes": None if proc is None else proc.above_baseline,
                "predicted_slack_bytes": None if proc is None else proc.slack,
                "rss_baseline_bytes": None if cuda else self.rss_baseline,
                "peak_rss_above_baseline_bytes": rss,
                "peak_allocated_above_baseline_bytes": bounded if files is not None else None,
                "mapped_files_above_baseline_bytes": files,
                "rss_pre_step_bytes": None if cuda else self.rss_pre_step,
                "peak_rss_above_pre_step_bytes": rss_steps, "allocator": self.allocator}
