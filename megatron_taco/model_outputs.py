"""The names of a model's outputs that the generic driver reads: the counts the training
loop sums (training/loop.py) and the eval-mode outputs of the learning monitor
(training/observability/monitor.py). Models produce them (models/common/monitoring.py), the driver
consumes them, and neither may import the other (training/ knows no model), so the contract
sits here, below every subpackage, like arguments.py: it imports nothing of the package.
The one batch key the driver reads is here for the same reason (data/ builds batches).
"""

COUNT_SUFFIX = "_tokens"  # "<name>_tokens": a 0-d count, summed (not averaged) when logged

REPRESENTATION = "representation"  # [rows, s, H] last-layer vectors
REPRESENTATION_MASK = "representation_mask"  # [rows, s] bool: real tokens
LABEL_COUNTS_SUFFIX = "_label_counts"  # "<name>_label_counts": [C] int64 target counts

# A batch that carries DATA_FAULT (one line, str) was built around data its rank could not
# read (a store row that changed on disk): its collator placed something valid instead, so
# the rank stays in step, and the loop stops every rank with that line at the iteration's
# end, before anything is saved (training/loop.py).
DATA_FAULT = "data_fault"
