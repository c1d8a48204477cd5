"""Experiments on trained runs of ``fusedres train``: ``fusedres compare`` (runs side by side,
per variant over seeds), ``fusedres lesion`` (Veit et al. 2016,
residual units deleted at test time) and ``fusedres landscape`` (Li et al. 2018, the loss
around the trained weights along filter-normalised random directions).

Both read a run as the trainer wrote it (:mod:`fusedres.apps.experiments.runs`): its saved
configuration, the model built from it by the trainer's ``build_model``, a checkpoint's
weights, the run's dataset and normalisation.
"""

__all__ = ["compare", "figures", "landscape", "lesion", "runs"]
