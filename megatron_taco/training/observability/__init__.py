"""What a run tells: the log and metrics file (log.py), TensorBoard and W&B (log.py, tracking.py), plots, the learning monitor (monitor.py) and device peaks (peaks.py)."""
