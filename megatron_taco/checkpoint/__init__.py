"""Checkpoints and resume: the on-disk protocol, saving, loading, resharding, and the one
decision of what a run does with its --load and --save (plan.plan_resume)."""
