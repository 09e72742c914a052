"""The names of a model's eval-mode outputs that the generic driver's learning monitor
(training/monitor.py) reads. Models produce them (models/common/monitoring.py), the driver
consumes them, and neither may import the other (training/ knows no model), so the contract
sits here, below every subpackage, like arguments.py: it imports nothing of the package.
"""

REPRESENTATION = "representation"  # [rows, s, H] last-layer vectors
REPRESENTATION_MASK = "representation_mask"  # [rows, s] bool: real tokens
LABEL_COUNTS_SUFFIX = "_label_counts"  # "<name>_label_counts": [C] int64 target counts
