"""Experiments on trained runs of ``fusedres train``: ``fusedres compare`` (runs side by side,
per variant over seeds, every pair of variants paired by seed with a bootstrap interval:
:mod:`.stats`; figures: :mod:`.compare_plots`), ``fusedres lesion`` (Veit et al. 2016, residual
units deleted at test time) and ``fusedres landscape`` (Li et al. 2018, the loss around the
trained weights along filter-normalised random directions; figures: :mod:`.landscape_plots`;
``--hessian``'s curvature maps: :mod:`.hessian`).

They read a run as the trainer wrote it (:mod:`fusedres.apps.experiments.runs`): its saved
configuration, the model built from it by the trainer's ``build_model``, a checkpoint's
weights, the run's dataset and normalisation. Every figure follows :mod:`.figures`' rules.
"""

__all__ = ["compare", "compare_plots", "figures", "hessian", "landscape", "landscape_plots",
           "lesion", "runs", "stats"]
