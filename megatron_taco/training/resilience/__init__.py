"""How a rank leaves: exit signals, time limits, launcher death (exit.py) and peer failures (peers.py)."""
