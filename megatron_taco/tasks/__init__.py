"""Downstream benchmarks: their released data layouts, features and metrics (GLUE, a custom TSV
classification task, SQuAD v1.1/v2.0, RACE). Data layer: imports megatron_taco.data only."""

from megatron_taco.tasks.base import (
    GLUE_TASKS,
    TASKS,
    FeatureDataset,
    TaskData,
    TaskDataError,
    TaskInfo,
    load_task,
)
from megatron_taco.tasks.metrics import GLUE_SCORE_TASKS, glue_score, glue_task_scores
from megatron_taco.tasks.squad import (
    normalize_answer,
    squad_v1_evaluate,
    squad_v2_evaluate,
    write_squad_predictions,
)

__all__ = [
    "GLUE_SCORE_TASKS",
    "GLUE_TASKS",
    "TASKS",
    "FeatureDataset",
    "TaskData",
    "TaskDataError",
    "TaskInfo",
    "glue_score",
    "glue_task_scores",
    "load_task",
    "normalize_answer",
    "squad_v1_evaluate",
    "squad_v2_evaluate",
    "write_squad_predictions",
]
