"""Facts about this process and its launcher, and the fault points: below every other package but errors/io."""
