"""Scoring models on held-out problems: the loop the trainer and eval_agrpo.py share (accuracy.py), the evaluator's
statistics (metrics.py) and its cache of the reference's scores (reference_cache.py)."""
