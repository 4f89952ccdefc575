"""Training a small real Inkling on checkable tasks: `python -m train.published` (train/published.py).

The trained checkpoint lives in `data/inkling-small-published/` (committed, its trained tensors and side
files; `train.published.materialize` makes it whole): what tests and benchmarks load when random weights
cannot show an effect (MTP acceptance, needle retrieval). train/data.py is the mixture, train/loop.py the
loop and its evaluation.
"""
