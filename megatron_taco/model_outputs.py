"""The names of a model's outputs that the generic driver reads: the counts the training
loop sums (training/loop.py) and the eval-mode outputs of the learning monitor
(training/monitor.py). Models produce them (models/common/monitoring.py), the driver
consumes them, and neither may import the other (training/ knows no model), so the contract
sits here, below every subpackage, like arguments.py: it imports nothing of the package.
"""

COUNT_SUFFIX = "_tokens"  # "<name>_tokens": a 0-d count, summed (not averaged) when logged

REPRESENTATION = "representation"  # [rows, s, H] last-layer vectors
REPRESENTATION_MASK = "representation_mask"  # [rows, s] bool: real tokens
LABEL_COUNTS_SUFFIX = "_label_counts"  # "<name>_label_counts": [C] int64 target counts
