"""The run's set-up, :class:`RunSetup` (a base of :class:`fusedres.apps.train.loop.Run`):
the checkpoint to resume, the process (threads, device, backend, glibc's allocator), the data,
the model, the optimizer and the step, a checkpoint's restore, the run directory's lock, the
memory layout, the banner and the resolved config.yaml. Everything is checked before anything
is written."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import yaml

import fusedres
from fusedres import distributed as fdist
from fusedres import settings
from fusedres.memory import LiveTensorTracker

from . import checkpoint as ckpt
from . import data as data_mod
from . import metrics as M
from . import provenance, resume_checks
from .build import (
    _AMP,
    _check_backend,
    _check_cuda_graphs,
    _device,
    _ema,
    _first_line,
    _mixer,
    _optimizer,
    _param_groups,
    _state_like_params,
    _variant_line,
    build_model,
    milestones,
)
from .config import UsageError, merge_saved, resolve_channels_last
from .gradnorms import GradNormProbe
from .runlock import RunLock, RunLocked
from .schedule import LRSchedule
from .seeds import seed_python_and_numpy
from .step import WARMUP_STEPS, GraphedStep, TrainStep, lr_tensor, start_momentum, use_lr


class RunSetup:
    """The set-up half of :class:`~fusedres.apps.train.loop.Run`: its methods read and
    set the run's attributes (``Run.__init__`` calls :meth:`_setup`)."""

    def _resolve_resume(self, cfg, explicit):
        cfg, out, state = self._resume_state(cfg, explicit)
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out: {str(out)!r} exists and is not a directory")
        parent = next((p for p in (out, *out.parents) if p.exists()), Path("."))
        if not os.access(parent, os.W_OK | os.X_OK):
            raise UsageError(f"--out: {str(parent)!r} is not writable")
        return cfg, out, state

    def _resume_state(self, cfg, explicit):
        out = Path(cfg["out"] or f"runs/{cfg['dataset']}-{cfg['model']}")
        resume, state = cfg["resume"], None
        self.resume_path = None
        if resume is None:
            if ckpt.list_checkpoints(out):
                raise UsageError(f"--out: {str(out)!r} already holds a run (checkpoints); "
                                 "continue it with --resume, or choose another --out")
            return cfg, out, None
        if resume in ("latest", "auto"):
            found = ckpt.list_checkpoints(out)
            if not found:
                if resume == "auto":
                    return cfg, out, None
                raise UsageError(f"--resume: no checkpoint in {str(out / 'checkpoints')!r}")
            path, state = self._newest_intact(found)
        else:
            path = Path(resume)
            if "out" not in explicit:
                out = path.parent.parent if not path.is_dir() else path
            if path.is_dir() and ckpt.list_checkpoints(path):
                path, state = self._newest_intact(ckpt.list_checkpoints(path))
            else:
                path = path / "checkpoints" if path.is_dir() else path
                state = self._load_named(path)
        self.resume_path = path
        cfg = merge_saved(cfg, explicit, state["config"])
        return cfg, out, state

    def _newest_intact(self, found: list[Path]) -> tuple[Path, dict[str, Any]]:
        """The newest of the checkpoints ``found`` that loads (its digest and fields checked:
        ckpt.load). Each newer one refused is said on one warning line naming it and why;
        none intact is a UsageError naming the newest's fault."""
        refused = []
        for path in reversed(found):
            try:
                state = ckpt.load(path)
            except ckpt.CheckpointError as e:
                refused.append(str(e))
                continue
            if self.rank == 0:
                for why in refused:
                    print(f"fusedres train: warning: {why}; resuming from the newest intact "
                          f"checkpoint, {str(path)!r}", file=sys.stderr)
            return path, state
        more = f" ({len(found) - 1} older refused too)" if len(found) > 1 else ""
        raise UsageError(f"--resume: no intact checkpoint: {refused[0]}{more}")

    @staticmethod
    def _load_named(path: Path) -> dict[str, Any]:
        """``--resume FILE``: that checkpoint, or a UsageError naming the newest intact one
        beside it."""
        try:
            return ckpt.load(path)
        except ckpt.CheckpointError as e:
            msg = str(e)
            good = [p for p in ckpt.list_checkpoints(path.parent.parent) if p != path]
            for prev in reversed(good):
                try:
                    ckpt.load(prev)
                except ckpt.CheckpointError:
                    continue
                msg += f"; the previous checkpoint {str(prev)!r} is intact: --resume {prev}"
                break
            raise UsageError(msg) from None

    def _setup(self, cfg, explicit):
        cfg, out, state = self._resolve_resume(cfg, explicit)
        self.cfg, self.out, self.resume_state = cfg, out, state
        self._setup_process(cfg, explicit)
        self._open_data(cfg, explicit)
        model = self._build_model(cfg)
        model = self._build_optimizer(model, cfg)
        if state is not None:
            self._restore(state)
        self._build_step(model, cfg)
        self._open_run(cfg, state)

    def _setup_process(self, cfg, explicit) -> None:
        """Threads, the device, the backend and glibc's allocator, before anything allocates."""
        if cfg["threads"]:
            self.scope.callback(torch.set_num_threads, torch.get_num_threads())
            torch.set_num_threads(cfg["threads"])
        self.device = _device(cfg, self.local_rank)
        _check_cuda_graphs(cfg, self.device, self.world)
        _check_backend(cfg, self.device)
        self.scope.enter_context(fusedres.use_backend(cfg["backend"]))
        # On CPU a budget bounds the process only if freed blocks leave it: set glibc's
        # thresholds before the data, the model and the optimizer allocate.
        self.allocator = None
        self.rss_baseline = None
        self.rss_peaks = None
        if self.device.type == "cpu" and cfg["memory_budget"] is not None:
            if settings.get("FUSEDRES_RELEASE_FREED_MEMORY"):
                applied, self.allocator = fusedres.memory.release_freed_memory()
                if not applied:
                    print(f"fusedres train: note: freed memory is not returned to the system: "
                          f"{self.allocator}", file=sys.stderr)
            # What the budget counts from: the memory the process has allocated with torch and
            # fusedres imported, before the data and the model exist (the plan adds to it every
            # tensor, the kernel workspace and the allocator's slack). The peak is reset to it
            # where Linux allows, so that the report's peak is this run's, not the imports'.
            try:
                self.rss_peaks = fusedres.memory.ResidentPeaks()
            except OSError:  # no RssAnon/RssFile: the whole resident set is measured
                fusedres.memory.reset_peak_rss()
            self.rss_baseline = fusedres.memory.rss_bytes()
        elif self.device.type == "cpu":
            # No budget: glibc keeps freed blocks for the next step instead of unmapping them
            # and faulting them in again (fusedres.memory.keep_freed_memory).
            applied, why = fusedres.memory.keep_freed_memory()
            self.allocator = why if applied else None
        if cfg["amp"] == "fp16" and self.device.type == "cpu" and cfg["compile"]:
            raise UsageError("--amp fp16 with --compile: not supported on CPU; use --amp bf16")
        self._resolve_layout(explicit)

    def _open_data(self, cfg, explicit) -> None:
        """The data, its batches and the schedule that follows from their count."""
        # In memory on the device, or streamed from disk (--dataset imagefolder).
        self.data, self.batches = data_mod.open_data(cfg, "data_dir" in explicit, self.device,
                                                     self.rank, self.world)
        # What loading the data added to the process: its tensors, and what the loader left
        # (scikit-learn's modules for digits); the plan counts the larger as resident. The
        # memory allocated, where Linux tells it apart from the pages of mapped files.
        self.data_rss = (None if self.rss_baseline is None
                         else self.rss_peaks.allocated_now() if self.rss_peaks is not None
                         else fusedres.memory.rss_bytes() - self.rss_baseline)
        ipe = self.batches.iters_per_epoch
        if self.batches.local % cfg["accum_steps"]:
            raise UsageError(f"--accum-steps {cfg['accum_steps']}: this process's batch of "
                             f"{self.batches.local} (--batch-size {cfg['batch_size']}"
                             + (f" over {self.world} processes" if self.world > 1 else "")
                             + ") does not split into equal micro-batches")
        self.max_iters = cfg["epochs"] * ipe if cfg["epochs"] else cfg["max_iters"]
        self.milestones = milestones(cfg, self.max_iters)
        self.schedule = LRSchedule(cfg, self.max_iters, self.milestones)
        self.mix = _mixer(cfg, self.data.num_classes)

    def _build_model(self, cfg) -> nn.Module:
        """The seeded model and its memory plan (the checkpoint's weights: :meth:`_restore`)."""
        torch.manual_seed(cfg["seed"])
        seed_python_and_numpy(cfg["seed"])
        in_chans = self.data.image_shape[0]
        model = build_model(cfg, in_chans, self.data.num_classes).to(self.device)
        if cfg["channels_last"]:
            model = model.to(memory_format=torch.channels_last)
        self.plan_summary = None
        self.memory_budget = None
        self.live: LiveTensorTracker | None = None
        self.device_warning = None
        if cfg["memory_budget"] is not None or cfg["activation_budget"] is not None:
            self.plan_summary = self._plan(model)
            if self.device.type == "cuda":
                total = torch.cuda.get_device_properties(self.device).total_memory
                self.device_warning = self._device_fit(total)
        self.model = model  # unwrapped: what checkpoints hold
        self.parameters = sum(p.numel() for p in model.parameters())
        return model

    def _build_optimizer(self, model: nn.Module, cfg) -> nn.Module:
        """--sync-bn, the optimizer, EMA and scaler (restored on --resume by
        :meth:`_restore`); returns the model the step trains (SyncBatchNorm converted)."""
        if self.world > 1 and cfg["sync_bn"]:
            # On GPUs torch's own SyncBatchNorm serves the plain BatchNorms (the fused ones are
            # routed to fusedres.distributed either way); it does not run on CPU tensors.
            model = (nn.SyncBatchNorm.convert_sync_batchnorm(model)
                     if self.device.type == "cuda" else fdist.convert_sync_batchnorm(model))
        # The learning rate lives on the device and is filled in place each step (the step
        # reads no value on the host: fusedres.apps.train.step).
        self.lr = lr_tensor(cfg["lr"], self.device)
        self.optimizer = _optimizer(_param_groups(model, cfg), self.lr, cfg)
        # --ema-decay: updated after each step, outside the step (and its CUDA graph):
        # AveragedModel's update reads its count on the host.
        # Of the unwrapped model (self.model: what checkpoints hold, before --sync-bn).
        self.ema = (_ema(self.model, cfg["ema_decay"]) if cfg["ema_decay"] is not None
                    else None)
        self.amp_dtype = _AMP[cfg["amp"]]
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg["amp"] == "fp16")
        return model

    def _restore(self, state) -> None:
        """--resume: the checkpoint's fields checked against what the run built (each tensor
        against the model's, the optimizer state against its parameters, the scheduler's and
        the scaler's against theirs, the iteration within the run: resume_checks), then loaded.
        Nothing is loaded unless all of it fits; a misfit is one UsageError naming the file and
        the field."""
        try:
            self._check_restorable(state)
        except resume_checks.FieldError as e:
            diverged = (state.get("accum") or {}).get("diverged_at")
            hint = (f" (the run diverged at iteration {diverged})"
                    if diverged is not None and "not finite" in str(e) else "")
            raise UsageError(f"--resume: checkpoint {str(self.resume_path)!r} does not fit this "
                             f"run (--model {self.cfg['model']}): {e}{hint}") from None
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            use_lr(self.optimizer, self.lr)
            start_momentum(self.optimizer)  # a parameter that had no gradient yet
            _state_like_params(self.optimizer)
            if state.get("scaler") and self.scaler.is_enabled():
                self.scaler.load_state_dict(state["scaler"])
            if self.ema is not None:
                self.ema.load_state_dict(state["ema"])
            if "lr_scheduler" in state:
                self.schedule.load_state_dict(state["lr_scheduler"])
            else:  # a checkpoint of an older fusedres: run the schedule up to it
                for _ in range(state["iteration"]):
                    self.schedule.step()
        except (ValueError, KeyError, RuntimeError, TypeError) as e:  # what the checks missed
            raise UsageError(f"--resume: checkpoint {str(self.resume_path)!r} does not fit this "
                             f"run (--model {self.cfg['model']}): {_first_line(e)}") from None

    def _check_restorable(self, state) -> None:
        rc = resume_checks
        for key in ("metrics", "rng"):
            if key not in state:
                raise rc.FieldError(f"{key}: expected in a checkpoint of fusedres train, found "
                                    "none")
        rc.check_iteration(state["iteration"], self.max_iters)
        rc.check_tensors(state["model"], self.model.state_dict(), "model")
        names = {id(p): n for n, p in self.model.named_parameters()}
        rc.check_optimizer(state["optimizer"], self.optimizer, names)
        if self.ema is not None:
            if "ema" not in state:
                raise rc.FieldError("ema: the checkpoint holds no EMA weights (its run had no "
                                    "--ema-decay)")
            rc.check_tensors(state["ema"], self.ema.state_dict(), "ema")
        if state.get("scaler") and self.scaler.is_enabled():
            live = self.scaler.state_dict()
            missing = [k for k in live if k not in state["scaler"]]
            if missing:
                raise rc.FieldError(f"scaler: expected {', '.join(missing)}, found none")
            rc.check_like(state["scaler"], live, "scaler")
        if "lr_scheduler" in state:
            saved = state["lr_scheduler"]["scheduler"]
            rc.check_like(saved, self.schedule.scheduler.state_dict(),
                          "lr_scheduler['scheduler']")
            # The scheduler steps once an iteration: its count is the checkpoint's iteration.
            if saved.get("last_epoch", state["iteration"]) != state["iteration"]:
                raise rc.FieldError(f"lr_scheduler['scheduler']['last_epoch']: expected "
                                    f"{state['iteration']} (the checkpoint's iteration), got "
                                    f"{saved['last_epoch']}")

    def _build_step(self, model: nn.Module, cfg) -> None:
        """The training step: DDP, torch.compile and CUDA graphs around ``model``."""
        self.saved_bytes = None
        if cfg["compile"] and cfg["amp"] == "none":
            # The first step's count (below) cannot see inside a compiled graph: count the
            # eager model on the meta device instead (the same count, nothing allocated).
            self.saved_bytes = self._saved_bytes_on_meta(model)
        train_model = model
        if self.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            train_model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        if cfg["compile"]:
            mode = cfg["compile"]
            train_model = torch.compile(train_model, mode=None if mode == "default" else mode)
        self.train_model = train_model
        self.probe = None
        if cfg["log_grad_norms"]:
            try:
                self.probe = GradNormProbe(self.model)
            except ValueError as e:
                raise UsageError(f"--log-grad-norms: --model {cfg['model']} "
                                 f"{_first_line(e).partition(': ')[2]}") from None
        self.step = TrainStep(train_model, self.optimizer, self.scaler, self.amp_dtype,
                              self.device.type, mark_step=cfg["compile"] == "reduce-overhead",
                              label_smoothing=cfg["label_smoothing"],
                              accum_steps=cfg["accum_steps"], probe=self.probe)
        self.run_step = GraphedStep(self.step) if cfg["cuda_graphs"] else self.step
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True

    def _open_run(self, cfg, state) -> None:
        """Everything is checked: lock and write the run directory, restore the counters."""
        # From here on the run directory may be written.
        if self.world > 1:
            dist.barrier()
        self._lock_out()
        if self.rank == 0:
            stale = ckpt.remove_stale_temporaries(self.out)
            if stale:
                print(f"fusedres train: removed {len(stale)} temporary file(s) a stopped run "
                      f"left in {str(self.out)!r}", file=sys.stderr)
        self.iteration = state["iteration"] if state is not None else 0
        self.history = list(state["metrics"]) if state is not None else []
        self.accum = dict(state.get("accum", {})) if state is not None else {}
        if state is not None and self.saved_bytes is None:
            self.saved_bytes = state.get("saved_activation_bytes")
        self.elapsed = state.get("elapsed_s", 0.0) if state is not None else 0.0
        # The first iteration whose training loss was not finite (kept across resumes).
        self.diverged_at = self.accum.get("diverged_at")
        if state is not None:
            ckpt.set_rng_state(state["rng"])
        self.log = None
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            self._write_config()
            self.log = M.MetricsLog(self.out, cfg["log_format"], self.history,
                                    cfg["tensorboard"])
        self.last_saved = self.iteration if state is not None else -1
        if self.rank == 0:
            self._banner()

    def _lock_out(self) -> None:
        """Rank 0 (the one that writes) holds ``--out``'s lock until the run ends: released
        when ``self.scope`` closes, or by the kernel if the process dies. Every rank learns the
        outcome, so that a refusal ends them all with the same exit code 2."""
        error = None
        if self.rank == 0:
            try:
                self.out.mkdir(parents=True, exist_ok=True)
                lock = RunLock(self.out)
            except RunLocked as e:
                error = str(e)
            except OSError as e:
                error = f"--out: cannot lock {str(self.out)!r}: {e.strerror or e}"
            else:
                self.scope.callback(lock.release)
                # The checkpoint check in _resume_state ran before the lock: a run that started,
                # wrote and ended in between is seen here.
                if self.cfg["resume"] is None and ckpt.list_checkpoints(self.out):
                    error = (f"--out: {str(self.out)!r} already holds a run (checkpoints); "
                             "continue it with --resume, or choose another --out")
        if self.world > 1:
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error is not None:
            raise UsageError(error)

    RESUMED = "as the run it resumes: "

    def _resolve_layout(self, explicit) -> None:
        """channels_last or NCHW, and why (``self.layout``), before anything is built.

        The resolved value replaces ``auto`` in ``self.cfg``, so config.yaml and the
        checkpoints hold it: a resumed run keeps its layout unless this command line sets
        --channels-last (its checkpoint's ``layout`` says where the value came from)."""
        cfg, state = self.cfg, self.resume_state
        if state is not None and "channels_last" not in explicit \
                and cfg["channels_last"] != "auto":
            saved = state.get("layout") or {}  # absent in checkpoints of older versions
            on = cfg["channels_last"]
            origin = saved.get("origin", "set")
            reason = saved.get("reason", f"its config's channels_last: {str(on).lower()}")
            if not reason.startswith(self.RESUMED):
                reason = self.RESUMED + reason
        else:
            dtype = _AMP[cfg["amp"]] or torch.float32
            on, reason = resolve_channels_last(cfg["channels_last"], self.device, dtype)
            origin = "auto" if cfg["channels_last"] == "auto" else "set"
        cfg["channels_last"] = on
        self.layout = {"channels_last": on, "origin": origin, "reason": reason}

    def layout_line(self) -> str:
        """The banner's layout line: ``layout: channels_last (auto: ...)``."""
        name = "channels_last" if self.layout["channels_last"] else "NCHW"
        return f"layout: {name} ({self.layout['reason']})"

    def _banner(self) -> None:
        cfg, d = self.cfg, self.data
        backend = (fusedres.resolve_backend(self.device) if cfg["fused"] else "plain PyTorch")
        c, h, w = d.image_shape
        ipe = self.batches.iters_per_epoch
        lines = [
            f"model {cfg['model']}{'' if cfg['depth'] is None else ' depth ' + str(cfg['depth'])}"
            f" ({self.parameters / 1e6:.3f} M parameters, "
            f"{'fused' if cfg['fused'] else 'plain'} blocks, backend {backend})",
            f"data {d.name}: {d.num_train} train / {d.num_test} test images {c}x{h}x{w}; "
            f"{self.max_iters} iterations = {self.max_iters / ipe:.1f} epochs of {ipe}, "
            f"batch {cfg['batch_size']}"
            + (f" over {self.world} processes" if self.world > 1 else ""),
            f"device {self.device}, {torch.get_num_threads()} threads, amp {cfg['amp']}; "
            f"run directory {self.out}",
            self.layout_line(),
        ]
        left = d.num_train - ipe * cfg["batch_size"]
        if left:
            lines.append(f"each epoch drops its last partial batch: {left} of the {d.num_train} "
                         f"training images (a different random subset each epoch), so that "
                         f"every step has the batch's shape")
        if cfg["cuda_graphs"]:
            lines.append(f"CUDA graphs: the whole training step (forward, loss, backward, SGD "
                         f"step) captured after {WARMUP_STEPS} eager warm-up steps on a side "
                         f"stream, then replayed; evaluation eager")
        if cfg["compile"]:
            lines.append(f"torch.compile, mode {cfg['compile']}")
        lines.append(self.recipe_line())
        if self.batches.describe() is not None:
            lines.append(self.batches.describe())
        if self.resume_state is not None:
            lines.append(f"resumed at iteration {self.iteration}")
        variant = _variant_line(cfg)
        if variant:
            lines.insert(1, variant)
        if cfg["sync_bn"]:
            lines.append("BatchNorm statistics synchronised over all processes" if self.world > 1
                         else "--sync-bn: one process, nothing to synchronise")
        if self.plan_summary is not None:
            lines += str(self.plan_summary).splitlines()
        if self.device_warning is not None:
            lines.append(f"warning: {self.device_warning}")
        for line in lines:
            print(f"fusedres train: {line}", file=sys.stderr)

    def recipe_line(self) -> str:
        """The banner's line for the optimiser, the schedule and the regularisers."""
        cfg = self.cfg
        opt = (f"AdamW betas {cfg['betas'][0]:g} {cfg['betas'][1]:g}"
               if cfg["optimizer"] == "adamw"
               else f"SGD momentum {cfg['momentum']:g}" + (" nesterov" if cfg["nesterov"]
                                                            else ""))
        skip = [w for w, on in (("norms", not cfg["bn_weight_decay"]),
                                ("biases", not cfg["bias_weight_decay"])) if on]
        sched = {"step": f"step x{cfg['lr_decay']:g} at {self.milestones}",
                 "cosine": f"cosine to {cfg['min_lr']:g}",
                 "poly": f"poly power {cfg['poly_power']:g}"}[cfg["schedule"]]
        warm = ("" if cfg["warmup_lr"] is None or not cfg["warmup_iters"]
                else f" at {cfg['warmup_lr']:g}")
        line = (f"recipe: {opt}, lr {cfg['lr']:g}, {cfg['warmup_iters']} warm-up iterations"
                f"{warm} then {sched}; weight decay {cfg['weight_decay']:g}"
                + (f" (not on {' and '.join(skip)})" if skip else ""))
        if cfg["label_smoothing"]:
            line += f"; label smoothing {cfg['label_smoothing']:g}"
        if cfg["ema_decay"] is not None:
            line += f"; EMA decay {cfg['ema_decay']:g} (evaluated)"
        mix = [f"{name} alpha {cfg[key]:g}" for name, key in (("MixUp", "mixup_alpha"),
                                                               ("CutMix", "cutmix_alpha"))
               if cfg[key]]
        if mix:
            line += "; " + " or ".join(mix) + (" (one per batch at random)" if len(mix) > 1
                                               else "")
        if cfg["accum_steps"] > 1:
            line += (f"; gradients accumulated over {cfg['accum_steps']} micro-batches of "
                     f"{self.batches.local // cfg['accum_steps']}")
        return line

    def _write_config(self) -> None:
        # A file --config reads back: options only, the file the run was given a comment.
        resolved = {k: v for k, v in self.cfg.items() if k != "config"}
        resolved["out"] = str(self.out)
        resolved["resume"] = None
        given = f"# --config {self.cfg['config']}\n" if self.cfg.get("config") else ""
        text = ("# fusedres train: the resolved configuration of this run\n"
                f"# {self.layout_line()}\n" + given + yaml.safe_dump(resolved, sort_keys=True)
                + "# what trained it (fusedres.apps.train.provenance; not an option)\n"
                + yaml.safe_dump({provenance.KEY: provenance.entries(
                    self.out, self.device, self.iteration)}, sort_keys=False))
        path = self.out / "config.yaml"
        with ckpt.writing(path):
            ckpt.write_atomically(path, lambda f: f.write(text.encode()))
